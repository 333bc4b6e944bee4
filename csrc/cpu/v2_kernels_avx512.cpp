// AVX-512 versions of the 16-bit format-2 position, scan and apply kernels (v2_kernels.h; the value kernels are
// in v2_values_avx512.cpp): 16 binary rANS lanes per zmm, one state vector per group kept in registers, masked
// expand loads / compress stores of the renormalisation words. Bit for bit the scalar kernels' results.
// Called only when simd_level() says the CPU has AVX-512.
#include "v2_kernels.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "block_coder.h"
#include "checksum.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "simd_mix.h"
#include "v2_avx512.h"
#include "v2_rows_avx512.h"

namespace syncd {
namespace avx512_16 {

namespace {
using namespace detail;

// The classes (as bytes) and probabilities (32-bit lanes, one vector per row) of the 32 elements of vectors
// t and t + 1, computed in 16-bit lanes.
struct Pair {
  __m512i p1_lo, p1_hi, words, cls16;
  __m256i cls;
};

struct Consts16 {
  __m512i p1, emask, etop, fifteen, zero;
  __m128i shift;
  SYNCD_512 explicit Consts16(const Classes16& c)
      : emask(_mm512_set1_epi16(int16_t(c.emask))),
        etop(_mm512_set1_epi16(int16_t(c.e_top))),
        fifteen(_mm512_set1_epi16(15)),
        zero(_mm512_setzero_si512()),
        shift(_mm_cvtsi32_si128(c.shift)) {
    alignas(64) uint16_t t[32] = {};
    for (int l = 0; l < kLanes && c.p1; ++l) t[l] = uint16_t(c.p1[l]);
    p1 = _mm512_load_si512(t);
  }
  SYNCD_512 __attribute__((always_inline)) inline Pair pair(const uint16_t* old) const {
    const __m512i w = _mm512_loadu_si512(old);
    const __m512i e = _mm512_and_si512(_mm512_srl_epi16(w, shift), emask);
    return from_classes(w, _mm512_min_epu16(_mm512_subs_epu16(etop, e), fifteen));  // e_top, e < 2^15
  }
  // the same from 16 bytes of nibbles (32 classes; no old words)
  SYNCD_512 __attribute__((always_inline)) inline Pair pair_nibbles(const uint8_t* nib) const {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nib)));
    const __m512i cls = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0xF)),
                                        _mm512_slli_epi32(_mm512_srli_epi32(b, 4), 16));
    return from_classes(zero, cls);
  }
  SYNCD_512 __attribute__((always_inline)) inline Pair from_classes(__m512i w, __m512i cls) const {
    const __m512i q = _mm512_permutexvar_epi16(cls, p1);
    return {_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)), _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)),
            w, cls, _mm512_cvtepi16_epi8(cls)};
  }
};

// The decoder's rows: state x, word cursor p, vector t. The main loop takes rows in pairs (vectors t, t + 1,
// one Pair of classes), stores their 32 bitmap bits and compresses the classes of their changes at once, and
// checks the stream ends once per unit of rows.
struct DecRow {
  const Classes16& c;
  const Consts& k;
  uint16_t* bitmap;
  uint8_t* cls_ch;
  size_t n_max, found;
  const std::string& what;

  // cls_ch has n_max + 64 bytes: every store starts at found <= n_max and writes at most 32
  SYNCD_512 __attribute__((always_inline)) inline void count(uint32_t bits) {
    found += unsigned(__builtin_popcount(bits));
    if (__builtin_expect(found > n_max, 0)) fail(what, ": more changes than the block table says");
  }
  template <bool checked>
  SYNCD_512 __attribute__((always_inline)) inline void pair(uint64_t t, const Pair& q, __m512i& x0, const uint8_t*& p0,
                                                             const uint8_t* e0, __m512i& x1, const uint8_t*& p1,
                                                             const uint8_t* e1) {
    const __mmask16 b0 = dec_step<checked, true>(x0, 0xFFFF, q.p1_lo, p0, e0, what);
    const __mmask16 b1 = dec_step<checked, true>(x1, 0xFFFF, q.p1_hi, p1, e1, what);
    const uint32_t bits = uint32_t(b0) | uint32_t(b1) << 16;
    std::memcpy(bitmap + t, &bits, 4);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cls_ch + found), _mm256_maskz_compress_epi8(bits, q.cls));
    count(bits);
  }
  // one row of a partial unit, on a state in memory: bounds-checked, any live lanes
  SYNCD_512 __attribute__((always_inline)) inline void step(uint64_t t, __mmask16 live, __m512i& x,
                                                             const uint8_t*& p, const uint8_t* end) {
    const __m512i cls = classes_at(c, k, t, live);
    const __m512i p1 = _mm512_permutexvar_epi32(cls, k.p1);
    const __mmask16 bit = dec_step<true>(x, _mm512_mask_test_epi32_mask(live, p1, p1), p1, p, end, what);
    bitmap[t] = uint16_t(bit);
    compress_bytes16(cls_ch + found, bit, _mm512_cvtepi32_epi8(cls));
    count(bit);
  }
};

// One unit of the main loop: 2 * GP rows, two per group. Unchecked, every group's stream must have 64 bytes left
// (each row reads 32 at most).
template <int GP, bool kNibbles, bool checked>
SYNCD_512 __attribute__((always_inline)) inline void decode_unit(DecRow& row, const Consts16& k16, const Classes16& c,
                                                                  uint64_t t, __m512i (&x)[GP],
                                                                  const uint8_t* (&p)[GP], const uint8_t* const (&e)[GP],
                                                                  __m512i& key, __m512i& acc, __m512i step8) {
#pragma GCC unroll 16
  for (int u = 0; u < 2 * GP; u += 2) {
    const Pair q = kNibbles ? k16.pair_nibbles(c.nibbles + (t + u) * 8) : k16.pair(c.old + (t + u) * kLanes);
    if (!kNibbles) {
      acc = _mm512_add_epi64(acc, mix512(_mm512_xor_si512(q.words, key)));
      key = _mm512_add_epi64(key, step8);
    }
    row.pair<checked>(t + u, q, x[u % GP], p[u % GP], e[u % GP], x[(u + 1) % GP], p[(u + 1) % GP], e[(u + 1) % GP]);
  }
}

template <int GP, bool kNibbles>
SYNCD_512 size_t decode_gp(const Classes16& c, BinGroupDecoder* dec, uint16_t* bitmap, uint8_t* cls_ch, size_t n_max,
                           const std::string& what, uint64_t first_word, uint64_t* old_sum) {
  const Consts k(c);
  const Consts16 k16(c);
  DecRow row{c, k, bitmap, cls_ch, n_max, 0, what};
  // the main loop indexes its state arrays by constants only, so that they stay in registers
  __m512i x[GP];
  const uint8_t* p[GP];
  const uint8_t* e[GP];
  for (int g = 0; g < GP; ++g) {
    x[g] = _mm512_loadu_si512(dec[g].x);
    p[g] = dec[g].p;
    e[g] = dec[g].end;
  }
  constexpr int kUnit = 2 * GP;  // a whole number of pairs and of group rounds
  const uint64_t vectors = (c.span + kLanes - 1) / kLanes, full = c.span / kLanes / kUnit * kUnit;
  const __m512i step8 = _mm512_set1_epi64(int64_t(8 * core::kGolden));
  __m512i key = word_keys512(first_word), acc = _mm512_setzero_si512();  // the old words' checksum terms
  uint64_t t = 0;
  for (; t < full; t += kUnit) {
    if (!kNibbles) prefetch_ahead(c.old + t * kLanes, kUnit * kLanes * 2);
    bool roomy = true;
    for (int g = 0; g < GP; ++g) roomy &= e[g] - p[g] >= 64;
    if (__builtin_expect(roomy, 1)) decode_unit<GP, kNibbles, false>(row, k16, c, t, x, p, e, key, acc, step8);
    else decode_unit<GP, kNibbles, true>(row, k16, c, t, x, p, e, key, acc, step8);
  }
  for (int g = 0; g < GP; ++g) {
    _mm512_storeu_si512(dec[g].x, x[g]);
    dec[g].p = p[g];
  }
  if (!kNibbles) *old_sum = reduce_add_u64(acc) + scalar16::checksum(c.old, c.span, first_word, t * kLanes);
  for (; t < vectors; ++t) {
    BinGroupDecoder& d = dec[t % GP];
    __m512i xt = _mm512_loadu_si512(d.x);
    row.step(t, live_lanes(c.span, t), xt, d.p, d.end);
    _mm512_storeu_si512(d.x, xt);
  }
  return row.found;
}

struct EncRow {
  const Classes16& c;
  const Consts& k;
  const uint16_t* bitmap;
  __m512 inv0, inv1;  // 1 / (2^16 - p1) and 1 / p1 per class

  SYNCD_512 __attribute__((always_inline)) inline void row(uint64_t t, __m512i cls, __m512i p1, __mmask16 live,
                                                            __m512i& x, uint8_t*& w) {
    const __mmask16 coded = _mm512_mask_test_epi32_mask(live, p1, p1);
    const __mmask16 bit = __mmask16(bitmap[t]) & coded;
    // classes 0..15 index inv0, 16..31 (a lane whose bit is 1) inv1
    const __m512 inv = _mm512_permutex2var_ps(inv0, _mm512_mask_or_epi32(cls, bit, cls, _mm512_set1_epi32(16)), inv1);
    enc_step(x, coded, bit, p1, inv, w);
  }
  SYNCD_512 __attribute__((always_inline)) inline void step(uint64_t t, __mmask16 live, __m512i& x, uint8_t*& w) {
    const __m512i cls = classes_at(c, k, t, live);
    row(t, cls, _mm512_permutexvar_epi32(cls, k.p1), live, x, w);
  }
};

template <int GP, bool kNibbles>
SYNCD_512 void encode_gp(const Classes16& c, const uint16_t* bitmap, BinGroupEncoder* enc) {
  const Consts k(c);
  const Consts16 k16(c);
  float i0[kLanes], i1[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    i0[l] = c.p1[l] ? 1.0f / float(kBinOne - c.p1[l]) : 0.0f;
    i1[l] = c.p1[l] ? 1.0f / float(c.p1[l]) : 0.0f;
  }
  EncRow row{c, k, bitmap, _mm512_loadu_ps(i0), _mm512_loadu_ps(i1)};
  constexpr int kUnit = 2 * GP;
  const uint64_t vectors = (c.span + kLanes - 1) / kLanes, full = c.span / kLanes / kUnit * kUnit;
  // rows go backwards: first the vectors past the last whole unit, one by one, on the states in memory
  for (uint64_t t = vectors; t > full; --t) {
    BinGroupEncoder& e = enc[(t - 1) % GP];
    __m512i xt = _mm512_loadu_si512(e.x);
    row.step(t - 1, live_lanes(c.span, t - 1), xt, e.w);
    _mm512_storeu_si512(e.x, xt);
  }
  // then whole units, their states in registers (indexed by constants only)
  __m512i x[GP];
  uint8_t* w[GP];
  for (int g = 0; g < GP; ++g) {
    x[g] = _mm512_loadu_si512(enc[g].x);
    w[g] = enc[g].w;
  }
  for (uint64_t t = full; t > 0; t -= kUnit) {
    if (!kNibbles) prefetch_behind(c.old + (t - kUnit) * kLanes, kUnit * kLanes * 2);
#pragma GCC unroll 16
    for (int u = kUnit - 2; u >= 0; u -= 2) {
      const uint64_t v = t - kUnit + u;
      const Pair q = kNibbles ? k16.pair_nibbles(c.nibbles + v * 8) : k16.pair(c.old + v * kLanes);
      row.row(v + 1, _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q.cls16, 1)), q.p1_hi, 0xFFFF, x[(u + 1) % GP],
              w[(u + 1) % GP]);
      row.row(v, _mm512_cvtepu16_epi32(_mm512_castsi512_si256(q.cls16)), q.p1_lo, 0xFFFF, x[u % GP], w[u % GP]);
    }
  }
  for (int g = 0; g < GP; ++g) {
    _mm512_storeu_si512(enc[g].x, x[g]);
    enc[g].w = w[g];
  }
}

struct Keys16 {
  __m512i sign, one, ones;
  SYNCD_512 Keys16() : sign(_mm512_set1_epi16(int16_t(0x8000))), one(_mm512_set1_epi16(1)), ones(_mm512_set1_epi16(-1)) {}
  // order-preserving key of float bits: negative flips every bit, positive sets the sign
  SYNCD_512 inline __m512i key(__m512i a) const { return _mm512_xor_si512(a, _mm512_or_si512(_mm512_srai_epi16(a, 15), sign)); }
  SYNCD_512 inline __m512i unkey(__m512i k) const {
    return _mm512_xor_si512(k, _mm512_or_si512(_mm512_andnot_si512(_mm512_srai_epi16(k, 15), ones), sign));
  }
  // the 32 elements a with the changes in `bits` applied (forward) or undone, their values from v in order
  SYNCD_512 __attribute__((always_inline)) inline __m512i changed(__m512i a, __mmask32 bits, const uint16_t* v,
                                                                 bool is_float, bool forward) const {
    const __m512i u = _mm512_add_epi16(expand_load32x16(bits, v), one);  // the key delta: (u >> 1) ^ -(u & 1)
    const __m512i d = _mm512_xor_si512(_mm512_srli_epi16(u, 1), _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_and_si512(u, one)));
    const __m512i ka = is_float ? key(a) : a;
    const __m512i kb = forward ? _mm512_add_epi16(ka, d) : _mm512_sub_epi16(ka, d);
    return _mm512_mask_mov_epi16(a, bits, is_float ? unkey(kb) : kb);
  }
};

}  // namespace

// The sample: the first 1024 elements of every 16384, 32 at a time (the scalar code takes a partial end).
SYNCD_512 int sample_max_exponent(const Classes16& c) {
  const __m512i emask = _mm512_set1_epi16(int16_t(c.emask));
  const __m128i shift = _mm_cvtsi32_si128(c.shift);
  __m512i best = _mm512_set1_epi16(-1);
  uint64_t done = 0;
  for (uint64_t s = 0; s < c.span; s += 1 << 14) {
    const uint64_t e = std::min(c.span, s + 1024) / 32 * 32;
    for (uint64_t i = s; i < e; i += 32) {
      const __m512i x = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(c.old + i), shift), emask);
      best = _mm512_mask_max_epi16(best, _mm512_cmpneq_epi16_mask(x, emask), best, x);
    }
    if (e < std::min(c.span, s + 1024)) {
      done = e;
      break;
    }
  }
  alignas(64) int16_t b[32];
  _mm512_store_si512(b, best);
  int m = -1;
  for (int l = 0; l < 32; ++l) m = std::max(m, int(b[l]));
  return done ? std::max(m, scalar16::sample_max_exponent(c, done)) : m;
}

SYNCD_512 void sample_class_counts(const Classes16& c, uint64_t counts[16]) {
  const Consts16 k16(c);
  uint64_t done = 0;
  for (uint64_t s = 0; s < c.span; s += 1 << 14) {
    const uint64_t e = std::min(c.span, s + 1024) / 32 * 32;
    for (uint64_t i = s; i < e; i += 32) {
      const __m512i w = _mm512_loadu_si512(c.old + i);
      const __m512i cls = _mm512_min_epi16(
          _mm512_max_epi16(_mm512_sub_epi16(k16.etop, _mm512_and_si512(_mm512_srl_epi16(w, k16.shift), k16.emask)), k16.zero),
          k16.fifteen);
      for (int q = 0; q < 16; ++q)
        counts[q] += unsigned(__builtin_popcount(_mm512_cmpeq_epi16_mask(cls, _mm512_set1_epi16(int16_t(q)))));
    }
    if (e < std::min(c.span, s + 1024)) {
      done = e;
      break;
    }
  }
  if (done) scalar16::sample_class_counts(c, counts, done);
}

// The kernels per group count (1..8) and class source, for a group count known at run time.
using DecodeGp = size_t (*)(const Classes16&, BinGroupDecoder*, uint16_t*, uint8_t*, size_t, const std::string&,
                            uint64_t, uint64_t*);
using EncodeGp = void (*)(const Classes16&, const uint16_t*, BinGroupEncoder*);
template <bool kNibbles>
constexpr DecodeGp kDecodeGp[8] = {decode_gp<1, kNibbles>, decode_gp<2, kNibbles>, decode_gp<3, kNibbles>,
                                   decode_gp<4, kNibbles>, decode_gp<5, kNibbles>, decode_gp<6, kNibbles>,
                                   decode_gp<7, kNibbles>, decode_gp<8, kNibbles>};
template <bool kNibbles>
constexpr EncodeGp kEncodeGp[8] = {encode_gp<1, kNibbles>, encode_gp<2, kNibbles>, encode_gp<3, kNibbles>,
                                   encode_gp<4, kNibbles>, encode_gp<5, kNibbles>, encode_gp<6, kNibbles>,
                                   encode_gp<7, kNibbles>, encode_gp<8, kNibbles>};

SYNCD_512 size_t decode_positions(const Classes16& c, BinGroupDecoder* dec, int gp, uint16_t* bitmap, uint8_t* cls_ch,
                                  size_t n_max, const std::string& what, uint64_t first_word, uint64_t* old_sum) {
  if (gp >= 1 && gp <= 8)
    return (c.nibbles ? kDecodeGp<true> : kDecodeGp<false>)[gp - 1](c, dec, bitmap, cls_ch, n_max, what, first_word,
                                                                     old_sum);
  if (!c.nibbles) *old_sum = scalar16::checksum(c.old, c.span, first_word, 0);
  return scalar16::decode_positions(c, dec, gp, bitmap, cls_ch, n_max, what);
}

SYNCD_512 void encode_positions(const Classes16& c, const uint16_t* bitmap, BinGroupEncoder* enc, int gp) {
  if (gp >= 1 && gp <= 8) return (c.nibbles ? kEncodeGp<true> : kEncodeGp<false>)[gp - 1](c, bitmap, enc);
  scalar16::encode_positions(c, bitmap, enc, gp);
}

SYNCD_512 uint64_t scan(const Classes16& c, const uint16_t* nw, uint64_t first_word, bool is_float, uint16_t* bitmap,
                        uint16_t* v16, uint8_t* cls_ch, uint64_t* sum_old, uint64_t* adj) {
  const Keys16 kk;
  const __m512i etop = _mm512_set1_epi16(int16_t(c.e_top)), emask = _mm512_set1_epi16(int16_t(c.emask));
  const __m512i zero = _mm512_setzero_si512(), fifteen = _mm512_set1_epi16(15);
  const __m128i shift = _mm_cvtsi32_si128(c.shift);
  const __m512i step8 = _mm512_set1_epi64(int64_t(8 * core::kGolden));
  __m512i key = word_keys512(first_word), acc_old = zero, acc_adj = zero;
  const uint64_t vecs = c.span / 32;
  uint64_t k = 0;
  for (uint64_t j = 0; j < vecs; ++j, key = _mm512_add_epi64(key, step8)) {
    prefetch_ahead(c.old + 32 * j, 64);
    prefetch_ahead(nw + 32 * j, 64);
    const __m512i a = _mm512_loadu_si512(c.old + 32 * j), b = _mm512_loadu_si512(nw + 32 * j);
    const __m512i ma = mix512(_mm512_xor_si512(a, key));
    acc_old = _mm512_add_epi64(acc_old, ma);
    const __mmask32 ne = _mm512_cmpneq_epi16_mask(a, b);
    std::memcpy(bitmap + 2 * j, &ne, 4);
    if (!ne) continue;
    acc_adj = _mm512_add_epi64(acc_adj, _mm512_sub_epi64(mix512(_mm512_xor_si512(b, key)), ma));
    const __m512i ka = is_float ? kk.key(a) : a, kb = is_float ? kk.key(b) : b;
    const __m512i d = _mm512_sub_epi16(kb, ka);
    const __m512i v = _mm512_sub_epi16(_mm512_xor_si512(_mm512_slli_epi16(d, 1), _mm512_srai_epi16(d, 15)), kk.one);
    compress_store32x16(v16 + k, ne, v);
    const __m512i e = _mm512_and_si512(_mm512_srl_epi16(a, shift), emask);
    const __m512i cls = _mm512_min_epu16(_mm512_subs_epu16(etop, e), fifteen);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cls_ch + k), _mm512_cvtepi16_epi8(_mm512_maskz_compress_epi16(ne, cls)));
    k += unsigned(__builtin_popcount(ne));
  }
  *sum_old = (reduce_add_u64(acc_old));
  *adj = (reduce_add_u64(acc_adj));
  return scalar16::scan(c, nw, first_word, is_float, bitmap, v16, cls_ch, sum_old, adj, vecs * 32, k);
}

// scan(), super-row by super-row (256 elements), with the extras: the sample's class counts (super-rows u with
// u % 64 < 4) and, while at most twice as many changes as a mode-3 block may have went by, the row contexts (a tree
// of minima) and copies of the old words of the rows with a change (past that the block will hardly be coded in
// mode 3, and these would cost a dense scan time for nothing).
SYNCD_512 uint64_t scan_extras(const Classes16& c, const uint16_t* nw, uint64_t first_word, bool is_float,
                               uint16_t* bitmap, uint16_t* v16, uint8_t* cls_ch, uint64_t* sum_old, uint64_t* adj,
                               ScanExtras* ex) {
  const Keys16 kk;
  const rows::ContextTree tree(c);
  const __m512i etop = _mm512_set1_epi16(int16_t(c.e_top)), emask = _mm512_set1_epi16(int16_t(c.emask));
  const __m512i zero = _mm512_setzero_si512(), fifteen = _mm512_set1_epi16(15);
  const __m128i shift = _mm_cvtsi32_si128(c.shift);
  const __m512i step8 = _mm512_set1_epi64(int64_t(8 * core::kGolden));
  __m512i key = word_keys512(first_word), acc_old = zero, acc_adj = zero;
  const uint64_t whole = c.span / rows::kSuper;
  uint64_t k = 0, nrows = 0;
  uint16_t* words = ex->words;
  bool rows = ex->ctx && words;
  for (uint64_t u = 0; u < whole; ++u) {
    __m512i leaf[8];
    const bool sampled = u % 64 < 4;  // elements i % 16384 < 1024
    __m512i cls8[4];                  // the sampled classes as bytes
    for (int i = 0; i < 8; ++i) {
      const uint64_t j = 8 * u + i;
      prefetch_ahead(c.old + 32 * j, 64);
      prefetch_ahead(nw + 32 * j, 64);
      const __m512i a = _mm512_loadu_si512(c.old + 32 * j), b = _mm512_loadu_si512(nw + 32 * j);
      const __m512i kj = key;
      const __m512i ma = mix512(_mm512_xor_si512(a, kj));
      key = _mm512_add_epi64(key, step8);
      acc_old = _mm512_add_epi64(acc_old, ma);
      if (rows) leaf[i] = tree.leaf(a);
      const __mmask32 ne = _mm512_cmpneq_epi16_mask(a, b);
      std::memcpy(bitmap + 2 * j, &ne, 4);
      if (sampled || ne) {
        const __m512i cls = _mm512_min_epu16(_mm512_subs_epu16(etop, _mm512_and_si512(_mm512_srl_epi16(a, shift), emask)),
                                             fifteen);
        if (sampled) {
          const __m256i cb = _mm512_cvtepi16_epi8(cls);
          cls8[i / 2] = i % 2 ? _mm512_inserti64x4(cls8[i / 2], cb, 1) : _mm512_castsi256_si512(cb);
        }
        if (ne) {
          const __m512i ka = is_float ? kk.key(a) : a, kb = is_float ? kk.key(b) : b;
          const __m512i d = _mm512_sub_epi16(kb, ka);
          const __m512i v = _mm512_sub_epi16(_mm512_xor_si512(_mm512_slli_epi16(d, 1), _mm512_srai_epi16(d, 15)), kk.one);
          acc_adj = _mm512_add_epi64(acc_adj, _mm512_sub_epi64(mix512(_mm512_xor_si512(b, kj)), ma));
          compress_store32x16(v16 + k, ne, v);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(cls_ch + k), _mm512_cvtepi16_epi8(_mm512_maskz_compress_epi16(ne, cls)));
          k += unsigned(__builtin_popcount(ne));
          if (rows) {  // the rows with a change: 4 qwords each (room for 2 rows past nrows)
            const __mmask8 rm = __mmask8((ne & 0xFFFF ? 0x0F : 0) | (ne >> 16 ? 0xF0 : 0));
            _mm512_storeu_si512(words + nrows * kLanes, _mm512_maskz_compress_epi64(rm, a));
            nrows += unsigned(__builtin_popcount(rm)) / 4;
          }
        }
      }
    }
    if (sampled)
      for (int h = 0; h < 4; ++h)
        for (int q = 0; q < 16; ++q)
          ex->counts[q] += uint64_t(__builtin_popcountll(_mm512_cmpeq_epi8_mask(cls8[h], _mm512_set1_epi8(char(q)))));
    if (rows) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ex->ctx + u * kLanes), _mm512_cvtepi32_epi8(tree.contexts(leaf)));
      rows = k * kRowFlagsDensity <= 2 * (u + 1) * rows::kSuper + 4 * rows::kSuper;
    }
  }
  *sum_old = reduce_add_u64(acc_old);
  *adj = reduce_add_u64(acc_adj);
  const uint64_t from = whole * rows::kSuper;
  k = scalar16::scan(c, nw, first_word, is_float, bitmap, v16, cls_ch, sum_old, adj, from, k);
  scalar16::sample_class_counts(c, ex->counts, from);
  ex->counts_done = true;
  if (!rows) return k;
  for (uint64_t t = from / kLanes; t * kLanes < c.span; ++t) {  // the last rows: contexts and copies one by one
    ex->ctx[t] = rows::context_of(c, t);
    if (!bitmap[t]) continue;
    std::memset(words + nrows * kLanes, 0, 2 * kLanes);
    std::memcpy(words + nrows * kLanes, c.old + t * kLanes, 2 * size_t(std::min<uint64_t>(kLanes, c.span - t * kLanes)));
    ++nrows;
  }
  ex->rows_done = true;
  return k;
}

namespace {

// Bit i: vector j0 + i (of 32 elements, below vecs) has a change.
SYNCD_512 __attribute__((always_inline)) inline uint32_t changed_vectors(const uint16_t* bitmap, uint64_t vecs, uint64_t j0) {
  const __mmask16 live = vecs - j0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (vecs - j0)) - 1);
  const __m512i b = _mm512_maskz_loadu_epi32(live, bitmap + 2 * j0);
  return _mm512_test_epi32_mask(b, b);
}

// The sparse apply: only the vectors of 32 elements with a change, found 16 bitmap words at a time (a loop over
// the set bits of a mask, not a branch per vector: whether a vector changed is not predictable at a few percent),
// each adding its new minus old checksum terms to *acc (the other vectors are never read; prefetching the lines of
// those that change, a few chunks ahead, measured no faster). Returns the changes applied.
template <bool kFloat, bool kForward>
SYNCD_512 uint64_t apply_sparse(uint16_t* target, uint64_t vecs, uint64_t first_word, const uint16_t* bitmap,
                                const uint16_t* v16, __m512i* acc_out) {
  const Keys16 kk;
  const __m512i key0 = word_keys512(first_word);
  __m512i acc = *acc_out;
  uint64_t k = 0;
  for (uint64_t j0 = 0; j0 < vecs; j0 += 16) {
    for (uint32_t m = changed_vectors(bitmap, vecs, j0); m; m &= m - 1) {
      const uint64_t j = j0 + unsigned(__builtin_ctz(m));
      uint32_t bits;
      std::memcpy(&bits, bitmap + 2 * j, 4);
      const __m512i key = _mm512_add_epi64(key0, _mm512_set1_epi64(int64_t(j * 8 * core::kGolden)));
      const __m512i a = _mm512_loadu_si512(target + 32 * j);
      const __m512i b = kk.changed(a, bits, v16 + k, kFloat, kForward);
      _mm512_mask_storeu_epi16(target + 32 * j, bits, b);
      acc = _mm512_add_epi64(acc, _mm512_sub_epi64(mix512(_mm512_xor_si512(b, key)), mix512(_mm512_xor_si512(a, key))));
      k += unsigned(__builtin_popcount(bits));
    }
  }
  *acc_out = acc;
  return k;
}

}  // namespace

SYNCD_512 uint64_t apply(uint16_t* target, uint64_t span, uint64_t first_word, const uint16_t* bitmap,
                         const uint16_t* v16, bool is_float, bool forward, const uint64_t* old_sum) {
  const Keys16 kk;
  const __m512i step8 = _mm512_set1_epi64(int64_t(8 * core::kGolden));
  __m512i key = word_keys512(first_word), acc = _mm512_setzero_si512();
  const uint64_t vecs = span / 32;
  uint64_t k = 0;
  if (old_sum) {  // every new word's term, unchanged ones included: one term per word
    for (uint64_t j = 0; j < vecs; ++j, key = _mm512_add_epi64(key, step8)) {
      uint32_t bits;
      std::memcpy(&bits, bitmap + 2 * j, 4);
      prefetch_ahead(target + 32 * j, 64);
      __m512i a = _mm512_loadu_si512(target + 32 * j);
      if (bits) {
        a = kk.changed(a, bits, v16 + k, is_float, forward);
        _mm512_mask_storeu_epi16(target + 32 * j, bits, a);
        k += unsigned(__builtin_popcount(bits));
      }
      acc = _mm512_add_epi64(acc, mix512(_mm512_xor_si512(a, key)));
    }
    scalar16::apply(target, span, first_word, bitmap, v16, is_float, forward, vecs * 32, k);  // the tail
    return (reduce_add_u64(acc)) + scalar16::checksum(target, span, first_word, vecs * 32) - *old_sum;
  }
  k = (is_float ? (forward ? apply_sparse<true, true> : apply_sparse<true, false>)
                : (forward ? apply_sparse<false, true> : apply_sparse<false, false>))(target, vecs, first_word, bitmap,
                                                                                    v16, &acc);
  return (reduce_add_u64(acc)) +
         scalar16::apply(target, span, first_word, bitmap, v16, is_float, forward, vecs * 32, k);
}

// Mode 3's apply from the flagged rows' old words, two rows a vector: the target is written, never read.
template <bool kFloat, bool kForward>
SYNCD_512 uint64_t apply_rows_t(uint16_t* target, uint64_t first_word, const uint32_t* rows, const uint16_t* words,
                                uint64_t n, const uint16_t* bitmap, const uint16_t* v16) {
  const Keys16 kk;
  const __m512i g4 = _mm512_set1_epi64(int64_t(4 * core::kGolden));
  // the keys of words 0..3 of row 0 (first_word + 1 + i) * golden, twice; a row t adds 4t * golden
  const __m512i base = _mm512_mullo_epi64(_mm512_add_epi64(_mm512_set1_epi64(int64_t(first_word + 1)),
                                                           _mm512_set_epi64(3, 2, 1, 0, 3, 2, 1, 0)),
                                          _mm512_set1_epi64(int64_t(core::kGolden)));
  __m512i acc = _mm512_setzero_si512();
  uint64_t k = 0;
  for (uint64_t r = 0; r < n; r += 2) {
    const uint64_t t0 = rows[r], t1 = r + 1 < n ? rows[r + 1] : t0;
    const uint32_t bits = uint32_t(bitmap[t0]) | (r + 1 < n ? uint32_t(bitmap[t1]) << 16 : 0u);
    const __m512i a = _mm512_loadu_si512(words + r * kLanes);  // the buffer has room for a row past the last
    const __m512i b = kForward ? kk.changed(a, bits, v16 + k, kFloat, true) : a;  // undo: the old words
    _mm256_mask_storeu_epi16(target + t0 * kLanes, __mmask16(bits), _mm512_castsi512_si256(b));
    _mm256_mask_storeu_epi16(target + t1 * kLanes, __mmask16(bits >> 16), _mm512_extracti64x4_epi64(b, 1));
    if (kForward) {
      const __m512i key = _mm512_add_epi64(
          base, _mm512_mullo_epi64(_mm512_mask_blend_epi64(0xF0, _mm512_set1_epi64(int64_t(t0)), _mm512_set1_epi64(int64_t(t1))), g4));
      acc = _mm512_add_epi64(acc, _mm512_sub_epi64(mix512(_mm512_xor_si512(b, key)), mix512(_mm512_xor_si512(a, key))));
    }
    k += unsigned(__builtin_popcount(bits));
  }
  return reduce_add_u64(acc);
}

SYNCD_512 uint64_t apply_rows(uint16_t* target, uint64_t first_word, const uint32_t* rows, const uint16_t* words,
                              uint64_t n, const uint16_t* bitmap, const uint16_t* v16, bool is_float, bool forward) {
  return (is_float ? (forward ? apply_rows_t<true, true> : apply_rows_t<true, false>)
                   : (forward ? apply_rows_t<false, true> : apply_rows_t<false, false>))(target, first_word, rows,
                                                                                        words, n, bitmap, v16);
}

// 64 rows at a time: per context, a compare of the context bytes, counted alone and with the rows that changed.
SYNCD_512 void context_counts(const uint8_t* ctx, const uint16_t* bitmap, uint64_t nrows, uint64_t rows[16],
                              uint64_t hit[16]) {
  uint64_t t = 0;
  for (; t + 64 <= nrows; t += 64) {
    const __m512i cx = _mm512_loadu_si512(ctx + t);
    const __m512i b0 = _mm512_loadu_si512(bitmap + t), b1 = _mm512_loadu_si512(bitmap + t + 32);
    const uint64_t changed = uint64_t(_mm512_test_epi16_mask(b0, b0)) | uint64_t(_mm512_test_epi16_mask(b1, b1)) << 32;
    for (int c = 0; c < 16; ++c) {
      const uint64_t m = _mm512_cmpeq_epi8_mask(cx, _mm512_set1_epi8(char(c)));
      rows[c] += uint64_t(__builtin_popcountll(m));
      hit[c] += uint64_t(__builtin_popcountll(m & changed));
    }
  }
  context_counts_scalar(ctx, bitmap, t, nrows, rows, hit);
}

SYNCD_512 void row_contexts(const Classes16& c, uint8_t* ctx) {
  (c.nibbles ? rows::contexts<true> : rows::contexts<false>)(c, ctx);
}

SYNCD_512 void encode_rows(const Classes16& c, const uint16_t* bitmap, const uint8_t* ctx, const uint32_t* pa,
                           const uint16_t* words, BinGroupEncoder* enc, int gp) {
  (c.nibbles ? rows::kEncode<true> : rows::kEncode<false>)[gp - 1](c, bitmap, ctx, pa, words, enc);
}

SYNCD_512 size_t decode_rows(const Classes16& c, const uint32_t* pa, BinGroupDecoder* dec, int gp, uint16_t* bitmap,
                             uint8_t* cls_ch, size_t n_max, const std::string& what, uint64_t first_word,
                             uint64_t* old_sum, FlaggedRows* fr) {
  return (c.nibbles ? rows::kDecode<true> : rows::kDecode<false>)[gp - 1](c, pa, dec, bitmap, cls_ch, n_max, what,
                                                                          first_word, old_sum, fr);
}

}  // namespace avx512_16
}  // namespace syncd

#endif
