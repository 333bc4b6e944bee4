#include "delta_codec.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <cstdio>
#include <memory>
#include <type_traits>

#include "block_coder.h"
#include "block_v2.h"
#include "changes_pool.h"
#include "checksum.h"
#include "parallel.h"
#include "simd_scan.h"
#include "word_dispatch.h"

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

// Changes of word w (which differs: a != bw) into pos[]/v[] at k; adds its checksum change to *ad.
template <class T>
inline size_t visit_word(uint64_t w, uint64_t a, uint64_t bw, uint64_t start, bool is_float, uint32_t* pos,
                         uint64_t* v, size_t k, uint64_t* ad) {
  constexpr unsigned E = 8 / sizeof(T);
  constexpr unsigned W = sizeof(T) * 8;
  *ad += checksum_term(bw, w) - checksum_term(a, w);
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
    pos[k] = static_cast<uint32_t>(w * E + l - start);
    v[k++] = code_value<T>(ov, nv, is_float);
  }
  return k;
}

// Scans one block: the checksum of its old words (*sum_old), the checksum change to the new words (*adj),
// and every change, fed to `enc` one 64-word group at a time while the group is still in L1.
template <class T, class Enc>
void scan_block(const uint8_t* ob, const uint8_t* nb, uint64_t numel, uint64_t start, uint64_t span, bool is_float,
                Enc& enc, uint64_t* sum_old, uint64_t* adj) {
  constexpr unsigned E = 8 / sizeof(T);
  const size_t nbytes = size_t(numel) * sizeof(T);
  const uint64_t wbeg = start * sizeof(T) / 8;
  const uint64_t wend = ((start + span) * sizeof(T) + 7) / 8;
  const uint64_t wfull = std::min<uint64_t>(wend, nbytes / 8);
  uint64_t so = 0, ad = 0;
  constexpr size_t kGroupMax = 64 * E + 32;  // changes in one group, plus the vector stores' slack
  uint32_t pos[kGroupMax];
  uint64_t v[kGroupMax];
  // Sub-ranges of 32 KiB per stream: the changed words are visited while the range is still in L1/L2.
  constexpr uint64_t kSub = 4096;
  uint64_t masks[kSub / 64];
  for (uint64_t s0 = wbeg; s0 < wfull; s0 += kSub) {
    const uint64_t nwords = std::min(kSub, wfull - s0);
    so += checksum_and_diff_words(ob + 8 * s0, nb + 8 * s0, nwords, s0, masks);
    for (size_t g = 0; g < (nwords + 63) / 64; ++g) {
      const uint64_t m = masks[g];
      if (!m) continue;
      const uint64_t w0 = s0 + g * 64;
      size_t k = 0;
      if constexpr (sizeof(T) == 2) {
        k = extract_changes16(ob + 8 * w0, nb + 8 * w0, m, w0, static_cast<uint32_t>(w0 * E - start), is_float, pos,
                              v, &ad);
      } else {
        for (uint64_t mm = m; mm; mm &= mm - 1) {
          uint64_t w = w0 + unsigned(__builtin_ctzll(mm));
          k = visit_word<T>(w, load_le64(ob + 8 * w), load_le64(nb + 8 * w), start, is_float, pos, v, k, &ad);
        }
      }
      enc.add(pos, v, k);
    }
  }
  if (wfull < wend) {  // the tensor's last, partial word (zero-padded in both)
    uint64_t a = word_at(ob, nbytes, wfull), bw = word_at(nb, nbytes, wfull);
    so += checksum_term(a, wfull);
    if (a != bw) enc.add(pos, v, visit_word<T>(wfull, a, bw, start, is_float, pos, v, 0, &ad));
  }
  *sum_old = so;
  *adj = ad;
}

struct Assembled {
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<BlockEntry> entries;
};

std::vector<uint8_t> assemble(const DTypeInfo& dt, const std::vector<uint64_t>& shape, int block_log2,
                              const Assembled& a, uint64_t base_ck, uint64_t new_ck, int version) {
  std::vector<uint8_t> out = pack_header(dt, shape, block_log2, a.entries, base_ck, new_ck, version);
  size_t total = out.size();
  for (const auto& p : a.payloads) total += p.size();
  out.reserve(total);
  for (const auto& p : a.payloads) out.insert(out.end(), p.begin(), p.end());
  return out;
}

void enter_block(uint64_t count, Assembled& a, size_t b) {
  const auto& p = a.payloads[b];
  if (p.size() > 0xFFFFFFFFull) throw DeltaError("block payload exceeds 4 GiB");
  a.entries[b] = {static_cast<uint32_t>(p.size()), static_cast<uint32_t>(count),
                  checksum_finalize(checksum_raw_range(p.data(), 0, p.size()), p.size())};
}

// Writes the changes gathered in `enc` as block b's payload into a.payloads[b] / a.entries[b] (format 1).
void code_block(BlockEncoder& enc, Assembled& a, size_t b) {
  if (!enc.count()) return;
  enc.finish(a.payloads[b]);
  enter_block(enc.count(), a, b);
}

// Format 2: the block's old classes come from `cs` (e_top: see V2BlockEncoder::finish).
void code_block(V2BlockEncoder& enc, Assembled& a, size_t b, const DTypeInfo& dt, const ClassSource& cs, int e_top) {
  if (!enc.count()) return;
  enc.finish(a.payloads[b], dt, cs, e_top);
  enter_block(enc.count(), a, b);
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

// Applies one block's n changes from `dec` to `target` (bytes [lo, hi) hold the block; nbytes the whole
// tensor). With verify, also sets *base_sum to the checksum terms of the block's old bytes and *adj to their
// change. *written counts the changes written so far, exact whenever this throws (a corrupt block).
// Dense blocks checksum each 32 KiB step before and after its changes while it is in L1; sparse ones read
// every step once, ahead of its changes, and adjust the terms of the changed words only.
template <class T, class Source>
void apply_block(Source& dec, uint32_t n, uint8_t* target, size_t nbytes, size_t lo, size_t hi,
                 bool is_float, bool verify, uint32_t* written, uint64_t* base_sum, uint64_t* adj) {
  constexpr unsigned E = 8 / sizeof(T);
  constexpr unsigned W = sizeof(T) * 8;
  constexpr size_t kStep = size_t(1) << 15;
  constexpr uint32_t kBatch = 256;
  T* const tgt = reinterpret_cast<T*>(target);
  const uint64_t start = lo / sizeof(T);
  const bool dense = verify && uint64_t(n) * 16 > (hi - lo) / sizeof(T);
  uint32_t bp[kBatch];
  uint64_t bv[kBatch];
  uint64_t old_sum = 0, ad = 0, cur = ~uint64_t(0), oldw = 0, neww = 0;
  size_t step_lo = lo, step_hi = lo;  // dense: the step being changed; sparse: checksummed up to step_hi
  if (dense) {  // ad collects new minus old terms of every step with changes
    step_hi = std::min(hi, lo + kStep);
    old_sum = checksum_raw_range(target, step_lo, step_hi);
    ad = 0 - old_sum;
  }
  for (uint32_t i = 0; i < n; i += kBatch) {
    const uint32_t k = std::min(kBatch, n - i);
    *written = i;
    dec.next_batch(bp, bv, k);
    for (uint32_t j = 0; j < k; ++j) {
      const uint64_t idx = start + bp[j];
      const size_t byte = size_t(idx) * sizeof(T);
      if (dense) {
        while (byte >= step_hi) {  // step done: its new terms, then the next step's old ones
          ad += checksum_raw_range(target, step_lo, step_hi);
          step_lo = step_hi;
          step_hi = std::min(hi, step_lo + kStep);
          uint64_t s = checksum_raw_range(target, step_lo, step_hi);
          old_sum += s;
          ad -= s;
        }
      } else if (verify) {
        while (step_hi <= byte) {
          size_t e = std::min(hi, step_hi + kStep);
          old_sum += checksum_raw_range(target, step_hi, e);
          step_hi = e;
        }
        const uint64_t w = idx / E;
        if (w != cur) {
          if (cur != ~uint64_t(0)) ad += checksum_term(neww, cur) - checksum_term(oldw, cur);
          cur = w;
          oldw = neww = word_at(target, nbytes, w);  // read before this word's first write
        }
      }
      const T nv = apply_value<T>(tgt[idx], bv[j], is_float);
      tgt[idx] = nv;
      if (!dense && verify) {
        const unsigned sh = unsigned(idx % E) * W % 64;
        const uint64_t lane = (W == 64) ? ~uint64_t(0) : ((uint64_t(1) << W) - 1) << sh;
        neww = (neww & ~lane) | ((uint64_t(nv) << sh) & lane);
      }
    }
  }
  *written = n;
  dec.finish();
  if (!verify) return;
  if (dense) {
    ad += checksum_raw_range(target, step_lo, step_hi);
  } else if (cur != ~uint64_t(0)) {
    ad += checksum_term(neww, cur) - checksum_term(oldw, cur);
  }
  if (step_hi < hi) old_sum += checksum_raw_range(target, step_hi, hi);  // the unchanged rest
  *base_sum = old_sum;
  *adj = ad;
}


// ---- many tensors, one pool: every block of every tensor is one work item, so both cores stay busy across
// tensors of one or two blocks (most of a model's) and there is one call for the whole list.

struct EncodeTask {
  DTypeInfo dt;
  uint64_t numel = 0;
  Assembled a;
  std::vector<uint64_t> sums, adjs;
};

struct ApplyTask {
  Header h;
  std::vector<uint32_t> written;  // changes written per block: what undo() reverses
  std::vector<PooledChanges> decoded;  // format 2: each context block's changes, kept for undo
  std::vector<uint64_t> sums, adjs;
  bool target_checked = false;  // h was parsed and matches the target's dtype and shape
  std::atomic<bool> failed{false};
  std::string error;
  std::mutex m;
  void fail(const std::string& msg) {
    std::lock_guard<std::mutex> lock(m);
    if (!failed.load()) error = msg;
    failed.store(true);
  }
};

struct Item {
  uint32_t task, block;
  uint64_t cost;  // items run most expensive first: the pool's tail stays short
};

void run_largest_first(std::vector<Item>& items, int threads, const std::function<void(const Item&)>& body) {
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  parallel_for(items.size(), threads, [&](size_t i) { body(items[i]); });
}

// The format-1 payload of block b: the whole payload in format 1, the payload after its mode byte in a
// format-2 mode-0 block; null for a context block (verify_payload has checked the payload's bytes).
const uint8_t* order0_payload(const Header& h, const uint8_t* blob, size_t b, size_t* len) {
  const uint8_t* p = blob + h.payload_offset[b];
  *len = h.blocks[b].payload_bytes;
  if (h.version == 1) return p;
  if (*len == 0 || p[0] != kModeOrder0) return nullptr;  // a context block, or a malformed one for V2BlockDecoder
  *len -= 1;
  return p + 1;
}

template <class T>
void undo_block(const ApplyTask& t, const ApplyJob& j, size_t b) {
  const Header& h = t.h;
  const BlockEntry& e = h.blocks[b];
  T* tgt = reinterpret_cast<T*>(j.target);
  const uint64_t start = h.block_start(b);
  size_t len;
  const uint8_t* payload = order0_payload(h, j.blob, b, &len);
  if (!payload) {  // the positions depend on the old values: undo from the decoded changes
    apply_changes(j.target + start * sizeof(T), *t.decoded[b], h.dtype, start * sizeof(T) / 8, false);
    return;
  }
  BlockDecoder dec(payload, len, e.n_changed, h.block_span(b), int(sizeof(T) * 8), b);
  for (uint32_t i = 0; i < t.written[b]; ++i) {  // replays exactly the changes decoded and written before
    uint32_t p;
    uint64_t v;
    dec.next(&p, &v);
    tgt[start + p] = unapply_value<T>(tgt[start + p], v, h.dtype.is_float);
  }
}

template <class T>
void apply_item(ApplyTask& t, const ApplyJob& j, size_t b, bool verify) {
  const Header& h = t.h;
  const size_t lo = size_t(h.block_start(b)) * sizeof(T);
  const size_t hi = lo + size_t(h.block_span(b)) * sizeof(T);
  const BlockEntry& e = h.blocks[b];
  if (!e.n_changed) {
    if (verify) t.sums[b] = checksum_raw_range(j.target, lo, hi);
    return;
  }
  verify_payload(h, j.blob, b);
  size_t len;
  const uint8_t* payload = order0_payload(h, j.blob, b, &len);
  if (!payload) {  // a context block: decode everything first, the positions depend on the old values
    V2BlockDecoder dec;
    dec.parse(j.blob + h.payload_offset[b], e.payload_bytes, e.n_changed, h.block_span(b), h.dtype, b);
    ClassSource cs;
    cs.old = j.target + lo;
    cs.first_word = lo / 8;
    t.decoded[b] = take_changes(decoded_bytes(h.block_span(b), e.n_changed, h.dtype));
    BlockChanges& d = *t.decoded[b];
    dec.decode(cs, d);
    if (verify) t.sums[b] = d.has_old_sum ? d.old_sum : checksum_raw_range(j.target, lo, hi);
    const uint64_t ad = apply_changes(j.target + lo, d, h.dtype, lo / 8, true, verify);
    t.written[b] = e.n_changed;
    if (verify) t.adjs[b] = ad;
    return;
  }
  BlockDecoder dec(payload, len, e.n_changed, h.block_span(b), int(sizeof(T) * 8), b);
  apply_block<T>(dec, e.n_changed, j.target, size_t(h.numel) * sizeof(T), lo, hi, h.dtype.is_float, verify,
                 &t.written[b], &t.sums[b], &t.adjs[b]);
}

std::string wrong_base(uint64_t want, uint64_t have) {
  char msg[160];
  std::snprintf(msg, sizeof msg, "wrong base: blob expects base checksum %#018llx, target has %#018llx",
                (unsigned long long)want, (unsigned long long)have);
  return msg;
}

// The base and result checksums of a task whose blocks all ran; the first mismatch fails it.
void check_sums(ApplyTask& t) {
  uint64_t raw_old = 0, ad = 0;
  for (uint64_t x : t.sums) raw_old += x;
  for (uint64_t x : t.adjs) ad += x;
  const uint64_t nbytes = t.h.numel * (t.h.dtype.bits / 8);
  uint64_t have = checksum_finalize(raw_old, nbytes);
  if (have != t.h.base_checksum) {
    t.fail(wrong_base(t.h.base_checksum, have));
  } else if (checksum_finalize(raw_old + ad, nbytes) != t.h.new_checksum) {
    t.fail("result checksum mismatch: the decoded tensor differs from the encoder's");
  }
}

}  // namespace

std::vector<std::vector<uint8_t>> delta_encode_many(const std::vector<EncodeJob>& jobs, int block_log2,
                                                    int threads, int version) {
  if (block_log2 < kMinBlockLog2 || block_log2 > kMaxBlockLog2) throw DeltaError("block_log2 out of range");
  if (version < kMinFormat || version > kMaxFormat) throw DeltaError("unknown delta format version " + std::to_string(version));
  std::vector<EncodeTask> tasks(jobs.size());
  std::vector<Item> items;
  for (size_t t = 0; t < jobs.size(); ++t) {
    EncodeTask& k = tasks[t];
    k.dt = dtype_info(jobs[t].dtype_code);
    k.numel = numel_of(jobs[t].shape);
    size_t nb = blocks_for(k.numel, block_log2);
    k.a.payloads.assign(nb, {});
    k.a.entries.assign(nb, {0, 0, 0});
    k.sums.assign(nb, 0);
    k.adjs.assign(nb, 0);
    for (size_t b = 0; b < nb; ++b) {  // an encode item's cost is its span: elements scanned
      const uint64_t start = uint64_t(b) << block_log2;
      items.push_back({uint32_t(t), uint32_t(b), std::min<uint64_t>(uint64_t(1) << block_log2, k.numel - start)});
    }
  }
  // scan and entropy-code each block in one work item, so one thread's coding overlaps another's streaming
  run_largest_first(items, threads, [&](const Item& it) {
    EncodeTask& k = tasks[it.task];
    const EncodeJob& j = jobs[it.task];
    const uint64_t start = uint64_t(it.block) << block_log2;
    if (version == 2) {
      V2BlockEncoder& enc = thread_v2_encoder();
      const size_t w = size_t(k.dt.bits / 8);
      if (k.dt.bits == 16) {
        enc.scan16(reinterpret_cast<const uint16_t*>(j.old_bytes) + start,
                   reinterpret_cast<const uint16_t*>(j.new_bytes) + start, it.cost, start / 4, k.dt,
                   &k.sums[it.block], &k.adjs[it.block]);
      } else {
        enc.reset(it.cost, k.dt);
        by_word_bytes(int(w), [&](auto tag) {
          scan_block<decltype(tag)>(j.old_bytes, j.new_bytes, k.numel, start, it.cost, k.dt.is_float, enc,
                                    &k.sums[it.block], &k.adjs[it.block]);
        });
      }
      ClassSource cs;
      cs.old = j.old_bytes + start * w;
      code_block(enc, k.a, it.block, k.dt, cs, 0);
      return;
    }
    BlockEncoder& enc = thread_block_encoder();  // keeps its capacity: no page faults on fresh memory per call
    enc.reset();
    by_word_bytes(k.dt.bits / 8, [&](auto tag) {
      scan_block<decltype(tag)>(j.old_bytes, j.new_bytes, k.numel, start, it.cost, k.dt.is_float, enc,
                                &k.sums[it.block], &k.adjs[it.block]);
    });
    code_block(enc, k.a, it.block);
  });
  std::vector<std::vector<uint8_t>> out(jobs.size());
  parallel_for(jobs.size(), threads, [&](size_t t) {
    EncodeTask& k = tasks[t];
    uint64_t so = 0, ad = 0;
    for (size_t b = 0; b < k.sums.size(); ++b) {
      so += k.sums[b];
      ad += k.adjs[b];
    }
    const uint64_t nbytes = k.numel * (k.dt.bits / 8);
    out[t] = assemble(k.dt, jobs[t].shape, block_log2, k.a, checksum_finalize(so, nbytes),
                      checksum_finalize(so + ad, nbytes), version);
    k.a = Assembled();  // payloads are copied: free them as we go
  });
  return out;
}

std::vector<uint8_t> delta_encode(const uint8_t* old_bytes, const uint8_t* new_bytes, int dtype_code,
                                  const std::vector<uint64_t>& shape, int block_log2, int threads, int version) {
  return std::move(delta_encode_many({{old_bytes, new_bytes, dtype_code, shape}}, block_log2, threads, version)[0]);
}

// Each tensor in one pass per block: stream the decoded changes, checksum the target in 32 KiB steps, and
// write each change in place while its cache line is hot. No per-change buffers. If anything fails for a
// tensor (a corrupt block, the base or the result checksum), its written changes are undone by decoding the
// same blocks again and applying each change backwards, so the caller sees that tensor unchanged.
std::vector<std::string> delta_apply_many(const std::vector<ApplyJob>& jobs, bool verify, int threads) {
  std::vector<std::unique_ptr<ApplyTask>> tasks;
  std::vector<Item> items;
  for (size_t t = 0; t < jobs.size(); ++t) {
    tasks.push_back(std::make_unique<ApplyTask>());
    ApplyTask& k = *tasks.back();
    try {
      k.h = parse_header(jobs[t].blob, jobs[t].blob_len);
      check_target(k.h, jobs[t].dtype_code, jobs[t].shape);
      k.target_checked = true;
    } catch (const DeltaError& e) {
      k.fail(e.what());
      continue;
    }
    size_t nb = k.h.blocks.size();
    k.written.assign(nb, 0);
    if (k.h.version == 2) k.decoded.resize(nb);
    k.sums.assign(nb, 0);
    k.adjs.assign(nb, 0);
    for (size_t b = 0; b < nb; ++b)  // a block's cost: its bytes read plus its changes decoded
      items.push_back({uint32_t(t), uint32_t(b), k.h.block_span(b) + 16 * uint64_t(k.h.blocks[b].n_changed)});
  }
  std::exception_ptr internal;
  std::mutex internal_m;
  run_largest_first(items, threads, [&](const Item& it) {
    ApplyTask& k = *tasks[it.task];
    if (k.failed.load(std::memory_order_relaxed)) return;
    try {
      by_word_bytes(k.h.dtype.bits / 8,
                    [&](auto tag) { apply_item<decltype(tag)>(k, jobs[it.task], it.block, verify); });
    } catch (const DeltaError& e) {
      k.fail(e.what());
    } catch (...) {  // not the blob's fault (e.g. out of memory): undo everything, then rethrow
      std::lock_guard<std::mutex> lock(internal_m);
      if (!internal) internal = std::current_exception();
      k.fail("internal error");
    }
  });
  if (verify)
    for (auto& k : tasks)
      if (!k->failed.load() && !internal) check_sums(*k);
  std::vector<Item> undo;
  for (const Item& it : items) {
    const ApplyTask& k = *tasks[it.task];
    if ((k.failed.load() || internal) && k.written[it.block]) undo.push_back(it);
  }
  run_largest_first(undo, threads, [&](const Item& it) {
    by_word_bytes(tasks[it.task]->h.dtype.bits / 8,
                  [&](auto tag) { undo_block<decltype(tag)>(*tasks[it.task], jobs[it.task], it.block); });
  });
  if (internal) std::rethrow_exception(internal);
  // Format 2: a wrong base gives wrong classes, so a context block usually fails to decode before the base
  // checksum is known. The target is restored by now: say what is wrong if its checksum differs.
  if (verify)
    for (size_t t = 0; t < tasks.size(); ++t) {
      ApplyTask& k = *tasks[t];
      // only a header that matches the target says how many bytes the target has
      if (!k.failed.load() || !k.target_checked || k.h.version != 2 || k.h.blocks.empty()) continue;
      if (k.error.rfind("wrong base", 0) == 0) continue;
      const uint64_t nbytes = k.h.numel * (k.h.dtype.bits / 8);
      const uint64_t have = checksum_finalize(checksum_raw_range(jobs[t].target, 0, nbytes), nbytes);
      if (have != k.h.base_checksum) k.error = wrong_base(k.h.base_checksum, have);
    }
  std::vector<std::string> errors;
  for (auto& k : tasks) errors.push_back(k->failed.load() ? k->error : std::string());
  return errors;
}

void delta_apply(uint8_t* target, const uint8_t* blob, size_t blob_len, int dtype_code,
                 const std::vector<uint64_t>& shape, bool verify, int threads) {
  std::string err = delta_apply_many({{target, blob, blob_len, dtype_code, shape}}, verify, threads)[0];
  if (!err.empty()) throw DeltaError(err);
}

std::vector<uint8_t> delta_pack(int dtype_code, const std::vector<uint64_t>& shape, int block_log2,
                                const uint64_t* pos, const uint64_t* v, size_t n, uint64_t base_checksum,
                                uint64_t new_checksum, int threads, int version, const Context& ctx) {
  DTypeInfo dt = dtype_info(dtype_code);
  if (block_log2 < kMinBlockLog2 || block_log2 > kMaxBlockLog2) throw DeltaError("block_log2 out of range");
  if (version < kMinFormat || version > kMaxFormat) throw DeltaError("unknown delta format version " + std::to_string(version));
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
  if (version == 2 && (!ctx.nibbles || ctx.e_tops.size() != n_blocks || ctx.numel != numel))
    throw DeltaError("pack: format 2 needs the classes of every element and an e_top per block");
  parallel_for(n_blocks, threads, [&](size_t b) {
    uint64_t lo = uint64_t(b) << block_log2, hi = lo + (uint64_t(1) << block_log2);
    size_t i0 = std::lower_bound(pos, pos + n, lo) - pos, i1 = std::lower_bound(pos, pos + n, hi) - pos;
    auto feed = [&](auto& enc) {
      constexpr size_t kBatch = 1024;
      uint32_t rel[kBatch];
      for (size_t i = i0; i < i1; i += kBatch) {
        size_t k = std::min(kBatch, i1 - i);
        for (size_t j = 0; j < k; ++j) rel[j] = static_cast<uint32_t>(pos[i + j] - lo);
        enc.add(rel, v + i, k);
      }
    };
    if (version == 2) {
      V2BlockEncoder& enc = thread_v2_encoder();
      enc.reset(std::min(hi, numel) - lo, dt);
      feed(enc);
      ClassSource cs;
      cs.nibbles = ctx.nibbles;
      cs.first = lo;
      code_block(enc, a, b, dt, cs, ctx.e_tops[b]);
      return;
    }
    BlockEncoder& enc = thread_block_encoder();
    enc.reset();
    feed(enc);
    code_block(enc, a, b);
  });
  return assemble(dt, shape, block_log2, a, base_checksum, new_checksum, version);
}

void delta_unpack_into(const Header& h, const uint8_t* blob, uint64_t* pos, uint64_t* v, int threads,
                       const BaseView& base) {
  size_t nb = h.blocks.size();
  std::vector<size_t> first(nb + 1, 0);
  for (size_t b = 0; b < nb; ++b) first[b + 1] = first[b] + h.blocks[b].n_changed;
  parallel_for(nb, threads, [&](size_t b) {
    const BlockEntry& e = h.blocks[b];
    if (!e.n_changed) return;
    verify_payload(h, blob, b);
    uint64_t start = h.block_start(b);
    uint64_t* pb = pos + first[b];
    uint64_t* vb = v + first[b];
    size_t len;
    const uint8_t* payload = order0_payload(h, blob, b, &len);
    if (!payload) {
      V2BlockDecoder dec;
      dec.parse(blob + h.payload_offset[b], e.payload_bytes, e.n_changed, h.block_span(b), h.dtype, b);
      ClassSource cs;
      if (dec.context()) {
        if (base.bytes) {
          cs.old = base.bytes + start * (h.dtype.bits / 8);
          cs.first_word = start * (h.dtype.bits / 8) / 8;
        } else if (base.nibbles) {
          cs.nibbles = base.nibbles;
          cs.first = start;
        } else {
          throw DeltaError("block " + std::to_string(b) +
                           " is context-coded (format 2): decoding it needs the base tensor");
        }
      }
      // pooled buffers: fresh ones cost a page fault per 4 KiB on every block
      PooledChanges ch = take_changes(decoded_bytes(h.block_span(b), e.n_changed, h.dtype));
      dec.decode(cs, *ch);
      ch->list_at(start, pb, vb);  // pb, vb: exactly this block's n_changed entries (other threads write the next)
      return;
    }
    BlockDecoder dec(payload, len, e.n_changed, h.block_span(b), h.dtype.bits, b);
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

namespace syncd {

std::vector<int> delta_block_e_tops(const Header& h, const uint8_t* blob) {
  std::vector<int> out(h.blocks.size(), -1);
  if (h.version != 2) return out;
  for (size_t b = 0; b < h.blocks.size(); ++b) {
    const BlockEntry& e = h.blocks[b];
    const uint8_t* p = blob + h.payload_offset[b];
    if (e.payload_bytes >= 3 && p[0] >= kModeContext && p[0] <= kModeRowFlags) out[b] = int(p[1] | p[2] << 8);
  }
  return out;
}

}  // namespace syncd
