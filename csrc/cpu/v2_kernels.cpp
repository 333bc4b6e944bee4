#include "v2_kernels.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "checksum.h"
#include "simd_scan.h"
#include "codec_core.h"
#include "v2_rows.h"

namespace syncd {

namespace {

inline int class16(uint32_t w, const Classes16& c) {
  return std::min(15, std::max(0, c.e_top - int((w >> c.shift) & c.emask)));
}

// The class of element i of the block, from the nibbles when given, else from the old word.
inline int class_at(const Classes16& c, uint64_t i) {
  return c.nibbles ? c.nibbles[i >> 1] >> (4 * (i & 1)) & 0xF : class16(c.old[i], c);
}

// Word i of a 16-bit block of `span` elements, zero-padded past the end.
inline uint64_t word16(const uint16_t* p, uint64_t span, uint64_t i) {
  uint64_t w = 0;
  for (uint64_t l = 0; l < 4 && 4 * i + l < span; ++l) w |= uint64_t(p[4 * i + l]) << (16 * l);
  return w;
}

Simd detect() {
  Simd cpu = Simd::kScalar;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt"))
    cpu = Simd::kAvx2;
  if (cpu == Simd::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vbmi2"))
    cpu = Simd::kAvx512;
#endif
  const char* cap = std::getenv("SYNCD_SIMD");
  if (cap && !std::strcmp(cap, "scalar")) return Simd::kScalar;
  if (cap && !std::strcmp(cap, "avx2")) return std::min(cpu, Simd::kAvx2);
  return cpu;
}

}  // namespace

Simd simd_level() {
  static const Simd s = detect();
  return s;
}

const char* simd_name(Simd s) { return s == Simd::kAvx512 ? "avx512" : s == Simd::kAvx2 ? "avx2" : "scalar"; }

namespace scalar16 {

// the sample runs from element `from` (a multiple of 32) on
int sample_max_exponent(const Classes16& c, uint64_t from) {
  int best = -1;
  for (uint64_t s = 0; s < c.span; s += 1 << 14)
    for (uint64_t i = std::max(s, from), e = std::min(c.span, s + 1024); i < e; ++i) {
      const int x = int((c.old[i] >> c.shift) & c.emask);
      if (x != int(c.emask)) best = std::max(best, x);
    }
  return best;
}

void sample_class_counts(const Classes16& c, uint64_t counts[16], uint64_t from) {
  for (uint64_t s = 0; s < c.span; s += 1 << 14)
    for (uint64_t i = std::max(s, from), e = std::min(c.span, s + 1024); i < e; ++i) counts[class16(c.old[i], c)]++;
}

uint64_t checksum(const uint16_t* p, uint64_t span, uint64_t first_word, uint64_t from) {
  const uint64_t w0 = from / 4, whole = span / 4;  // whole words by the vectorised checksum, then a partial one
  uint64_t sum = 0;
  if (whole > w0) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(p + 4 * w0);
    sum = whole - w0 >= 64 ? checksum_words_fast(b, whole - w0, first_word + w0) : checksum_words(b, whole - w0, first_word + w0);
  }
  for (uint64_t i = std::max(w0, whole); 4 * i < span; ++i) sum += checksum_term(word16(p, span, i), first_word + i);
  return sum;
}

size_t decode_positions(const Classes16& c, BinGroupDecoder* dec, int gp, uint16_t* bitmap, uint8_t* cls_ch,
                        size_t n_max, const std::string& what) {
  const uint64_t vectors = (c.span + kLanes - 1) / kLanes;
  size_t k = 0;
  for (uint64_t t = 0; t < vectors; ++t) {
    const uint64_t lo = t * kLanes;
    const int live = int(std::min<uint64_t>(kLanes, c.span - lo));
    uint32_t pl[kLanes] = {}, coded = 0;
    uint8_t cls[kLanes] = {};
    for (int l = 0; l < live; ++l) {
      cls[l] = uint8_t(class_at(c, lo + l));
      pl[l] = c.p1[cls[l]];
      coded |= uint32_t(pl[l] != 0) << l;
    }
    uint32_t bits = coded ? dec[t % gp].row(coded, pl) : 0;
    bitmap[t] = uint16_t(bits);
    if (size_t(__builtin_popcount(bits)) > n_max - k) throw DeltaError(what + ": more changes than the block table says");
    for (; bits; bits &= bits - 1) cls_ch[k++] = cls[__builtin_ctz(bits)];
  }
  return k;
}

void encode_positions(const Classes16& c, const uint16_t* bitmap, BinGroupEncoder* enc, int gp) {
  const uint64_t vectors = (c.span + kLanes - 1) / kLanes;
  for (uint64_t t = vectors; t-- > 0;) {
    const uint64_t lo = t * kLanes;
    const int live = int(std::min<uint64_t>(kLanes, c.span - lo));
    uint32_t pl[kLanes] = {}, coded = 0;
    for (int l = 0; l < live; ++l) {
      pl[l] = c.p1[class_at(c, lo + l)];
      coded |= uint32_t(pl[l] != 0) << l;
    }
    if (coded) enc[t % gp].put_row(coded, pl, bitmap[t] & coded);
  }
}

uint64_t scan(const Classes16& c, const uint16_t* nw, uint64_t first_word, bool is_float, uint16_t* bitmap,
              uint16_t* v16, uint8_t* cls_ch, uint64_t* sum_old, uint64_t* adj, uint64_t from, uint64_t k) {
  uint64_t so = 0, ad = 0;
  for (uint64_t t = from / kLanes; t * kLanes < c.span; ++t) bitmap[t] = 0;
  for (uint64_t i = from / 4; 4 * i < c.span; ++i) {
    const uint64_t a = word16(c.old, c.span, i), b = word16(nw, c.span, i);
    so += checksum_term(a, first_word + i);
    if (a == b) continue;
    ad += checksum_term(b, first_word + i) - checksum_term(a, first_word + i);
    for (unsigned l = 0; l < 4; ++l) {
      const uint16_t oa = uint16_t(a >> (16 * l)), nb = uint16_t(b >> (16 * l));
      if (oa == nb) continue;
      const uint64_t e = 4 * i + l;
      bitmap[e / kLanes] |= uint16_t(1u << (e % kLanes));
      v16[k] = uint16_t(core::code_value<uint16_t>(oa, nb, is_float));
      cls_ch[k++] = uint8_t(class16(oa, c));
    }
  }
  *sum_old += so;
  *adj += ad;
  return k;
}

int row_classes(const Classes16& c, uint64_t t, uint8_t* cls) {
  const uint64_t lo = t * kLanes;
  const int live = int(std::min<uint64_t>(kLanes, c.span - lo));
  for (int l = 0; l < kLanes; ++l) cls[l] = l < live ? uint8_t(class_at(c, lo + l)) : 0;
  return live;
}

uint64_t apply(uint16_t* target, uint64_t span, uint64_t first_word, const uint16_t* bitmap, const uint16_t* v16,
               bool is_float, bool forward, uint64_t from, uint64_t k) {
  uint64_t ad = 0;
  for (uint64_t i = from / 4; 4 * i < span; ++i) {
    const uint32_t bits = uint32_t(bitmap[i / 4] >> (4 * (i % 4))) & 0xF;
    if (!bits) continue;
    const uint64_t a = word16(target, span, i);
    for (unsigned l = 0; l < 4; ++l) {
      if (!(bits >> l & 1)) continue;
      uint16_t& x = target[4 * i + l];
      x = forward ? core::apply_value<uint16_t>(x, v16[k++], is_float) : core::unapply_value<uint16_t>(x, v16[k++], is_float);
    }
    ad += checksum_term(word16(target, span, i), first_word + i) - checksum_term(a, first_word + i);
  }
  return ad;
}

}  // namespace scalar16

// ---- values, scalar (any value width)

void check_value_groups(int gv, size_t nj, const std::string& what) {
  if ((gv == 0) != (nj == 0))
    throw DeltaError(what + ": " + std::to_string(gv) + " value groups for " + std::to_string(nj) +
                     " changes with a value tree");
}

namespace {

inline uint32_t bit_length(uint64_t m) { return m ? 64 - uint32_t(__builtin_clzll(m)) : 0; }

// LSB-first bit writer appending to a byte vector.
struct BitSink {
  std::vector<uint8_t>& out;
  uint64_t acc = 0;
  uint32_t fill = 0;
  void put(uint64_t v, uint32_t n) {  // n <= 62
    if (n > 32) {
      put(v & 0xFFFFFFFFull, 32);
      v >>= 32;
      n -= 32;
    }
    acc |= v << fill;
    fill += n;
    for (; fill >= 8; fill -= 8, acc >>= 8) out.push_back(uint8_t(acc));
  }
  void flush() {
    if (fill) out.push_back(uint8_t(acc));
  }
};

template <class V>
void scalar_value_stats(const uint8_t* cls, const V* v, size_t n, uint64_t changed[16], uint64_t hist[16][65]) {
  for (size_t i = 0; i < n; ++i) {
    changed[cls[i]]++;
    hist[cls[i]][bit_length(uint64_t(v[i]) >> 1)]++;
  }
}

// The changes of J (indices into the block's changes) in J's order.
std::vector<uint32_t> j_order(const uint8_t* cls, size_t n, const ValueTrees& lv) {
  const JBuckets jb(lv);
  std::vector<uint32_t> jidx;
  for (int k = 1; k <= jb.count; ++k)
    for (size_t i = 0; i < n; ++i)
      if (jb.of_class[cls[i]] == k) jidx.push_back(uint32_t(i));
  return jidx;
}

template <class V>
void scalar_encode_values(const uint8_t* cls, const V* v, size_t n, const ValueTrees& lv, BinGroupEncoder* venc,
                          int gv, std::vector<uint8_t>& mant, uint8_t* signs) {
  const std::vector<uint32_t> jidx = j_order(cls, n, lv);
  const size_t nj = jidx.size();
  if (gv) {
    const size_t step = size_t(kLanes) * gv;
    for (size_t s0 = (nj + step - 1) / step * step; s0 > 0;) {  // steps back to front, rows bottom up
      s0 -= step;
      for (int g = gv - 1; g >= 0; --g) {
        const size_t lo = s0 + size_t(g) * kLanes;
        if (lo >= nj) continue;
        const size_t hi = std::min(nj, lo + kLanes);
        int top = 0;
        for (size_t t = lo; t < hi; ++t) top = std::max(top, lv.depth[cls[jidx[t]]]);
        for (int r = top - 1; r >= 0; --r) {
          uint32_t coded = 0, bits = 0, pl[kLanes] = {};
          for (size_t t = lo; t < hi; ++t) {
            const size_t i = jidx[t];
            const int c = cls[i], l = int(t - lo), d = lv.depth[c];
            if (d <= r) continue;
            const uint32_t nb = bit_length(uint64_t(v[i]) >> 1), u = ((1u << d) | nb) >> (d - r);
            coded |= 1u << l;
            bits |= (nb >> (d - 1 - r) & 1) << l;
            pl[l] = lv.node[c][u];
          }
          if (coded) venc[g].put_row(coded, pl, bits);
        }
      }
    }
  }
  BitSink ms{mant};
  for (size_t i : jidx) {
    const uint64_t m = uint64_t(v[i]) >> 1;
    const uint32_t nb = bit_length(m);
    if (nb >= 2) ms.put(m - (uint64_t(1) << (nb - 1)), nb - 1);
  }
  ms.flush();
  std::memset(signs, 0, (n + 7) / 8);
  for (size_t i = 0; i < n; ++i) signs[i >> 3] |= uint8_t((v[i] & 1) << (i & 7));
}

template <class V>
void scalar_decode_values(const uint8_t* cls, size_t n, const uint8_t* signs, const ValueTrees& lv,
                          BinGroupDecoder* vdec, int gv, const uint8_t* mant_p, size_t mant_len, uint64_t vmax, V* v,
                          const std::string& what) {
  for (size_t i = 0; i < n; ++i) v[i] = V(signs[i >> 3] >> (i & 7) & 1);  // the low bits; J entries get 2m on top
  const std::vector<uint32_t> jidx = j_order(cls, n, lv);
  check_value_groups(gv, jidx.size(), what);
  ByteReader owner(mant_p, mant_len, what);
  BitReader mant(mant_p, mant_len, owner);
  const size_t nj = jidx.size(), step = size_t(kLanes) * std::max(gv, 1);
  for (size_t s0 = 0; s0 < nj; s0 += step)
    for (int g = 0; g < gv; ++g) {
      const size_t lo = s0 + size_t(g) * kLanes;
      if (lo >= nj) break;
      const size_t hi = std::min(nj, lo + kLanes);
      uint32_t u[kLanes], top = 0;
      for (int l = 0; l < kLanes; ++l) u[l] = 1;
      for (size_t t = lo; t < hi; ++t) top = std::max(top, uint32_t(lv.depth[cls[jidx[t]]]));
      for (uint32_t r = 0; r < top; ++r) {
        uint32_t coded = 0, pl[kLanes] = {};
        for (size_t t = lo; t < hi; ++t) {
          const int c = cls[jidx[t]], l = int(t - lo);
          if (uint32_t(lv.depth[c]) > r) {
            coded |= 1u << l;
            pl[l] = lv.node[c][u[l]];
          }
        }
        const uint32_t bits = vdec[g].row(coded, pl);
        for (int l = 0; l < kLanes; ++l)
          if (coded >> l & 1) u[l] = 2 * u[l] + (bits >> l & 1);
      }
      for (size_t t = lo; t < hi; ++t) {  // mantissa bits come in J order
        const uint32_t k = u[t - lo] - (1u << lv.depth[cls[jidx[t]]]);
        if (!k) continue;
        const uint64_t m = (uint64_t(1) << (k - 1)) | (k >= 2 ? mant.read(k - 1) : 0);
        const uint64_t x = (m << 1) | uint64_t(v[jidx[t]]);
        if (x > vmax) throw DeltaError(what + ": value change " + std::to_string(x) + " too wide for the dtype");
        v[jidx[t]] = V(x);
      }
    }
  mant.finish();
}

}  // namespace

// ---- dispatch (the SIMD versions live in v2_kernels_avx2.cpp / v2_kernels_avx512.cpp, built on x86 only: elsewhere
// the calls below are discarded, so they need no definitions)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
constexpr bool kX86 = true;
#else
constexpr bool kX86 = false;
#endif

namespace avx2_16 {
size_t decode_positions(const Classes16&, BinGroupDecoder*, int, uint16_t*, uint8_t*, size_t, const std::string&,
                        uint64_t, uint64_t*);
void encode_positions(const Classes16&, const uint16_t*, BinGroupEncoder*, int);
uint64_t scan(const Classes16&, const uint16_t*, uint64_t, bool, uint16_t*, uint16_t*, uint8_t*, uint64_t*, uint64_t*);
uint64_t apply(uint16_t*, uint64_t, uint64_t, const uint16_t*, const uint16_t*, bool, bool, const uint64_t*);
void value_stats(const uint8_t*, const uint16_t*, size_t, uint64_t[16], uint64_t[16][65]);
void encode_values(const uint8_t*, const uint16_t*, size_t, const ValueTrees&, BinGroupEncoder*, int,
                   std::vector<uint8_t>&, uint8_t*);
void decode_values(const uint8_t*, size_t, const uint8_t*, const ValueTrees&, BinGroupDecoder*, int, const uint8_t*,
                   size_t, uint16_t*, const std::string&);
void row_contexts(const Classes16&, uint8_t*);
void encode_rows(const Classes16&, const uint16_t*, const uint8_t*, const uint32_t*, BinGroupEncoder*, int);
size_t decode_rows(const Classes16&, const uint32_t*, BinGroupDecoder*, int, uint16_t*, uint8_t*, size_t,
                   const std::string&, uint64_t, uint64_t*, uint32_t*, size_t*);
}  // namespace avx2_16
namespace avx512_16 {
int sample_max_exponent(const Classes16&);
void sample_class_counts(const Classes16&, uint64_t[16]);
size_t decode_positions(const Classes16&, BinGroupDecoder*, int, uint16_t*, uint8_t*, size_t, const std::string&,
                        uint64_t, uint64_t*);
void encode_positions(const Classes16&, const uint16_t*, BinGroupEncoder*, int);
uint64_t scan(const Classes16&, const uint16_t*, uint64_t, bool, uint16_t*, uint16_t*, uint8_t*, uint64_t*, uint64_t*);
uint64_t scan_extras(const Classes16&, const uint16_t*, uint64_t, bool, uint16_t*, uint16_t*, uint8_t*, uint64_t*,
                     uint64_t*, ScanExtras*);
uint64_t apply(uint16_t*, uint64_t, uint64_t, const uint16_t*, const uint16_t*, bool, bool, const uint64_t*);
void value_stats(const uint8_t*, const uint16_t*, size_t, uint64_t[16], uint64_t[16][65]);
void encode_values(const uint8_t*, const uint16_t*, size_t, const ValueTrees&, BinGroupEncoder*, int,
                   std::vector<uint8_t>&, uint8_t*);
void decode_values(const uint8_t*, size_t, const uint8_t*, const ValueTrees&, BinGroupDecoder*, int, const uint8_t*,
                   size_t, uint16_t*, const std::string&);
void row_contexts(const Classes16&, uint8_t*);
void context_counts(const uint8_t*, const uint16_t*, uint64_t, uint64_t[16], uint64_t[16]);
void encode_rows(const Classes16&, const uint16_t*, const uint8_t*, const uint32_t*, const uint16_t*,
                 BinGroupEncoder*, int);
size_t decode_rows(const Classes16&, const uint32_t*, BinGroupDecoder*, int, uint16_t*, uint8_t*, size_t,
                   const std::string&, uint64_t, uint64_t*, FlaggedRows*);
uint64_t apply_rows(uint16_t*, uint64_t, const uint32_t*, const uint16_t*, uint64_t, const uint16_t*, const uint16_t*,
                    bool, bool);
}  // namespace avx512_16

uint32_t* flagged_rows_scratch(uint64_t rows) {
  thread_local PodBuffer<uint32_t> buf;
  return buf.scratch(size_t(rows) + 16);
}

void context_counts16(const uint8_t* ctx, const uint16_t* bitmap, uint64_t nrows, uint64_t rows[16], uint64_t hit[16],
                      Simd s) {
  if constexpr (kX86) if (s == Simd::kAvx512) return avx512_16::context_counts(ctx, bitmap, nrows, rows, hit);
  context_counts_scalar(ctx, bitmap, 0, nrows, rows, hit);
}

void row_contexts16(const Classes16& c, uint8_t* ctx, Simd s) {
  if constexpr (kX86) if (s == Simd::kAvx512) return avx512_16::row_contexts(c, ctx);
  if constexpr (kX86) if (s == Simd::kAvx2 && !c.nibbles) return avx2_16::row_contexts(c, ctx);
  row_contexts_scalar([&](uint64_t t, uint8_t* cls) { return scalar16::row_classes(c, t, cls); }, c.span, ctx);
}

void encode_rows16(const Classes16& c, const uint16_t* bitmap, const uint8_t* ctx, const uint32_t* pa,
                   const uint16_t* words, BinGroupEncoder* enc, int gp, Simd s) {
  if constexpr (kX86) if (s == Simd::kAvx512) return avx512_16::encode_rows(c, bitmap, ctx, pa, words, enc, gp);
  if constexpr (kX86) if (s == Simd::kAvx2 && !c.nibbles) return avx2_16::encode_rows(c, bitmap, ctx, pa, enc, gp);
  encode_rows_scalar([&](uint64_t t, uint8_t* cls) { return scalar16::row_classes(c, t, cls); }, c.span, c.p1, bitmap,
                     ctx, pa, enc, gp);
}

size_t decode_rows16(const Classes16& c, const uint32_t* pa, BinGroupDecoder* dec, int gp, uint16_t* bitmap,
                     uint8_t* cls_ch, size_t n_max, const std::string& what, uint64_t first_word, uint64_t* old_sum,
                     FlaggedRows* fr, Simd s) {
  if constexpr (kX86) if (s == Simd::kAvx512)
    return avx512_16::decode_rows(c, pa, dec, gp, bitmap, cls_ch, n_max, what, first_word, old_sum, fr);
  size_t found = 0;
  bool done = false;
  if constexpr (kX86) if (s == Simd::kAvx2 && !c.nibbles) {
    found = avx2_16::decode_rows(c, pa, dec, gp, bitmap, cls_ch, n_max, what, first_word, old_sum, fr->rows, &fr->n);
    done = true;
  }
  if (!done) {
    if (!c.nibbles) *old_sum = scalar16::checksum(c.old, c.span, first_word, 0);
    found = decode_rows_scalar([&](uint64_t t, uint8_t* cls) { return scalar16::row_classes(c, t, cls); }, c.span,
                               c.p1, pa, dec, gp, bitmap, cls_ch, n_max, what, fr->rows, &fr->n);
  }
  for (size_t r = 0; fr->words && r < fr->n; ++r) {  // the flagged rows' old words, for apply
    const uint64_t t = fr->rows[r];
    std::memset(fr->words + r * kLanes, 0, 2 * kLanes);
    std::memcpy(fr->words + r * kLanes, c.old + t * kLanes, 2 * size_t(std::min<uint64_t>(kLanes, c.span - t * kLanes)));
  }
  return found;
}

uint64_t apply_rows16(uint16_t* target, uint64_t first_word, const uint32_t* rows, const uint16_t* words, uint64_t n,
                      const uint16_t* bitmap, const uint16_t* v16, bool is_float, bool forward, Simd s) {
  if constexpr (kX86) if (s == Simd::kAvx512)
    return avx512_16::apply_rows(target, first_word, rows, words, n, bitmap, v16, is_float, forward);
  uint64_t ad = 0, k = 0;
  for (uint64_t r = 0; r < n; ++r) {
    const uint64_t t = rows[r];
    const uint16_t* old = words + r * kLanes;
    uint16_t nw[kLanes];
    std::memcpy(nw, old, sizeof nw);
    for (uint32_t bits = bitmap[t]; bits; bits &= bits - 1) {
      const int l = __builtin_ctz(bits);
      nw[l] = forward ? core::apply_value<uint16_t>(old[l], v16[k++], is_float) : old[l];
      target[t * kLanes + l] = nw[l];
    }
    for (int w = 0; w < 4 && forward; ++w) {
      uint64_t a, b;
      std::memcpy(&a, old + 4 * w, 8);
      std::memcpy(&b, nw + 4 * w, 8);
      ad += checksum_term(b, first_word + 4 * t + w) - checksum_term(a, first_word + 4 * t + w);
    }
  }
  return ad;
}

int sample_max_exponent16(const Classes16& c, Simd s) {
  if constexpr (kX86) if (s == Simd::kAvx512) return avx512_16::sample_max_exponent(c);
  return scalar16::sample_max_exponent(c, 0);
}

void sample_class_counts16(const Classes16& c, uint64_t counts[16], Simd s) {
  if constexpr (kX86) if (s == Simd::kAvx512) return avx512_16::sample_class_counts(c, counts);
  scalar16::sample_class_counts(c, counts, 0);
}

size_t decode_positions16(const Classes16& c, BinGroupDecoder* dec, int gp, uint16_t* bitmap, uint8_t* cls_ch,
                          size_t n_max, const std::string& what, uint64_t first_word, uint64_t* old_sum, Simd s) {
  if constexpr (kX86) if (s == Simd::kAvx512)
    return avx512_16::decode_positions(c, dec, gp, bitmap, cls_ch, n_max, what, first_word, old_sum);
  if constexpr (kX86) if (s == Simd::kAvx2 && !c.nibbles)
    return avx2_16::decode_positions(c, dec, gp, bitmap, cls_ch, n_max, what, first_word, old_sum);
  if (!c.nibbles) *old_sum = scalar16::checksum(c.old, c.span, first_word, 0);
  return scalar16::decode_positions(c, dec, gp, bitmap, cls_ch, n_max, what);
}

void encode_positions16(const Classes16& c, const uint16_t* bitmap, BinGroupEncoder* enc, int gp, Simd s) {
  if constexpr (kX86) if (s == Simd::kAvx512) return avx512_16::encode_positions(c, bitmap, enc, gp);
  if constexpr (kX86) if (s == Simd::kAvx2 && !c.nibbles) return avx2_16::encode_positions(c, bitmap, enc, gp);
  scalar16::encode_positions(c, bitmap, enc, gp);
}

uint64_t scan16(const Classes16& c, const uint16_t* nw, uint64_t first_word, bool is_float, uint16_t* bitmap,
                uint16_t* v16, uint8_t* cls_ch, uint64_t* sum_old, uint64_t* adj, ScanExtras* ex, Simd s) {
  if constexpr (kX86) {
    if (s == Simd::kAvx512 && ex) return avx512_16::scan_extras(c, nw, first_word, is_float, bitmap, v16, cls_ch, sum_old, adj, ex);
    if (s == Simd::kAvx512) return avx512_16::scan(c, nw, first_word, is_float, bitmap, v16, cls_ch, sum_old, adj);
    if (s == Simd::kAvx2) return avx2_16::scan(c, nw, first_word, is_float, bitmap, v16, cls_ch, sum_old, adj);
  }
  *sum_old = *adj = 0;
  return scalar16::scan(c, nw, first_word, is_float, bitmap, v16, cls_ch, sum_old, adj, 0, 0);
}

uint64_t apply16(uint16_t* target, uint64_t span, uint64_t first_word, const uint16_t* bitmap, const uint16_t* v16,
                 uint64_t n, bool is_float, bool forward, const uint64_t* old_sum, Simd s) {
  if constexpr (kX86) {
    if (s == Simd::kAvx512)
      return avx512_16::apply(target, span, first_word, bitmap, v16, is_float, forward, n * 8 > span ? old_sum : nullptr);
    if (s == Simd::kAvx2)
      return avx2_16::apply(target, span, first_word, bitmap, v16, is_float, forward, n * 16 > span ? old_sum : nullptr);
  }
  return scalar16::apply(target, span, first_word, bitmap, v16, is_float, forward, 0, 0);
}

template <class V>
void value_stats(const uint8_t* cls, const V* v, size_t n, uint64_t changed[16], uint64_t hist[16][65], Simd s) {
  if constexpr (sizeof(V) == 2)
    if constexpr (kX86) {
      if (s == Simd::kAvx512) return avx512_16::value_stats(cls, v, n, changed, hist);
      if (s == Simd::kAvx2) return avx2_16::value_stats(cls, v, n, changed, hist);
    }
  scalar_value_stats(cls, v, n, changed, hist);
}

template <class V>
void encode_values(const uint8_t* cls, const V* v, size_t n, const ValueTrees& lv, BinGroupEncoder* venc, int gv,
                   std::vector<uint8_t>& mant, uint8_t* signs, Simd s) {
  if constexpr (sizeof(V) == 2) {
    if constexpr (kX86) if (s == Simd::kAvx512) return avx512_16::encode_values(cls, v, n, lv, venc, gv, mant, signs);
    if constexpr (kX86) if (s == Simd::kAvx2) return avx2_16::encode_values(cls, v, n, lv, venc, gv, mant, signs);
  }
  scalar_encode_values(cls, v, n, lv, venc, gv, mant, signs);
}

template <class V>
void decode_values(const uint8_t* cls, size_t n, const uint8_t* signs, const ValueTrees& lv, BinGroupDecoder* vdec,
                   int gv, const uint8_t* mant, size_t mant_len, uint64_t vmax, V* v, const std::string& what, Simd s) {
  if constexpr (sizeof(V) == 2) {
    if constexpr (kX86) if (s == Simd::kAvx512 && vmax == 0xFFFE)
      return avx512_16::decode_values(cls, n, signs, lv, vdec, gv, mant, mant_len, v, what);
    if constexpr (kX86) if (s == Simd::kAvx2 && vmax == 0xFFFE)
      return avx2_16::decode_values(cls, n, signs, lv, vdec, gv, mant, mant_len, v, what);
  }
  scalar_decode_values(cls, n, signs, lv, vdec, gv, mant, mant_len, vmax, v, what);
}

template void value_stats<uint16_t>(const uint8_t*, const uint16_t*, size_t, uint64_t[16], uint64_t[16][65], Simd);
template void value_stats<uint64_t>(const uint8_t*, const uint64_t*, size_t, uint64_t[16], uint64_t[16][65], Simd);
template void encode_values<uint16_t>(const uint8_t*, const uint16_t*, size_t, const ValueTrees&, BinGroupEncoder*,
                                      int, std::vector<uint8_t>&, uint8_t*, Simd);
template void encode_values<uint64_t>(const uint8_t*, const uint64_t*, size_t, const ValueTrees&, BinGroupEncoder*,
                                      int, std::vector<uint8_t>&, uint8_t*, Simd);
template void decode_values<uint16_t>(const uint8_t*, size_t, const uint8_t*, const ValueTrees&, BinGroupDecoder*,
                                      int, const uint8_t*, size_t, uint64_t, uint16_t*, const std::string&, Simd);
template void decode_values<uint64_t>(const uint8_t*, size_t, const uint8_t*, const ValueTrees&, BinGroupDecoder*,
                                      int, const uint8_t*, size_t, uint64_t, uint64_t*, const std::string&, Simd);

}  // namespace syncd
