#include "delta_codec.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <type_traits>

#include "block_coder.h"
#include "checksum.h"
#include "parallel.h"
#include "simd_scan.h"

namespace syncd {

namespace {

using core::apply_value;
using core::code_value;
using core::unapply_value;

using core::max_value;

// Word `w` of a buffer of `nbytes` bytes, zero-padded past the end.
inline uint64_t word_at(const uint8_t* p, size_t nbytes, uint64_t w) {
  size_t off = size_t(w) * 8;
  if (off + 8 <= nbytes) return load_le64(p + off);
  uint8_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(buf, p + off, nbytes - off);
  return load_le64(buf);
}

void verify_payload(const Header& h, const uint8_t* blob, size_t b) {
  const BlockEntry& e = h.blocks[b];
  const uint8_t* p = blob + h.payload_offset[b];
  if (checksum_finalize(checksum_raw_range(p, 0, e.payload_bytes), e.payload_bytes) != e.payload_checksum)
    throw DeltaError("block " + std::to_string(b) + ": payload checksum mismatch (corrupt or altered blob)");
}

template <class T>
void scan_block(const uint8_t* ob, const uint8_t* nb, uint64_t numel, uint64_t start, uint64_t span, bool is_float,
                BlockChanges& c, uint64_t* sum_old, uint64_t* adj) {
  constexpr unsigned E = 8 / sizeof(T);
  constexpr unsigned W = sizeof(T) * 8;
  const size_t nbytes = size_t(numel) * sizeof(T);
  const uint64_t wbeg = start * sizeof(T) / 8;
  const uint64_t wend = ((start + span) * sizeof(T) + 7) / 8;
  const uint64_t wfull = std::min<uint64_t>(wend, nbytes / 8);
  uint64_t so = 0, ad = 0;
  c.pos.reserve(span / 32 + 16);
  c.v.reserve(span / 32 + 16);
  auto visit = [&](uint64_t w, uint64_t a, uint64_t bw) {
    ad += checksum_term(bw, w) - checksum_term(a, w);
    uint64_t x = a ^ bw;
    // one bit per nonzero lane, at the lane's top bit, without branches
    uint64_t nz = x;
    if constexpr (W < 64) {
      constexpr uint64_t lo = ~uint64_t(0) / ((uint64_t(1) << W) - 1) * ((uint64_t(1) << (W - 1)) - 1);
      nz = ((x & lo) + lo) | x;
      nz &= ~lo;
    } else {
      nz = x ? (uint64_t(1) << 63) : 0;
    }
    while (nz) {
      unsigned l = unsigned(__builtin_ctzll(nz)) / W;
      nz &= nz - 1;
      T ov = T(a >> (l * W % 64)), nv = T(bw >> (l * W % 64));
      c.pos.push_back(static_cast<uint32_t>(w * E + l - start));
      c.v.push_back(code_value<T>(ov, nv, is_float));
    }
  };
  // Sub-ranges of 32 KiB per stream: the changed words are visited while the range is still in L1/L2.
  constexpr uint64_t kSub = 4096;
  uint64_t masks[kSub / 64];
  for (uint64_t s0 = wbeg; s0 < wfull; s0 += kSub) {
    const uint64_t nwords = std::min(kSub, wfull - s0);
    so += checksum_and_diff_words(ob + 8 * s0, nb + 8 * s0, nwords, s0, masks);
    for (size_t g = 0; g < (nwords + 63) / 64; ++g) {
      for (uint64_t m = masks[g]; m; m &= m - 1) {
        uint64_t w = s0 + g * 64 + unsigned(__builtin_ctzll(m));
        visit(w, load_le64(ob + 8 * w), load_le64(nb + 8 * w));
      }
    }
  }
  if (wfull < wend) {  // the tensor's last, partial word (zero-padded in both)
    uint64_t a = word_at(ob, nbytes, wfull), bw = word_at(nb, nbytes, wfull);
    so += checksum_term(a, wfull);
    if (a != bw) visit(wfull, a, bw);
  }
  *sum_old = so;
  *adj = ad;
}

__attribute__((noinline)) BlockChanges& block_scratch() {  // not inlined: keeps TLS lookups out of loops
  thread_local BlockChanges c;
  return c;
}

struct Assembled {
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<BlockEntry> entries;
};

std::vector<uint8_t> assemble(const DTypeInfo& dt, const std::vector<uint64_t>& shape, int block_log2,
                              const Assembled& a, uint64_t base_ck, uint64_t new_ck) {
  std::vector<uint8_t> out = pack_header(dt, shape, block_log2, a.entries, base_ck, new_ck);
  size_t total = out.size();
  for (const auto& p : a.payloads) total += p.size();
  out.reserve(total);
  for (const auto& p : a.payloads) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// Entropy-codes block b's changes into a.payloads[b] / a.entries[b].
void code_block(const BlockChanges& c, Assembled& a, size_t b) {
  if (c.pos.empty()) return;
  encode_block(c, a.payloads[b]);
  const auto& p = a.payloads[b];
  if (p.size() > 0xFFFFFFFFull) throw DeltaError("block payload exceeds 4 GiB");
  a.entries[b] = {static_cast<uint32_t>(p.size()), static_cast<uint32_t>(c.pos.size()),
                  checksum_finalize(checksum_raw_range(p.data(), 0, p.size()), p.size())};
}

uint64_t numel_of(const std::vector<uint64_t>& shape) {
  if (shape.size() > kMaxNdim) throw DeltaError("rank exceeds 8");
  unsigned __int128 n = 1;
  for (uint64_t d : shape) {
    n *= d;
    if (n > kMaxNumel) throw DeltaError("tensor too large for the delta format");
  }
  return uint64_t(n);
}

template <class T>
std::vector<uint8_t> encode_typed(const uint8_t* ob, const uint8_t* nb, const DTypeInfo& dt,
                                  const std::vector<uint64_t>& shape, int block_log2, int threads) {
  uint64_t numel = numel_of(shape);
  size_t n_blocks = blocks_for(numel, block_log2);
  std::vector<uint64_t> sums(n_blocks, 0), adjs(n_blocks, 0);
  Assembled a;
  a.payloads.assign(n_blocks, {});
  a.entries.assign(n_blocks, {0, 0, 0});
  // scan and entropy-code each block in one work item, so one thread's coding overlaps another's streaming
  parallel_for(n_blocks, threads, [&](size_t b) {
    BlockChanges& c = block_scratch();  // keeps its capacity: no page faults on fresh memory per call
    c.clear();
    uint64_t start = uint64_t(b) << block_log2;
    uint64_t span = std::min<uint64_t>(uint64_t(1) << block_log2, numel - start);
    scan_block<T>(ob, nb, numel, start, span, dt.is_float, c, &sums[b], &adjs[b]);
    code_block(c, a, b);
  });
  uint64_t so = 0, ad = 0;
  for (size_t b = 0; b < n_blocks; ++b) {
    so += sums[b];
    ad += adjs[b];
  }
  uint64_t nbytes = numel * sizeof(T);
  return assemble(dt, shape, block_log2, a, checksum_finalize(so, nbytes), checksum_finalize(so + ad, nbytes));
}

// Applies in one pass per block: stream the decoded changes, checksum the target in 32 KiB steps just
// ahead of them, and write each change in place while its cache line is hot. No per-change buffers. If
// anything fails (a corrupt block, the base or the result checksum), the written changes are undone by
// decoding the same blocks again and applying each change backwards, before DeltaError propagates, so the
// caller sees the target unchanged.
template <class T>
void apply_typed(uint8_t* target, const uint8_t* blob, const Header& h, bool verify, int threads) {
  const uint64_t numel = h.numel;
  const size_t nbytes = size_t(numel) * sizeof(T);
  constexpr unsigned E = 8 / sizeof(T);
  constexpr unsigned W = sizeof(T) * 8;
  const bool is_float = h.dtype.is_float;
  size_t nb = h.blocks.size();
  std::vector<uint32_t> written(nb, 0);
  std::vector<uint64_t> adjs(nb, 0), block_sums(nb, 0);
  T* tgt = reinterpret_cast<T*>(target);
  auto decoder = [&](size_t b) {
    const BlockEntry& e = h.blocks[b];
    return std::make_unique<BlockDecoder>(blob + h.payload_offset[b], e.payload_bytes, e.n_changed, h.block_span(b),
                                          int(W), b);
  };
  auto undo = [&] {
    parallel_for(nb, threads, [&](size_t b) {
      if (!written[b]) return;
      auto dec = decoder(b);  // replays exactly the changes that were decoded and written before
      const uint64_t start = h.block_start(b);
      for (uint32_t i = 0; i < written[b]; ++i) {
        uint32_t p;
        uint64_t v;
        dec->next(&p, &v);
        tgt[start + p] = unapply_value<T>(tgt[start + p], v, is_float);
      }
    });
  };
  try {
    parallel_for(nb, threads, [&](size_t b) {
      const size_t lo = size_t(h.block_start(b)) * sizeof(T);
      const size_t hi = lo + size_t(h.block_span(b)) * sizeof(T);
      const BlockEntry& e = h.blocks[b];
      if (!e.n_changed) {
        if (verify) block_sums[b] = checksum_raw_range(target, lo, hi);
        return;
      }
      verify_payload(h, blob, b);
      auto dec = decoder(b);
      size_t ck_at = lo;
      uint64_t base_sum = 0;
      auto checksum_upto = [&](size_t byte) {  // checksum every 32 KiB step up to and including `byte`
        while (ck_at <= byte && ck_at < hi) {
          size_t end_b = std::min(hi, ck_at + (size_t(1) << 15));
          base_sum += checksum_raw_range(target, ck_at, end_b);
          ck_at = end_b;
        }
      };
      const uint64_t start = h.block_start(b);
      uint64_t ad = 0, cur = ~uint64_t(0), oldw = 0, neww = 0;
      constexpr uint32_t kBatch = 256;
      uint32_t bp[kBatch];
      uint64_t bv[kBatch];
      for (uint32_t i = 0; i < e.n_changed; ++i) {
        uint32_t k = i % kBatch;
        if (k == 0) dec->next_batch(bp, bv, std::min<uint32_t>(kBatch, e.n_changed - i));
        const uint64_t v = bv[k];
        uint64_t idx = start + bp[k];
        uint64_t w = idx / E;
        if (verify) {
          checksum_upto(size_t(idx) * sizeof(T));
          if (w != cur) {
            if (cur != ~uint64_t(0)) ad += checksum_term(neww, cur) - checksum_term(oldw, cur);
            cur = w;
            oldw = neww = word_at(target, nbytes, w);  // read before this word's first write
          }
        }
        T nv = apply_value<T>(tgt[idx], v, is_float);
        tgt[idx] = nv;
        written[b] = i + 1;
        if (verify) {
          unsigned sh = unsigned(idx % E) * W % 64;
          uint64_t lane = (W == 64) ? ~uint64_t(0) : ((uint64_t(1) << W) - 1) << sh;
          neww = (neww & ~lane) | ((uint64_t(nv) << sh) & lane);
        }
      }
      dec->finish();
      if (verify) {
        if (cur != ~uint64_t(0)) ad += checksum_term(neww, cur) - checksum_term(oldw, cur);
        checksum_upto(hi);
        block_sums[b] = base_sum;
        adjs[b] = ad;
      }
    });
    if (verify) {
      uint64_t raw_old = 0, ad = 0;
      for (uint64_t x : block_sums) raw_old += x;
      for (uint64_t x : adjs) ad += x;
      uint64_t have = checksum_finalize(raw_old, nbytes);
      if (have != h.base_checksum) {
        char msg[160];
        std::snprintf(msg, sizeof msg, "wrong base: blob expects base checksum %#018llx, target has %#018llx",
                      (unsigned long long)h.base_checksum, (unsigned long long)have);
        throw DeltaError(msg);
      }
      if (checksum_finalize(raw_old + ad, nbytes) != h.new_checksum)
        throw DeltaError("result checksum mismatch: the decoded tensor differs from the encoder's");
    }
  } catch (...) {
    undo();
    throw;
  }
}

template <class F>
auto by_width(int bits, F&& f) {
  switch (bits) {
    case 8: return f(uint8_t{});
    case 16: return f(uint16_t{});
    case 32: return f(uint32_t{});
    default: return f(uint64_t{});
  }
}

}  // namespace

std::vector<uint8_t> delta_encode(const uint8_t* old_bytes, const uint8_t* new_bytes, int dtype_code,
                                  const std::vector<uint64_t>& shape, int block_log2, int threads) {
  DTypeInfo dt = dtype_info(dtype_code);
  if (block_log2 < kMinBlockLog2 || block_log2 > kMaxBlockLog2) throw DeltaError("block_log2 out of range");
  return by_width(dt.bits, [&](auto tag) {
    return encode_typed<decltype(tag)>(old_bytes, new_bytes, dt, shape, block_log2, threads);
  });
}

void delta_apply(uint8_t* target, const uint8_t* blob, size_t blob_len, int dtype_code,
                 const std::vector<uint64_t>& shape, bool verify, int threads) {
  Header h = parse_header(blob, blob_len);
  check_target(h, dtype_code, shape);
  by_width(h.dtype.bits, [&](auto tag) { apply_typed<decltype(tag)>(target, blob, h, verify, threads); });
}

std::vector<uint8_t> delta_pack(int dtype_code, const std::vector<uint64_t>& shape, int block_log2,
                                const uint64_t* pos, const uint64_t* v, size_t n, uint64_t base_checksum,
                                uint64_t new_checksum, int threads) {
  DTypeInfo dt = dtype_info(dtype_code);
  if (block_log2 < kMinBlockLog2 || block_log2 > kMaxBlockLog2) throw DeltaError("block_log2 out of range");
  uint64_t numel = numel_of(shape);
  const uint64_t vmax = max_value(dt.bits);
  for (size_t i = 0; i < n; ++i) {
    if (pos[i] >= numel || (i && pos[i] <= pos[i - 1])) throw DeltaError("pack: positions must be ascending and inside the tensor");
    if (v[i] > vmax) throw DeltaError("pack: value too wide for the dtype");
  }
  size_t n_blocks = blocks_for(numel, block_log2);
  Assembled a;
  a.payloads.assign(n_blocks, {});
  a.entries.assign(n_blocks, {0, 0, 0});
  parallel_for(n_blocks, threads, [&](size_t b) {
    BlockChanges& c = block_scratch();
    uint64_t lo = uint64_t(b) << block_log2, hi = lo + (uint64_t(1) << block_log2);
    size_t i0 = std::lower_bound(pos, pos + n, lo) - pos, i1 = std::lower_bound(pos, pos + n, hi) - pos;
    c.pos.resize(i1 - i0);
    c.v.assign(v + i0, v + i1);
    for (size_t i = i0; i < i1; ++i) c.pos[i - i0] = static_cast<uint32_t>(pos[i] - lo);
    code_block(c, a, b);
  });
  return assemble(dt, shape, block_log2, a, base_checksum, new_checksum);
}

void delta_unpack_into(const Header& h, const uint8_t* blob, uint64_t* pos, uint64_t* v, int threads) {
  size_t nb = h.blocks.size();
  std::vector<size_t> first(nb + 1, 0);
  for (size_t b = 0; b < nb; ++b) first[b + 1] = first[b] + h.blocks[b].n_changed;
  parallel_for(nb, threads, [&](size_t b) {
    const BlockEntry& e = h.blocks[b];
    if (!e.n_changed) return;
    verify_payload(h, blob, b);
    BlockDecoder dec(blob + h.payload_offset[b], e.payload_bytes, e.n_changed, h.block_span(b), h.dtype.bits, b);
    uint64_t start = h.block_start(b);
    uint64_t* pb = pos + first[b];
    uint64_t* vb = v + first[b];
    constexpr size_t kBatch = 256;
    uint32_t bp[kBatch];
    for (size_t i = 0; i < e.n_changed; i += kBatch) {
      size_t k = std::min<size_t>(kBatch, e.n_changed - i);
      dec.next_batch(bp, vb + i, k);
      for (size_t j = 0; j < k; ++j) pb[i + j] = start + bp[j];
    }
    dec.finish();
  });
}

}  // namespace syncd
