// AVX-512 versions of the 16-bit format-2 kernels (v2_kernels.h): 16 binary rANS lanes per zmm, one state
// vector per group kept in registers, masked expand loads / compress stores of the renormalisation words.
// Bit for bit the scalar kernels' results. Called only when simd_level() says the CPU has AVX-512.
#include "v2_kernels.h"

#include <algorithm>
#include <cstring>

#include "block_coder.h"
#include "checksum.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "simd_mix.h"

// GCC's AVX-512 headers fill unused lanes from _mm512_undefined_*(), which -Wuninitialized reports
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define SYNCD_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512vbmi2,bmi2,popcnt")))

namespace syncd {
namespace avx512_16 {

namespace {

struct Consts {
  __m512i p1, emask, etop, fifteen, zero, one16, lo16;
  __m128i shift;
  SYNCD_512 explicit Consts(const Classes16& c)
      : p1(c.p1 ? _mm512_loadu_si512(c.p1) : _mm512_setzero_si512()),
        emask(_mm512_set1_epi32(int(c.emask))),
        etop(_mm512_set1_epi32(c.e_top)),
        fifteen(_mm512_set1_epi32(15)),
        zero(_mm512_setzero_si512()),
        one16(_mm512_set1_epi32(1 << 16)),
        lo16(_mm512_set1_epi32(0xFFFF)),
        shift(_mm_cvtsi32_si128(c.shift)) {}
};

inline __mmask16 live_lanes(uint64_t span, uint64_t t) {
  const uint64_t left = span - t * kLanes;
  return left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// The classes of vector t's 16 elements (only the live lanes are read).
SYNCD_512 __attribute__((always_inline)) inline __m512i classes_at(const Classes16& c, const Consts& k, uint64_t t, __mmask16 live) {
  if (c.nibbles) {  // 8 bytes: the 16 classes of vector t (the live lanes' bytes only)
    const __mmask16 bytes = __mmask16((1u << ((__builtin_popcount(live) + 1) / 2)) - 1);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(bytes, c.nibbles + t * 8));
    const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(b, 4);
    // lane 2j takes the low nibble of byte j, lane 2j + 1 the high one
    const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_maskz_mov_epi32(live, _mm512_mask_blend_epi32(0xAAAA, _mm512_permutexvar_epi32(idx, lo),
                                                                _mm512_permutexvar_epi32(idx, hi)));
  }
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, c.old + t * kLanes));
  const __m512i e = _mm512_and_si512(_mm512_srl_epi32(w, k.shift), k.emask);
  return _mm512_min_epi32(_mm512_max_epi32(_mm512_sub_epi32(k.etop, e), k.zero), k.fifteen);
}

// Expand/compress with memory operands are microcoded and slow on AMD cores: these do the same with a masked
// plain load or store of the `cnt` consecutive elements and the register form.
SYNCD_512 inline __m256i expand_load16(__mmask16 m, const void* p) {
  const __mmask16 first = __mmask16((1u << __builtin_popcount(m)) - 1);
  return _mm256_maskz_expand_epi16(m, _mm256_maskz_loadu_epi16(first, p));
}
SYNCD_512 inline __m512i expand_load32x16(__mmask32 m, const void* p) {
  const unsigned cnt = unsigned(__builtin_popcount(m));
  const __mmask32 first = cnt >= 32 ? ~__mmask32(0) : __mmask32((1u << cnt) - 1);
  return _mm512_maskz_expand_epi16(m, _mm512_maskz_loadu_epi16(first, p));
}
SYNCD_512 inline void compress_store16(void* p, __mmask16 m, __m256i v) {
  _mm256_mask_storeu_epi16(p, __mmask16((1u << __builtin_popcount(m)) - 1), _mm256_maskz_compress_epi16(m, v));
}
SYNCD_512 inline void compress_store32x16(void* p, __mmask32 m, __m512i v) {
  const unsigned cnt = unsigned(__builtin_popcount(m));
  _mm512_mask_storeu_epi16(p, cnt >= 32 ? ~__mmask32(0) : __mmask32((1u << cnt) - 1), _mm512_maskz_compress_epi16(m, v));
}
// compressing bytes into a buffer with 64 bytes of slack: a full store, the caller advances by the count
SYNCD_512 inline void compress_bytes16(void* p, __mmask16 m, __m128i v) {
  _mm_storeu_si128(static_cast<__m128i*>(p), _mm_maskz_compress_epi8(m, v));
}
SYNCD_512 inline void compress_bytes64(void* p, __mmask64 m, __m512i v) {
  _mm512_storeu_si512(p, _mm512_maskz_compress_epi8(m, v));
}

[[noreturn]] __attribute__((noinline, cold)) void fail(const std::string& what, const char* msg) {
  throw DeltaError(what + msg);
}

// One binary rANS decoder step of the lanes in `coded`, probabilities p1; returns their bits. With `checked`
// false the caller guarantees 32 readable bytes at p (16 words are loaded before the renormalisation mask is
// known, so that the load is off the state's dependency chain).
template <bool checked>
SYNCD_512 __attribute__((always_inline)) inline __mmask16 dec_step(__m512i& x, __mmask16 coded, __m512i p1,
                                                                 const uint8_t*& p, const uint8_t* end,
                                                                 const std::string& what) {
  const __m512i lo16 = _mm512_set1_epi32(0xFFFF), one16 = _mm512_set1_epi32(1 << 16);
  const __m512i slot = _mm512_and_si512(x, lo16);
  const __mmask16 bit = _mm512_mask_cmplt_epu32_mask(coded, slot, p1);
  const __m512i f = _mm512_mask_blend_epi32(bit, _mm512_sub_epi32(one16, p1), p1);
  const __m512i sc = _mm512_mask_sub_epi32(slot, _knot_mask16(bit), slot, p1);  // slot - cum
  x = _mm512_mask_add_epi32(x, coded, _mm512_mullo_epi32(f, _mm512_srli_epi32(x, 16)), sc);
  const __mmask16 ren = _mm512_mask_cmplt_epu32_mask(coded, x, one16);
  __m512i w;
  if (!checked || __builtin_expect(end - p >= 32, 1)) {
    w = _mm512_maskz_expand_epi32(ren, _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  } else {  // the stream's last words: read only those this row takes
    if (size_t(end - p) < 2 * size_t(__builtin_popcount(ren))) fail(what, ": binary stream truncated");
    w = _mm512_cvtepu16_epi32(expand_load16(ren, p));
  }
  x = _mm512_mask_or_epi32(x, ren, _mm512_slli_epi32(x, 16), w);
  p += 2 * __builtin_popcount(ren);
  return bit;
}

// One encoder step (rows go backwards): lanes in `coded` encode `bit`; inv holds 1 / f per lane, f the
// probability of the lane's bit. Words go backwards at w.
SYNCD_512 __attribute__((always_inline)) inline void enc_step(__m512i& x, __mmask16 coded, __mmask16 bit, __m512i p1, __m512 inv, uint8_t*& w) {
  const __m512i one16 = _mm512_set1_epi32(1 << 16), one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512();
  const __m512i f = _mm512_mask_blend_epi32(bit, _mm512_sub_epi32(one16, p1), p1);
  const __m512i cc = _mm512_maskz_mov_epi32(_knot_mask16(bit), p1);
  const __mmask16 emit = _mm512_mask_cmpge_epu32_mask(coded, x, _mm512_slli_epi32(f, 16));
  w -= 2 * __builtin_popcount(emit);
  compress_store16(w, emit, _mm512_cvtepi32_epi16(x));
  const __m512i xs = _mm512_mask_srli_epi32(x, emit, x, 16);
  // q = xs / f from a float estimate, exact after one correction either way (|error| < 0.02)
  __m512i q = _mm512_cvttps_epu32(_mm512_mul_ps(_mm512_cvtepu32_ps(xs), inv));
  __m512i r = _mm512_sub_epi32(xs, _mm512_mullo_epi32(q, f));
  const __mmask16 neg = _mm512_cmplt_epi32_mask(r, zero);
  q = _mm512_mask_sub_epi32(q, neg, q, one);
  r = _mm512_mask_add_epi32(r, neg, r, f);
  const __mmask16 big = _mm512_cmpge_epi32_mask(r, f);
  q = _mm512_mask_add_epi32(q, big, q, one);
  r = _mm512_mask_sub_epi32(r, big, r, f);
  x = _mm512_mask_mov_epi32(x, coded, _mm512_add_epi32(_mm512_slli_epi32(q, 16), _mm512_add_epi32(r, cc)));
}

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
    return from_classes(w, _mm512_min_epi16(_mm512_max_epi16(_mm512_sub_epi16(etop, e), zero), fifteen));
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

// One decoder row: state x, word cursor p (bounds-checked), vector t.
struct DecRow {
  const Classes16& c;
  const Consts& k;
  uint16_t* bitmap;
  uint8_t* cls_ch;
  size_t n_max, found;
  const std::string& what;

  template <bool checked>
  SYNCD_512 __attribute__((always_inline)) inline void row(uint64_t t, __m512i p1, __m128i cls8, __mmask16 live,
                                                            __m512i& x, const uint8_t*& p, const uint8_t* end) {
    const __mmask16 coded = _mm512_mask_test_epi32_mask(live, p1, p1);
    const __mmask16 bit = dec_step<checked>(x, coded, p1, p, end, what);
    bitmap[t] = uint16_t(bit);
    compress_bytes16(cls_ch + found, bit, cls8);  // cls_ch has 64 bytes of slack
    found += unsigned(__builtin_popcount(bit));
    if (__builtin_expect(found > n_max, 0)) fail(what, ": more changes than the block table says");
  }
  SYNCD_512 __attribute__((always_inline)) inline void step(uint64_t t, __mmask16 live, __m512i& x,
                                                             const uint8_t*& p, const uint8_t* end) {
    const __m512i cls = classes_at(c, k, t, live);
    row<true>(t, _mm512_permutexvar_epi32(cls, k.p1), _mm512_cvtepi32_epi8(cls), live, x, p, end);
  }
};

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
#pragma GCC unroll 16
    for (int u = 0; u < kUnit; u += 2) {
      const Pair q = kNibbles ? k16.pair_nibbles(c.nibbles + (t + u) * 8) : k16.pair(c.old + (t + u) * kLanes);
      if (!kNibbles) {
        acc = _mm512_add_epi64(acc, mix512(_mm512_xor_si512(q.words, key)));
        key = _mm512_add_epi64(key, step8);
      }
      row.row<true>(t + u, q.p1_lo, _mm256_castsi256_si128(q.cls), 0xFFFF, x[u % GP], p[u % GP], e[u % GP]);
      row.row<true>(t + u + 1, q.p1_hi, _mm256_extracti128_si256(q.cls, 1), 0xFFFF, x[(u + 1) % GP],
                    p[(u + 1) % GP], e[(u + 1) % GP]);
    }
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
    const __m512 inv = _mm512_mask_blend_ps(bit, _mm512_permutexvar_ps(cls, inv0), _mm512_permutexvar_ps(cls, inv1));
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
    const __m512i cls = _mm512_min_epi16(_mm512_max_epi16(_mm512_sub_epi16(etop, e), zero), fifteen);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cls_ch + k), _mm512_cvtepi16_epi8(_mm512_maskz_compress_epi16(ne, cls)));
    k += unsigned(__builtin_popcount(ne));
  }
  *sum_old = (reduce_add_u64(acc_old));
  *adj = (reduce_add_u64(acc_adj));
  return scalar16::scan(c, nw, first_word, is_float, bitmap, v16, cls_ch, sum_old, adj, vecs * 32, k);
}

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
      __m512i a = _mm512_loadu_si512(target + 32 * j);
      if (bits) {
        const __m512i v = expand_load32x16(bits, v16 + k);
        const __m512i u = _mm512_add_epi16(v, kk.one);
        const __m512i d = _mm512_xor_si512(_mm512_srli_epi16(u, 1), _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_and_si512(u, kk.one)));
        const __m512i ka = is_float ? kk.key(a) : a;
        const __m512i kb = forward ? _mm512_add_epi16(ka, d) : _mm512_sub_epi16(ka, d);
        a = _mm512_mask_mov_epi16(a, bits, is_float ? kk.unkey(kb) : kb);
        _mm512_mask_storeu_epi16(target + 32 * j, bits, a);
        k += unsigned(__builtin_popcount(bits));
      }
      acc = _mm512_add_epi64(acc, mix512(_mm512_xor_si512(a, key)));
    }
    scalar16::apply(target, span, first_word, bitmap, v16, is_float, forward, vecs * 32, k);  // the tail
    return (reduce_add_u64(acc)) + scalar16::checksum(target, span, first_word, vecs * 32) - *old_sum;
  }
  for (uint64_t j = 0; j < vecs; ++j, key = _mm512_add_epi64(key, step8)) {
    uint32_t bits;
    std::memcpy(&bits, bitmap + 2 * j, 4);
    if (!bits) continue;
    const __m512i a = _mm512_loadu_si512(target + 32 * j);
    const __m512i v = expand_load32x16(bits, v16 + k);
    const __m512i u = _mm512_add_epi16(v, kk.one);  // the key delta: (u >> 1) ^ -(u & 1)
    const __m512i d = _mm512_xor_si512(_mm512_srli_epi16(u, 1), _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_and_si512(u, kk.one)));
    const __m512i ka = is_float ? kk.key(a) : a;
    const __m512i kb = forward ? _mm512_add_epi16(ka, d) : _mm512_sub_epi16(ka, d);
    const __m512i b = _mm512_mask_mov_epi16(a, bits, is_float ? kk.unkey(kb) : kb);
    _mm512_mask_storeu_epi16(target + 32 * j, bits, b);
    acc = _mm512_add_epi64(acc, _mm512_sub_epi64(mix512(_mm512_xor_si512(b, key)), mix512(_mm512_xor_si512(a, key))));
    k += unsigned(__builtin_popcount(bits));
  }
  return (reduce_add_u64(acc)) +
         scalar16::apply(target, span, first_word, bitmap, v16, is_float, forward, vecs * 32, k);
}

// ---- values

namespace {

thread_local PodBuffer<uint8_t> t_cls_j, t_nb_j;
thread_local PodBuffer<uint16_t> t_m_j;
thread_local PodBuffer<uint64_t> t_jbits;

template <class T>
T* grown(PodBuffer<T>& b, size_t n) {
  b.reserve(n);
  return b.data();
}

// Compresses the classes (and, when v is given, the bit lengths and m) of the changes of classes with value
// levels; sets one bit per change in jbits. Returns their number.
SYNCD_512 size_t select_j(const uint8_t* cls, const uint16_t* v, size_t n, const ValueTrees& lv, uint8_t* cls_j,
                          uint8_t* nb_j, uint16_t* m_j, uint64_t* jbits) {
  alignas(16) uint8_t dt[16];
  for (int c = 0; c < 16; ++c) dt[c] = uint8_t(lv.depth[c] ? 1 : 0);
  const __m512i dtab = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(dt)));
  size_t nj = 0;
  for (size_t i = 0; i < n; i += 64) {
    const __mmask64 live = n - i >= 64 ? ~__mmask64(0) : (__mmask64(1) << (n - i)) - 1;
    const __m512i cl = _mm512_maskz_loadu_epi8(live, cls + i);
    const __mmask64 jm = _mm512_mask_test_epi8_mask(live, _mm512_shuffle_epi8(dtab, cl), _mm512_shuffle_epi8(dtab, cl));
    jbits[i / 64] = jm;
    compress_bytes64(cls_j + nj, jm, cl);
    if (v) {
      for (int h = 0; h < 2; ++h) {
        const __mmask32 lh = __mmask32(live >> (32 * h)), jh = __mmask32(jm >> (32 * h));
        const __m512i m = _mm512_srli_epi16(_mm512_maskz_loadu_epi16(lh, v + i + 32 * h), 1);
        const size_t at = nj + size_t(__builtin_popcountll(jm & ((uint64_t(1) << (32 * h)) - 1)));
        compress_store32x16(m_j + at, jh, m);
        __m512i nb2[2];
        for (int q = 0; q < 2; ++q) {
          const __m512i w = _mm512_cvtepu16_epi32(q ? _mm512_extracti64x4_epi64(m, 1) : _mm512_castsi512_si256(m));
          nb2[q] = _mm512_sub_epi32(_mm512_set1_epi32(32), _mm512_lzcnt_epi32(w));
        }
        const __m256i nb = _mm256_set_m128i(_mm512_cvtepi32_epi8(nb2[1]), _mm512_cvtepi32_epi8(nb2[0]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(nb_j + at), _mm256_maskz_compress_epi8(jh, nb));
      }
    }
    nj += size_t(__builtin_popcountll(jm));
  }
  return nj;
}

}  // namespace

SYNCD_512 void value_stats(const uint8_t* cls, const uint16_t* v, size_t n, uint64_t changed[16], uint64_t hist[16][65]) {
  uint64_t nz[16] = {};
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i cl = _mm512_loadu_si512(cls + i);
    for (int c = 0; c < 16; ++c) changed[c] += uint64_t(__builtin_popcountll(_mm512_cmpeq_epi8_mask(cl, _mm512_set1_epi8(char(c)))));
    const __m512i m0 = _mm512_srli_epi16(_mm512_loadu_si512(v + i), 1);
    const __m512i m1 = _mm512_srli_epi16(_mm512_loadu_si512(v + i + 32), 1);
    uint64_t bits = uint64_t(_mm512_test_epi16_mask(m0, m0)) | uint64_t(_mm512_test_epi16_mask(m1, m1)) << 32;
    for (; bits; bits &= bits - 1) {
      const size_t j = i + size_t(__builtin_ctzll(bits));
      const uint32_t m = v[j] >> 1;
      hist[cls[j]][32 - __builtin_clz(m)]++;
      nz[cls[j]]++;
    }
  }
  for (int c = 0; c < 16; ++c) hist[c][0] += changed[c] - nz[c];
  for (; i < n; ++i) {
    changed[cls[i]]++;
    const uint32_t m = v[i] >> 1;
    hist[cls[i]][m ? 32 - __builtin_clz(m) : 0]++;
  }
}

// The node probabilities of rows 0..3 (the trees of 16-bit dtypes) as permute tables: row r holds, at index
// c * 2^r + j, node 2^r + j of class c; a row's lookup is 1, 1, 2 or 4 two-table permutes instead of a gather.
struct RowTables {
  __m512i t[15];  // row 0: t[0]; row 1: t[1..2]; row 2: t[3..6]; row 3: t[7..14]
  SYNCD_512 explicit RowTables(const ValueTrees& lv) {
    alignas(64) uint32_t flat[240];
    for (int r = 0, at = 0; r < 4; at += 16 << r, ++r)
      for (int c = 0; c < 16; ++c)
        for (int j = 0; j < (1 << r); ++j) flat[at + c * (1 << r) + j] = lv.node[c][(1 << r) + j];
    for (int i = 0; i < 15; ++i) t[i] = _mm512_load_si512(flat + 16 * i);
  }
  // probabilities of the lanes of row r (0..3): class c16, node u (2^r .. 2^(r+1) - 1)
  SYNCD_512 __attribute__((always_inline)) inline __m512i at(int r, __m512i c16, __m512i u) const {
    const __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(c16, r), _mm512_sub_epi32(u, _mm512_set1_epi32(1 << r)));
    switch (r) {
      case 0: return _mm512_permutexvar_epi32(c16, t[0]);
      case 1: return _mm512_permutex2var_epi32(t[1], idx, t[2]);
      case 2: {
        const __m512i a = _mm512_permutex2var_epi32(t[3], idx, t[4]), b = _mm512_permutex2var_epi32(t[5], idx, t[6]);
        return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), a, b);
      }
      default: {
        const __m512i a = _mm512_permutex2var_epi32(t[7], idx, t[8]), b = _mm512_permutex2var_epi32(t[9], idx, t[10]);
        const __m512i c = _mm512_permutex2var_epi32(t[11], idx, t[12]), d = _mm512_permutex2var_epi32(t[13], idx, t[14]);
        const __m512i ab = _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), a, b);
        const __m512i cd = _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), c, d);
        return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(64)), ab, cd);
      }
    }
  }
};

// One step of the value streams, backwards (rows bottom up), its GV groups interleaved.
template <int GV>
SYNCD_512 inline void encode_step(size_t s0, size_t nj, const uint8_t* cls_j, const uint8_t* nb_j,
                                  const RowTables& rt, __m512i dtab, BinGroupEncoder* venc) {
  const __m512 fone = _mm512_set1_ps(1.0f);
  const __m512i one16 = _mm512_set1_epi32(1 << 16), onev = _mm512_set1_epi32(1);
  __m512i c16[GV], nb[GV], depth[GV], path[GV], x[GV];
  __mmask16 live[GV];
  int top = 0;
  for (int g = 0; g < GV; ++g) {
    const size_t lo = s0 + size_t(g) * kLanes;
    live[g] = lo >= nj ? 0 : nj - lo >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (nj - lo)) - 1);
    const size_t at = lo < nj ? lo : 0;
    c16[g] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live[g], cls_j + at));
    nb[g] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live[g], nb_j + at));
    depth[g] = _mm512_maskz_permutexvar_epi32(live[g], c16[g], dtab);
    path[g] = _mm512_or_si512(_mm512_sllv_epi32(onev, depth[g]), nb[g]);  // the leaf: 2^depth + nb
    top = std::max(top, _mm512_reduce_max_epi32(depth[g]));
    x[g] = _mm512_loadu_si512(venc[g].x);
  }
  for (int r = top - 1; r >= 0; --r) {
    const __m512i rr = _mm512_set1_epi32(r);
    for (int g = 0; g < GV; ++g) {
      const __mmask16 active = _mm512_cmpgt_epi32_mask(depth[g], rr);
      if (!active) continue;
      const __m512i sh = _mm512_sub_epi32(depth[g], rr);  // node at row r: the leaf's top r + 1 bits
      const __m512i u = _mm512_srlv_epi32(path[g], sh);
      const __mmask16 bit = _mm512_mask_test_epi32_mask(active, _mm512_srlv_epi32(path[g], _mm512_sub_epi32(sh, onev)), onev);
      const __m512i p1 = rt.at(r, c16[g], u);
      const __m512i f = _mm512_mask_blend_epi32(bit, _mm512_sub_epi32(one16, p1), p1);
      const __m512 inv = _mm512_div_ps(fone, _mm512_cvtepu32_ps(_mm512_mask_mov_epi32(onev, active, f)));
      enc_step(x[g], active, bit, p1, inv, venc[g].w);
    }
  }
  for (int g = 0; g < GV; ++g) _mm512_storeu_si512(venc[g].x, x[g]);
}

SYNCD_512 void encode_values(const uint8_t* cls, const uint16_t* v, size_t n, const ValueTrees& lv,
                             BinGroupEncoder* venc, int gv, std::vector<uint8_t>& mant, uint8_t* signs) {
  uint8_t* cls_j = grown(t_cls_j, n + 64);
  uint8_t* nb_j = grown(t_nb_j, n + 64);
  uint16_t* m_j = grown(t_m_j, n + 64);
  uint64_t* jbits = grown(t_jbits, n / 64 + 2);
  const size_t nj = select_j(cls, v, n, lv, cls_j, nb_j, m_j, jbits);
  const __m512i dtab = _mm512_loadu_si512(lv.depth);
  const RowTables rt(lv);
  const size_t step = size_t(kLanes) * std::max(gv, 1);
  for (size_t s0 = gv ? (nj + step - 1) / step * step : 0; s0 > 0;) {
    s0 -= step;
    switch (gv) {
      case 1: encode_step<1>(s0, nj, cls_j, nb_j, rt, dtab, venc); break;
      case 2: encode_step<2>(s0, nj, cls_j, nb_j, rt, dtab, venc); break;
      case 3: encode_step<3>(s0, nj, cls_j, nb_j, rt, dtab, venc); break;
      case 4: encode_step<4>(s0, nj, cls_j, nb_j, rt, dtab, venc); break;
      default:
        for (int g = gv - 1; g >= 0; --g) encode_step<1>(s0 + size_t(g) * kLanes, nj, cls_j, nb_j, rt, dtab, venc + g);
    }
  }
  uint64_t acc = 0;  // mantissa bits, LSB first, in position order (that of J)
  uint32_t fill = 0;
  for (size_t t = 0; t < nj; ++t) {
    const uint32_t k = nb_j[t];
    if (k < 2) continue;
    acc |= uint64_t(m_j[t] - (1u << (k - 1))) << fill;
    fill += k - 1;
    for (; fill >= 8; fill -= 8, acc >>= 8) mant.push_back(uint8_t(acc));
  }
  if (fill) mant.push_back(uint8_t(acc));
  const __m512i one = _mm512_set1_epi16(1);
  for (size_t i = 0; i < n; i += 32) {
    const __mmask32 live = n - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n - i)) - 1;
    const uint32_t low = _mm512_mask_test_epi16_mask(live, _mm512_maskz_loadu_epi16(live, v + i), one);
    std::memcpy(signs + i / 8, &low, std::min<size_t>(4, (n - i + 7) / 8));
  }
}

// The mantissa bits, read 16 lanes at a time (a gather of 4 bytes per lane) where at least 4 bytes are left
// past the last one, else lane by lane; every read is bounds-checked.
struct Mantissa {
  const uint8_t* p;
  size_t len;
  const std::string& what;
  uint64_t bit = 0;  // bits consumed

  // m | the next lens[l] (1..63) bits for each lane l in `more`, in lane order
  SYNCD_512 __attribute__((always_inline)) inline __m512i take(__m512i m, __m512i lens, __mmask16 more) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i l = _mm512_maskz_mov_epi32(more, lens);
    __m512i incl = _mm512_add_epi32(l, _mm512_alignr_epi32(l, zero, 15));
    incl = _mm512_add_epi32(incl, _mm512_alignr_epi32(incl, zero, 14));
    incl = _mm512_add_epi32(incl, _mm512_alignr_epi32(incl, zero, 12));
    incl = _mm512_add_epi32(incl, _mm512_alignr_epi32(incl, zero, 8));
    const uint64_t total = uint32_t(_mm_cvtsi128_si32(_mm512_extracti32x4_epi32(_mm512_alignr_epi32(zero, incl, 15), 0)));
    if (total > 8 * uint64_t(len) - bit) fail(what, ": raw-bits stream truncated");
    const uint64_t byte = bit >> 3;
    if (len - byte >= 64 && total <= 448) {
      // every lane's bits lie in the 64 bytes from `byte`: per lane, its 64-bit word of that window and the next,
      // funnel-shifted down to its first bit (two halves of 8 lanes)
      const __m512i win = _mm512_loadu_si512(p + byte);
      const __m512i off = _mm512_add_epi32(_mm512_set1_epi32(int(bit & 7)), _mm512_sub_epi32(incl, l));
      __m512i out[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i o = _mm512_cvtepu32_epi64(h ? _mm512_extracti64x4_epi64(off, 1) : _mm512_castsi512_si256(off));
        const __m512i q = _mm512_srli_epi64(o, 6);
        const __m512i lo = _mm512_permutexvar_epi64(q, win);
        const __m512i hi = _mm512_permutexvar_epi64(_mm512_add_epi64(q, _mm512_set1_epi64(1)), win);
        out[h] = _mm512_shrdv_epi64(lo, hi, _mm512_and_si512(o, _mm512_set1_epi64(63)));
      }
      const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(out[0])), _mm512_cvtepi64_epi32(out[1]), 1);
      const __m512i mask = _mm512_sub_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(1), l), _mm512_set1_epi32(1));
      m = _mm512_or_si512(m, _mm512_and_si512(bits, mask));
      bit += total;
      return m;
    }
    alignas(64) uint32_t mm[kLanes], nl[kLanes];
    _mm512_store_si512(mm, m);
    _mm512_store_si512(nl, l);
    for (uint32_t b = more; b; b &= b - 1) {
      const int lane = __builtin_ctz(b);
      uint64_t x = 0;
      for (uint32_t i = 0; i < nl[lane]; ++i, ++bit) x |= uint64_t(p[bit >> 3] >> (bit & 7) & 1) << i;
      mm[lane] |= uint32_t(x);
    }
    return _mm512_load_si512(mm);
  }
  void finish() const {
    const uint64_t left = 8 * uint64_t(len) - bit;
    if (left >= 8 || (left && (p[len - 1] >> (8 - left))))
      throw DeltaError(what + ": raw-bits stream has unused bits");
  }
};

// The rows of one step of the value streams, its GV groups interleaved (independent chains): writes m of
// each lane (1 << (nb - 1) | its nb - 1 mantissa bits) to m_j.
template <int GV>
SYNCD_512 inline void decode_step(size_t s0, size_t nj, const uint8_t* cls_j, const RowTables& rt, __m512i dtab,
                                  BinGroupDecoder* vdec, Mantissa& mant, uint16_t* m_j) {
  const __m512i onev = _mm512_set1_epi32(1);
  __m512i c16[GV], depth[GV], u[GV], x[GV];
  __mmask16 live[GV];
  int top = 0;
  for (int g = 0; g < GV; ++g) {
    const size_t lo = s0 + size_t(g) * kLanes;
    live[g] = lo >= nj ? 0 : nj - lo >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (nj - lo)) - 1);
    c16[g] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live[g], cls_j + (lo < nj ? lo : 0)));
    depth[g] = _mm512_maskz_permutexvar_epi32(live[g], c16[g], dtab);
    top = std::max(top, _mm512_reduce_max_epi32(depth[g]));
    u[g] = onev;
    x[g] = _mm512_loadu_si512(vdec[g].x);
  }
  for (int r = 0; r < top; ++r) {
    const __m512i rr = _mm512_set1_epi32(r);
    for (int g = 0; g < GV; ++g) {
      const __mmask16 active = _mm512_cmpgt_epi32_mask(depth[g], rr);
      if (!active) continue;
      const __mmask16 bit = dec_step<true>(x[g], active, rt.at(r, c16[g], u[g]), vdec[g].p, vdec[g].end,
                                           vdec[g].what);
      u[g] = _mm512_mask_mov_epi32(u[g], active, _mm512_mask_or_epi32(_mm512_slli_epi32(u[g], 1), bit,
                                                                     _mm512_slli_epi32(u[g], 1), onev));
    }
  }
  for (int g = 0; g < GV; ++g) {
    _mm512_storeu_si512(vdec[g].x, x[g]);
    if (!live[g]) continue;
    const __m512i nb = _mm512_sub_epi32(u[g], _mm512_sllv_epi32(onev, depth[g]));
    const __mmask16 some = _mm512_test_epi32_mask(nb, nb);
    __m512i m = _mm512_maskz_sllv_epi32(some, onev, _mm512_sub_epi32(nb, onev));
    const __mmask16 more = _mm512_cmpgt_epi32_mask(nb, onev);
    if (more) m = mant.take(m, _mm512_sub_epi32(nb, onev), more);  // J order: group by group, lane by lane
    _mm256_mask_storeu_epi16(m_j + s0 + size_t(g) * kLanes, live[g], _mm512_cvtepi32_epi16(m));
  }
}

SYNCD_512 void decode_values(const uint8_t* cls, size_t n, const uint8_t* signs, const ValueTrees& lv,
                             BinGroupDecoder* vdec, int gv, const uint8_t* mant_p, size_t mant_len, uint16_t* v,
                             const std::string& what) {
  uint8_t* cls_j = grown(t_cls_j, n + 64);
  uint16_t* m_j = grown(t_m_j, n + 64);
  uint64_t* jbits = grown(t_jbits, n / 64 + 2);
  const size_t nj = select_j(cls, nullptr, n, lv, cls_j, nullptr, nullptr, jbits);
  check_value_groups(gv, nj, what);
  Mantissa mant{mant_p, mant_len, what};
  const __m512i dtab = _mm512_loadu_si512(lv.depth);
  const RowTables rt(lv);  // 16-bit dtypes: trees of at most 4 levels
  const size_t step = size_t(kLanes) * std::max(gv, 1);
  for (size_t s0 = 0; s0 < nj && gv; s0 += step) {
    switch (gv) {
      case 1: decode_step<1>(s0, nj, cls_j, rt, dtab, vdec, mant, m_j); break;
      case 2: decode_step<2>(s0, nj, cls_j, rt, dtab, vdec, mant, m_j); break;
      case 3: decode_step<3>(s0, nj, cls_j, rt, dtab, vdec, mant, m_j); break;
      case 4: decode_step<4>(s0, nj, cls_j, rt, dtab, vdec, mant, m_j); break;
      default:  // more groups than our encoders write: one at a time (same order within each stream)
        for (int g = 0; g < gv; ++g) decode_step<1>(s0 + size_t(g) * kLanes, nj, cls_j, rt, dtab, vdec + g, mant, m_j);
    }
  }
  // every value: its low bit, plus 2m for the changes in J (expanded into place)
  const __m512i one = _mm512_set1_epi16(1), bad = _mm512_set1_epi16(-1);
  size_t jat = 0;
  for (size_t i = 0; i < n; i += 32) {
    const __mmask32 live = n - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n - i)) - 1;
    uint32_t low = 0;
    std::memcpy(&low, signs + i / 8, std::min<size_t>(4, (n - i + 7) / 8));
    const __mmask32 jm = __mmask32(jbits[i / 64] >> (i % 64));
    const __m512i mx = expand_load32x16(jm & live, m_j + jat);
    const __m512i x = _mm512_or_si512(_mm512_slli_epi16(mx, 1), _mm512_maskz_mov_epi16(__mmask32(low) & live, one));
    if (_mm512_mask_cmpeq_epi16_mask(live, x, bad))
      throw DeltaError(what + ": value change 65535 too wide for the dtype");
    _mm512_mask_storeu_epi16(v + i, live, x);
    jat += unsigned(__builtin_popcount(jm & live));
  }
  mant.finish();
}

}  // namespace avx512_16
}  // namespace syncd

#endif
