#include "block_v2.h"

#include <algorithm>
#include <cstring>

#include "checksum.h"
#include "codec_core.h"
#include "multiversion.h"
#include "word_dispatch.h"

namespace syncd {

namespace {

inline uint64_t element_at(const uint8_t* p, int bytes, uint64_t i) {
  switch (bytes) {
    case 1: return p[i];
    case 2: return load_le16(p + 2 * i);
    case 4: return load_le32(p + 4 * i);
    default: return load_le64(p + 8 * i);
  }
}

inline int class_of(uint64_t bits, const DTypeInfo& dt, int e_top) {
  if (!dt.exp_bits) return 0;
  const int e = int((bits >> dt.exp_shift) & ((uint64_t(1) << dt.exp_bits) - 1));
  return std::min(kClasses - 1, std::max(0, e_top - e));
}

// The classes of elements [lo, lo + n) of a block (block-relative), into out[0..n).
void block_classes(const ClassSource& cs, const DTypeInfo& dt, int e_top, uint64_t lo, size_t n, uint8_t* out) {
  if (!dt.exp_bits) {
    std::memset(out, 0, n);
  } else if (cs.old) {
    by_word_bytes(dt.bits / 8, [&](auto tag) {
      using T = decltype(tag);
      const int bytes = int(sizeof(T));
      for (size_t i = 0; i < n; ++i) out[i] = uint8_t(class_of(element_at(cs.old, bytes, lo + i), dt, e_top));
    });
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint64_t k = cs.first + lo + i;
      out[i] = uint8_t(cs.nibbles[k >> 1] >> (4 * (k & 1)) & 0xF);
    }
  }
}

// Row t's classes from the classes of every element of a block (0 past its end); returns its live lanes.
int row_classes_of(const uint8_t* all, uint64_t span, uint64_t t, uint8_t* cls) {
  const uint64_t lo = t * kLanes;
  const int live = int(std::min<uint64_t>(kLanes, span - lo));
  for (int l = 0; l < kLanes; ++l) cls[l] = l < live ? all[lo + l] : 0;
  return live;
}

// round(num / den), den > 0, clamped to 1..65535 (the reference's integer rule)
uint32_t rounded_probability(unsigned __int128 num, unsigned __int128 den) {
  unsigned __int128 q = (2 * num + den) / (2 * den);
  return uint32_t(std::min<unsigned __int128>(kBinOne - 1, std::max<unsigned __int128>(1, q)));
}

inline void put_u16(std::vector<uint8_t>& o, uint32_t v) {
  o.push_back(uint8_t(v));
  o.push_back(uint8_t(v >> 8));
}

int groups_for(uint64_t count) {
  return int(std::min<uint64_t>(kEncoderMaxGroups, std::max<uint64_t>(1, count / kChangesPerGroup)));
}

// The 16-bit kernels take their classes from the old words or from nibbles (blocks start at an even element).
bool fast16(const ClassSource& cs, const DTypeInfo& dt) { return (cs.old || cs.nibbles) && dt.bits == 16; }

Classes16 classes16(const ClassSource& cs, const DTypeInfo& dt, uint64_t span, int e_top, const uint32_t* p1) {
  Classes16 c{reinterpret_cast<const uint16_t*>(cs.old), span, dt.exp_shift,
              dt.exp_bits ? (1u << dt.exp_bits) - 1 : 0u, dt.exp_bits ? e_top : 0, p1};
  if (!cs.old && cs.nibbles) c.nibbles = cs.nibbles + cs.first / 2;
  return c;
}

// Row t's probabilities (0 past the block's end and for classes that are not coded); returns its coded lanes.
uint32_t row_probabilities(const uint8_t* cls, uint64_t span, const uint32_t* p1, uint64_t t, uint32_t* pl) {
  const uint64_t lo = t * kLanes;
  const int live = int(std::min<uint64_t>(kLanes, span - lo));
  uint32_t coded = 0;
  for (int l = 0; l < kLanes; ++l) {
    pl[l] = l < live ? p1[cls[lo + l]] : 0;
    coded |= uint32_t(pl[l] != 0) << l;
  }
  return coded;
}

// The position rows of any dtype, from the classes of every element (cls: span + 16 bytes).
void encode_rows_generic(const uint8_t* cls, uint64_t span, const uint32_t* p1, const uint16_t* bitmap,
                         BinGroupEncoder* enc, int gp) {
  for (uint64_t t = (span + kLanes - 1) / kLanes; t-- > 0;) {
    uint32_t pl[kLanes];
    const uint32_t coded = row_probabilities(cls, span, p1, t, pl);
    if (coded) enc[t % gp].put_row(coded, pl, bitmap[t] & coded);
  }
}

size_t decode_rows_generic(const uint8_t* cls, uint64_t span, const uint32_t* p1, BinGroupDecoder* dec, int gp,
                           uint16_t* bitmap, uint8_t* cls_ch, size_t n_max, const std::string& what) {
  size_t k = 0;
  for (uint64_t t = 0; t * kLanes < span; ++t) {
    const uint64_t lo = t * kLanes;
    uint32_t pl[kLanes];
    const uint32_t coded = row_probabilities(cls, span, p1, t, pl);
    uint32_t bits = coded ? dec[t % gp].row(coded, pl) : 0;
    bitmap[t] = uint16_t(bits);
    if (size_t(__builtin_popcount(bits)) > n_max - k) throw DeltaError(what + ": more changes than the block table says");
    for (; bits; bits &= bits - 1) cls_ch[k++] = cls[lo + __builtin_ctz(bits)];
  }
  return k;
}

template <class T>
uint64_t apply_generic(T* tgt, const BlockChanges& ch, bool is_float, uint64_t first_word, bool forward) {
  constexpr uint64_t E = 8 / sizeof(T);
  const uint64_t nwords = (ch.span + E - 1) / E;
  const uint16_t* bm = ch.bitmap.data();
  uint64_t ad = 0, k = 0;
  auto word = [&](uint64_t w) {
    uint64_t x = 0;
    for (uint64_t l = 0; l < E && w * E + l < ch.span; ++l) x |= uint64_t(tgt[w * E + l]) << (8 * sizeof(T) * l % 64);
    return x;
  };
  for (uint64_t w = 0; w < nwords; ++w) {
    uint32_t bits = 0;
    for (uint64_t l = 0; l < E; ++l) {
      const uint64_t e = w * E + l;
      bits |= uint32_t(bm[e / kLanes] >> (e % kLanes) & 1) << l;
    }
    if (!bits) continue;
    const uint64_t before = word(w);
    for (uint64_t l = 0; l < E; ++l) {
      if (!(bits >> l & 1)) continue;
      T& x = tgt[w * E + l];
      const uint64_t v = ch.value(k++);
      x = forward ? core::apply_value<T>(x, v, is_float) : core::unapply_value<T>(x, v, is_float);
    }
    ad += checksum_term(word(w), first_word + w) - checksum_term(before, first_word + w);
  }
  return ad;
}

}  // namespace

int choose_e_top(const uint8_t* old, uint64_t span, const DTypeInfo& dt) {
  if (!dt.exp_bits) return 0;
  const int bytes = dt.bits / 8;
  const uint64_t ones = (uint64_t(1) << dt.exp_bits) - 1;
  int best = -1;
  for (uint64_t s = 0; s < span; s += kSamplePeriod) {
    for (uint64_t i = s, e = std::min(span, s + kSampleRun); i < e; ++i) {
      const uint64_t x = (element_at(old, bytes, i) >> dt.exp_shift) & ones;
      if (x != ones && int(x) > best) best = int(x);
    }
  }
  return best < 0 ? 0 : best;
}

void BlockChanges::reset(uint64_t span_, bool wide_, uint64_t n_max) {
  span = span_;
  wide = wide_;
  n = 0;
  has_old_sum = false;
  has_rows = false;
  rows_listed = false;
  nrows = 0;
  const size_t words = size_t(span / kLanes + 2);
  bitmap.reserve(words);
  std::memset(bitmap.data(), 0, words * sizeof(uint16_t));
  cls.reserve(size_t(n_max) + 64);
  if (wide) v64.reserve(size_t(n_max) + 64);
  else v16.reserve(size_t(n_max) + 64);
}

namespace {

// Writes base + the index of each set bit of x (cnt of them), lowest first, at out. With `eight` (8 entries are
// writable) and at most 8 bits, all 8 entries are written whatever x holds, the extra ones for the caller's next
// write to overwrite: a branch per set bit would mispredict on most words at a few percent changed.
template <class P>
inline void put_bits(P* out, P base, uint64_t x, unsigned cnt, bool eight) {
  if (__builtin_expect(eight && cnt <= 8, 1)) {
    for (int j = 0; j < 8; ++j) {  // the top bit keeps ctz defined once x runs out
      out[j] = base + P(__builtin_ctzll(x | 0x8000000000000000ull));
      x &= x - 1;
    }
  } else {
    for (; x; x &= x - 1) *out++ = base + P(__builtin_ctzll(x));
  }
}

}  // namespace

void BlockChanges::values(uint64_t* v) const {
  if (wide) {
    std::memcpy(v, v64.data(), size_t(n) * sizeof(uint64_t));
  } else {
    const uint16_t* v16p = v16.data();
    for (uint64_t i = 0; i < n; ++i) v[i] = v16p[i];
  }
}

SYNCD_CLONES
void BlockChanges::list(uint32_t* pos, uint64_t* v) const {
  // 64 elements a step (4 rows)
  const uint16_t* bm = bitmap.data();
  const uint64_t words = (span + kLanes - 1) / kLanes;
  uint64_t k = 0, t = 0;
  for (; t + 4 <= words; t += 4) {
    uint64_t w;
    std::memcpy(&w, bm + t, 8);
    const unsigned cnt = unsigned(__builtin_popcountll(w));
    put_bits<uint32_t>(pos + k, uint32_t(t * kLanes), w, cnt, true);
    k += cnt;
  }
  for (; t < words; ++t) {
    put_bits<uint32_t>(pos + k, uint32_t(t * kLanes), bm[t], unsigned(__builtin_popcount(bm[t])), false);
    k += unsigned(__builtin_popcount(bm[t]));
  }
  values(v);
}

void BlockChanges::list_at(uint64_t start, uint64_t* pos, uint64_t* v) const {
  if (!rows_listed) {
    thread_local PodBuffer<uint32_t> rel;
    uint32_t* r = rel.scratch(size_t(n) + 8);
    list(r, v);
    for (uint64_t i = 0; i < n; ++i) pos[i] = start + r[i];
    return;
  }
  // only the flagged rows (about a sixth of a block's rows at 1% changed), never writing past pos[n - 1]
  const uint16_t* bm = bitmap.data();
  const uint32_t* fr = rows.data();
  uint64_t k = 0;
  for (uint64_t r = 0; r < nrows; ++r) {
    const uint32_t bits = bm[fr[r]];
    const unsigned cnt = unsigned(__builtin_popcount(bits));
    put_bits<uint64_t>(pos + k, start + uint64_t(fr[r]) * kLanes, bits, cnt, k + 8 <= n);
    k += cnt;
  }
  values(v);
}

// ---------------------------------------------------------------------------------------------- encoder

V2BlockEncoder& thread_v2_encoder() {
  thread_local V2BlockEncoder e;
  return e;
}

void V2BlockEncoder::scan16(const uint16_t* old, const uint16_t* nw, uint64_t span, uint64_t first_word,
                            const DTypeInfo& dt, uint64_t* sum_old, uint64_t* adj) {
  span_ = span;
  ClassSource cs;
  cs.old = reinterpret_cast<const uint8_t*>(old);
  e_top_ = dt.exp_bits ? std::max(0, sample_max_exponent16(classes16(cs, dt, span, 0, nullptr), simd_level())) : 0;
  ch_.reset(span, false, span);
  const Classes16 c = classes16(cs, dt, span, e_top_, nullptr);
  const uint64_t rows = (span + kLanes - 1) / kLanes;
  ex_ = ScanExtras{};
  if (dt.exp_bits) {  // a float block may end in mode 3: its row contexts and changed rows, while they pass by
    ctx_.reserve(size_t(rows) + 64);
    row_words_.reserve(size_t(rows + 2) * kLanes);
    ex_.ctx = ctx_.data();
    ex_.words = row_words_.data();
  }
  n_ = ch_.n = syncd::scan16(c, nw, first_word, dt.is_float, ch_.bitmap.data(), ch_.v16.data(), ch_.cls.data(),
                             sum_old, adj, dt.exp_bits ? &ex_ : nullptr, simd_level());
  scanned_ = true;
}

void V2BlockEncoder::reset(uint64_t span, const DTypeInfo&) {
  span_ = span;
  n_ = 0;
  scanned_ = false;
  ex_ = ScanExtras{};
}

void V2BlockEncoder::add(const uint32_t* pos, const uint64_t* v, size_t n) {
  if (!n) return;
  pos_.reserve(n_ + n, n_);
  v_.reserve(n_ + n, n_);
  std::memcpy(pos_.data() + n_, pos, n * sizeof(uint32_t));
  std::memcpy(v_.data() + n_, v, n * sizeof(uint64_t));
  n_ += n;
}

void V2BlockEncoder::finish(std::vector<uint8_t>& out, const DTypeInfo& dt, const ClassSource& cs, int e_top) {
  if (!use_context(n_, span_, dt)) {
    out.push_back(kModeOrder0);
    if (scanned_) {
      pos_.reserve(n_ + 8);
      v_.reserve(n_);
      ch_.list(pos_.data(), v_.data());
    }
    BlockEncoder& e = thread_block_encoder();
    e.reset();
    e.add(pos_.data(), v_.data(), size_t(n_));
    e.finish(out);
    return;
  }
  if (!scanned_) {
    e_top_ = cs.old ? choose_e_top(cs.old, span_, dt) : e_top;
    ch_.reset(span_, dt.bits != 16, n_);
    ch_.n = n_;
    for (uint64_t i = 0; i < n_; ++i) {
      const uint32_t p = pos_.data()[i];
      ch_.bitmap.data()[p / kLanes] |= uint16_t(1u << (p % kLanes));
      block_classes(cs, dt, e_top_, p, 1, ch_.cls.data() + i);
      if (ch_.wide) ch_.v64.data()[i] = v_.data()[i];
      else ch_.v16.data()[i] = uint16_t(v_.data()[i]);
    }
  }
  finish_context(out, dt, cs);
}

void V2BlockEncoder::finish_context(std::vector<uint8_t>& out, const DTypeInfo& dt, const ClassSource& cs) {
  const size_t n = size_t(n_);
  const uint64_t span = span_;
  const uint8_t* cch = ch_.cls.data();
  // the sample's class counts, the changes' classes and bit lengths
  uint64_t sampled[kClasses] = {}, sample_size = 0;
  if (ex_.counts_done) {
    std::memcpy(sampled, ex_.counts, sizeof sampled);
  } else if (fast16(cs, dt) && cs.old) {
    sample_class_counts16(classes16(cs, dt, span, e_top_, nullptr), sampled, simd_level());
  } else {
    uint8_t run[kSampleRun];
    for (uint64_t s = 0; s < span; s += kSamplePeriod) {
      const size_t m = size_t(std::min(span, s + kSampleRun) - s);
      block_classes(cs, dt, e_top_, s, m, run);
      for (size_t i = 0; i < m; ++i) sampled[run[i]]++;
    }
  }
  for (uint64_t x : sampled) sample_size += x;
  uint64_t changed[kClasses] = {};
  uint64_t hist[kClasses][65] = {};
  const Simd simd = simd_level();
  if (ch_.wide) value_stats(cch, ch_.v64.data(), n, changed, hist, simd);
  else value_stats(cch, ch_.v16.data(), n, changed, hist, simd);
  uint32_t p1[kClasses] = {};
  for (int c = 0; c < kClasses; ++c)
    if (changed[c])
      p1[c] = rounded_probability((unsigned __int128)changed[c] * kBinOne * sample_size,
                                  (unsigned __int128)std::max<uint64_t>(sampled[c], 1) * span);
  // each class's value tree: the binary digits of its largest bit length, node probabilities from the counts
  ValueTrees lv{};
  lv.by_depth = true;  // mode 2
  uint64_t nj = 0, decisions = 0;  // the changes with a value tree, and their decisions
  for (int c = 0; c < kClasses; ++c) {
    int top = 0;
    for (int k = 64; k > 0 && !top; --k)
      if (hist[c][k]) top = k;
    const int d = lv.depth[c] = top ? 32 - __builtin_clz(uint32_t(top)) : 0;
    if (!d) continue;
    uint64_t reached[128] = {}, ones[128] = {};
    for (int nb = 0; nb <= top; ++nb) {
      if (!hist[c][nb]) continue;
      for (int r = 0, u = 1; r < d; ++r) {
        const int bit = nb >> (d - 1 - r) & 1;
        reached[u] += hist[c][nb];
        ones[u] += bit ? hist[c][nb] : 0;
        u = 2 * u + bit;
      }
    }
    for (int u = 1; u < (1 << d); ++u)
      lv.node[c][u] = reached[u] ? rounded_probability((unsigned __int128)ones[u] << 16, reached[u]) : 1u << 15;
    nj += changed[c];
    decisions += changed[c] * uint64_t(d);
  }
  const int gp = position_groups(span);
  const int gv = nj ? groups_for(nj) : 0;
  const uint8_t mode = context_mode(n, span);

  // position groups, backwards (at most a word per coded lane of a row: mode 3 adds a flag row per 16 rows)
  const uint64_t vectors = (span + kLanes - 1) / kLanes, supers = (vectors + kLanes - 1) / kLanes;
  const size_t pos_region = size_t(mode == kModeRowFlags ? 2 * 17 * kLanes * (supers / gp + 1) : 2 * (vectors / gp + 1) * kLanes) +
                            4 * kLanes + 32;
  const size_t val_region = gv ? size_t(2 * decisions + 4 * kLanes + 32) : 0;
  words_.reserve(gp * pos_region + gv * val_region);
  uint8_t* wbase = words_.data();
  BinGroupEncoder enc[kMaxGroups];
  for (int g = 0; g < gp; ++g) enc[g] = BinGroupEncoder(wbase + (g + 1) * pos_region);
  const bool fast = fast16(cs, dt);
  if (!fast) {
    all_cls_.reserve(size_t(span) + kLanes);
    block_classes(cs, dt, e_top_, 0, size_t(span), all_cls_.data());
    std::memset(all_cls_.data() + span, 0, kLanes);
  }
  const uint8_t* all_cls = all_cls_.data();
  auto generic_row = [&](uint64_t t, uint8_t* cls) { return row_classes_of(all_cls, span, t, cls); };
  uint32_t pa[kClasses] = {};
  if (mode == kModeRowFlags) {  // the row contexts and their flag probabilities, then the streams
    uint8_t* ctx = ex_.rows_done ? ex_.ctx : nullptr;  // the scan's
    if (!ctx) {
      ctx_.reserve(size_t(vectors) + 64);
      ctx = ctx_.data();
      if (fast) row_contexts16(classes16(cs, dt, span, e_top_, p1), ctx, simd);
      else row_contexts_scalar(generic_row, span, ctx);
    }
    uint64_t rows[kClasses] = {}, hit[kClasses] = {};
    const uint16_t* bm = ch_.bitmap.data();
    context_counts16(ctx, bm, vectors, rows, hit, simd);
    flag_probabilities(rows, hit, pa);
    if (fast) encode_rows16(classes16(cs, dt, span, e_top_, p1), bm, ctx, pa, ex_.rows_done ? ex_.words : nullptr, enc, gp, simd);
    else encode_rows_scalar(generic_row, span, p1, bm, ctx, pa, enc, gp);
  } else if (fast) {
    encode_positions16(classes16(cs, dt, span, e_top_, p1), ch_.bitmap.data(), enc, gp, simd);
  } else {
    encode_rows_generic(all_cls, span, p1, ch_.bitmap.data(), enc, gp);
  }
  const uint8_t* pstart[kMaxGroups];
  for (int g = 0; g < gp; ++g) pstart[g] = enc[g].finish();

  // value groups, mantissa and sign bits
  uint8_t* vbase = wbase + gp * pos_region;
  BinGroupEncoder venc[kMaxGroups];
  for (int g = 0; g < gv; ++g) venc[g] = BinGroupEncoder(vbase + (g + 1) * val_region);
  std::vector<uint8_t>& mant = mant_;  // keeps its capacity across blocks: warm pages
  mant.clear();
  signs_.reserve(n / 8 + 8);
  if (ch_.wide) encode_values(cch, ch_.v64.data(), n, lv, venc, gv, mant, signs_.data(), simd);
  else encode_values(cch, ch_.v16.data(), n, lv, venc, gv, mant, signs_.data(), simd);
  const uint8_t* vstart[kMaxGroups];
  for (int g = 0; g < gv; ++g) vstart[g] = venc[g].finish();

  // parameters, stream lengths, streams, mantissa bits, sign bits (room for all of it at once: growing `out`
  // by doubling copied the streams and faulted in fresh pages more than once)
  size_t streams = mant.size() + (n + 7) / 8;
  for (int g = 0; g < gp; ++g) streams += size_t(wbase + (g + 1) * pos_region - pstart[g]);
  for (int g = 0; g < gv; ++g) streams += size_t(vbase + (g + 1) * val_region - vstart[g]);
  out.reserve(out.size() + 4096 + streams);  // parameters: under 2.2 KiB with 16 trees of 6 levels, and varints
  out.push_back(mode);
  put_u16(out, uint32_t(e_top_));
  out.push_back(uint8_t(gp));
  out.push_back(uint8_t(gv));
  uint32_t mask_p = 0, mask_v = 0;
  for (int c = 0; c < kClasses; ++c) {
    mask_p |= uint32_t(p1[c] != 0) << c;
    mask_v |= uint32_t(lv.depth[c] != 0) << c;
  }
  put_u16(out, mask_p);
  for (int c = 0; c < kClasses; ++c)
    if (p1[c]) put_u16(out, p1[c]);
  if (mode == kModeRowFlags) {
    uint32_t mask_r = 0;
    for (int c = 0; c < kClasses; ++c) mask_r |= uint32_t(pa[c] != 0) << c;
    put_u16(out, mask_r);
    for (int c = 0; c < kClasses; ++c)
      if (pa[c]) put_u16(out, pa[c]);
  }
  put_u16(out, mask_v);
  for (int c = 0; c < kClasses; ++c)
    if (lv.depth[c]) {
      out.push_back(uint8_t(lv.depth[c]));
      for (int u = 1; u < (1 << lv.depth[c]); ++u) put_u16(out, lv.node[c][u]);
    }
  for (int g = 0; g < gp; ++g) write_varint(out, uint64_t(wbase + (g + 1) * pos_region - pstart[g]));
  for (int g = 0; g < gv; ++g) write_varint(out, uint64_t(vbase + (g + 1) * val_region - vstart[g]));
  write_varint(out, mant.size());
  for (int g = 0; g < gp; ++g) out.insert(out.end(), pstart[g], static_cast<const uint8_t*>(wbase + (g + 1) * pos_region));
  for (int g = 0; g < gv; ++g) out.insert(out.end(), vstart[g], static_cast<const uint8_t*>(vbase + (g + 1) * val_region));
  out.insert(out.end(), mant.begin(), mant.end());
  out.insert(out.end(), signs_.data(), signs_.data() + (n + 7) / 8);
}

// ---------------------------------------------------------------------------------------------- decoder

void V2BlockDecoder::parse(const uint8_t* payload, size_t len, uint32_t n, uint64_t span, const DTypeInfo& dt,
                           size_t block) {
  what_ = "block " + std::to_string(block);
  payload_ = payload;
  len_ = len;
  n_ = n;
  span_ = span;
  dt_ = dt;
  block_ = block;
  ByteReader r(payload, len, what_);
  mode_ = r.u8();
  if (mode_ == kModeOrder0) return;
  if (mode_ != kModeContext && mode_ != kModeContextByDepth && mode_ != kModeRowFlags)
    r.fail("unknown block mode " + std::to_string(mode_));
  const uint8_t* f = r.take(4);
  e_top_ = load_le16(f);
  gp_ = f[2];
  gv_ = f[3];
  if (dt.exp_bits ? e_top_ >= (1 << dt.exp_bits) : e_top_ != 0)
    r.fail("class origin " + std::to_string(e_top_) + " outside the dtype's exponent range");
  if (gp_ < 1 || gp_ > kMaxGroups || gv_ > kMaxGroups)
    r.fail(std::to_string(gp_) + " position and " + std::to_string(gv_) + " value groups (1..8 and 0..8)");
  const uint32_t mask_p = load_le16(r.take(2));
  if (!dt.exp_bits && (mask_p & ~1u)) r.fail("classes other than 0 for a dtype without an exponent");
  for (int c = 0; c < kClasses; ++c) {
    p1_[c] = (mask_p >> c & 1) ? load_le16(r.take(2)) : 0;
    if ((mask_p >> c & 1) && !p1_[c]) r.fail("class " + std::to_string(c) + " listed with a zero change probability");
  }
  const uint32_t mask_r = mode_ == kModeRowFlags ? load_le16(r.take(2)) : 0;
  if (!dt.exp_bits && (mask_r & ~1u)) r.fail("row contexts other than 0 for a dtype without an exponent");
  for (int c = 0; c < kClasses; ++c) {
    pa_[c] = (mask_r >> c & 1) ? load_le16(r.take(2)) : 0;
    if ((mask_r >> c & 1) && !pa_[c]) r.fail("row context " + std::to_string(c) + " listed with a zero flag probability");
  }
  const uint32_t mask_v = load_le16(r.take(2));
  if (mask_v & ~mask_p) r.fail("a value tree for a class that never changes");
  trees_ = ValueTrees{};
  trees_.by_depth = mode_ != kModeContext;
  const int max_depth = 32 - __builtin_clz(uint32_t(dt.bits - 1));  // nb <= bits - 1
  for (int c = 0; c < kClasses; ++c) {
    if (!(mask_v >> c & 1)) continue;
    const int d = trees_.depth[c] = r.u8();
    if (d < 1 || d > max_depth)
      r.fail("class " + std::to_string(c) + " has a value tree of " + std::to_string(d) + " levels");
    const uint8_t* q = r.take(2 * ((size_t(1) << d) - 1));
    for (int u = 1; u < (1 << d); ++u) {
      trees_.node[c][u] = load_le16(q + 2 * (u - 1));
      if (!trees_.node[c][u]) r.fail("class " + std::to_string(c) + " has a zero node probability");
    }
  }
  uint64_t lens[2 * kMaxGroups + 1];
  for (int i = 0; i < gp_ + gv_ + 1; ++i) lens[i] = r.varint();
  for (int i = 0; i < gp_ + gv_; ++i) {
    stream_len_[i] = size_t(lens[i]);
    streams_[i] = r.take(size_t(lens[i]));
  }
  mant_len_ = size_t(lens[gp_ + gv_]);
  mant_ = r.take(mant_len_);
  signs_ = r.take((size_t(n) + 7) / 8);
  if (r.pos() != len) r.fail(std::to_string(len - r.pos()) + " bytes after the sign bits");
}

void V2BlockDecoder::decode(const ClassSource& cs, BlockChanges& out) {
  out.reset(span_, dt_.bits != 16, n_);
  if (mode_ == kModeOrder0) {
    BlockDecoder dec(payload_ + 1, len_ - 1, n_, span_, dt_.bits, block_);
    constexpr uint32_t kBatch = 256;
    uint32_t pos[kBatch];
    uint64_t v[kBatch];
    for (uint32_t i = 0; i < n_; i += kBatch) {
      const uint32_t k = std::min(kBatch, n_ - i);
      dec.next_batch(pos, v, k);
      for (uint32_t j = 0; j < k; ++j) {
        out.bitmap.data()[pos[j] / kLanes] |= uint16_t(1u << (pos[j] % kLanes));
        if (out.wide) out.v64.data()[i + j] = v[j];
        else out.v16.data()[i + j] = uint16_t(v[j]);
      }
    }
    dec.finish();
    out.n = n_;
    return;
  }
  BinGroupDecoder dec[kMaxGroups];
  for (int g = 0; g < gp_; ++g) dec[g].init(streams_[g], stream_len_[g], what_ + " position group " + std::to_string(g));
  size_t found;
  if (fast16(cs, dt_)) {
    const Classes16 c = classes16(cs, dt_, span_, e_top_, p1_);
    if (mode_ == kModeRowFlags) {  // the flagged rows' old words are kept for apply when they come from the target
      const size_t most = size_t(std::min<uint64_t>(n_, (span_ + kLanes - 1) / kLanes));
      out.rows.reserve(most + 32);
      if (cs.old) out.row_words.reserve((most + 18) * kLanes);
      FlaggedRows fr{out.rows.data(), cs.old ? out.row_words.data() : nullptr, 0};
      found = decode_rows16(c, pa_, dec, gp_, out.bitmap.data(), out.cls.data(), n_, what_, cs.first_word,
                            &out.old_sum, &fr, simd_level());
      out.nrows = fr.n;
      out.rows_listed = true;
      out.has_rows = cs.old != nullptr;
    } else {
      found = decode_positions16(c, dec, gp_, out.bitmap.data(), out.cls.data(), n_, what_, cs.first_word,
                                 &out.old_sum, simd_level());
    }
    out.has_old_sum = cs.old != nullptr;
  } else {
    std::vector<uint8_t> cls(size_t(span_) + kLanes, 0);
    block_classes(cs, dt_, e_top_, 0, size_t(span_), cls.data());
    const uint8_t* all = cls.data();
    if (mode_ == kModeRowFlags)
      found = decode_rows_scalar([&](uint64_t t, uint8_t* out_cls) { return row_classes_of(all, span_, t, out_cls); },
                                 span_, p1_, pa_, dec, gp_, out.bitmap.data(), out.cls.data(), n_, what_,
                                 flagged_rows_scratch((span_ + kLanes - 1) / kLanes), nullptr);
    else
      found = decode_rows_generic(all, span_, p1_, dec, gp_, out.bitmap.data(), out.cls.data(), n_, what_);
  }
  for (int g = 0; g < gp_; ++g) dec[g].finish();
  if (found != n_)
    throw DeltaError(what_ + ": " + std::to_string(found) + " changes decoded, the block table says " + std::to_string(n_));
  out.n = n_;
  decode_values(out);
}

void V2BlockDecoder::decode_values(BlockChanges& out) {
  if ((n_ & 7) && (signs_[n_ >> 3] >> (n_ & 7))) throw DeltaError(what_ + ": sign bits past the last change");
  BinGroupDecoder vdec[kMaxGroups];
  for (int g = 0; g < gv_; ++g)
    vdec[g].init(streams_[gp_ + g], stream_len_[gp_ + g], what_ + " value group " + std::to_string(g));
  const uint64_t vmax = core::max_value(dt_.bits);
  if (out.wide)
    syncd::decode_values(out.cls.data(), n_, signs_, trees_, vdec, gv_, mant_, mant_len_, vmax, out.v64.data(), what_,
                         simd_level());
  else
    syncd::decode_values(out.cls.data(), n_, signs_, trees_, vdec, gv_, mant_, mant_len_, vmax, out.v16.data(), what_,
                         simd_level());
  for (int g = 0; g < gv_; ++g) vdec[g].finish();
}

uint64_t apply_changes(uint8_t* target, const BlockChanges& ch, const DTypeInfo& dt, uint64_t first_word,
                       bool forward, bool with_old_sum) {
  if (dt.bits == 16 && ch.has_rows)
    return apply_rows16(reinterpret_cast<uint16_t*>(target), first_word, ch.rows.data(), ch.row_words.data(), ch.nrows,
                        ch.bitmap.data(), ch.v16.data(), dt.is_float, forward, simd_level());
  if (dt.bits == 16)
    return apply16(reinterpret_cast<uint16_t*>(target), ch.span, first_word, ch.bitmap.data(), ch.v16.data(), ch.n,
                   dt.is_float, forward, with_old_sum && ch.has_old_sum ? &ch.old_sum : nullptr, simd_level());
  return by_word_bytes(dt.bits / 8, [&](auto tag) -> uint64_t {
    using T = decltype(tag);
    return apply_generic<T>(reinterpret_cast<T*>(target), ch, dt.is_float, first_word, forward);
  });
}

}  // namespace syncd
