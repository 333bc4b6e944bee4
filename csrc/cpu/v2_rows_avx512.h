// AVX-512 kernels of format 2's mode-3 positions for 16-bit dtypes (v2_rows.h): row contexts 16 rows at a time
// (a tree of minima over a super-row's 256 elements), a flag row as one 16-lane step, and each flagged row as one
// step whose chain probabilities are computed in the vector. The group states stay in registers: every loop goes
// in units of gp rows, the j-th of a unit in group j. Bit for bit the portable kernels' results.
// Included by v2_kernels_avx512.cpp only (inside its `#if`), which defines the entry points.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "simd_mix.h"
#include "v2_avx512.h"
#include "v2_rows.h"

namespace syncd {
namespace avx512_16 {
namespace rows {
using namespace detail;

constexpr uint64_t kSuper = uint64_t(kLanes) * kLanes;  // elements per super-row

inline __mmask16 first_lanes(uint64_t n) { return n >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// The contexts (dwords, row order) of the 16 rows of a super-row, from its 8 vectors of 32 old words
// (rows 2i and 2i + 1 in v[i]): a tree of minima of the exponent fields, or of the magnitudes when the exponent
// field is bits shift..14 (the least magnitude has the least exponent).
struct ContextTree {
  __m512i etop, emask, lo15, zero, fifteen;
  __m128i shift;
  bool magnitude;
  SYNCD_512 explicit ContextTree(const Classes16& c)
      : etop(_mm512_set1_epi32(c.e_top)),
        emask(_mm512_set1_epi16(int16_t(c.emask))),
        lo15(_mm512_set1_epi16(0x7FFF)),
        zero(_mm512_setzero_si512()),
        fifteen(_mm512_set1_epi32(15)),
        shift(_mm_cvtsi32_si128(c.shift)),
        magnitude(c.emask && (c.emask << c.shift) == 0x7FFF) {}
  // one vector's dwords: the least of the exponent keys of their two elements
  SYNCD_512 __attribute__((always_inline)) inline __m512i leaf(__m512i v) const {
    const __m512i x = magnitude ? _mm512_and_si512(v, lo15) : _mm512_and_si512(_mm512_srl_epi16(v, shift), emask);
    return _mm512_min_epu16(x, _mm512_srli_epi32(x, 16));  // the high halves become 0
  }
  SYNCD_512 __attribute__((always_inline)) inline __m512i contexts(__m512i (&a)[8]) const {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int n = 4; n >= 1; n /= 2)  // halve the dwords per row, keeping the rows in order
      for (int i = 0; i < n; ++i)
        a[i] = _mm512_min_epu32(_mm512_permutex2var_epi32(a[2 * i], even, a[2 * i + 1]),
                                _mm512_permutex2var_epi32(a[2 * i], odd, a[2 * i + 1]));
    const __m512i e = magnitude ? _mm512_srl_epi32(a[0], shift) : a[0];
    return _mm512_min_epi32(_mm512_max_epi32(_mm512_sub_epi32(etop, e), zero), fifteen);
  }
};

// The same from the nibbles of a super-row (128 bytes): the largest of each row's 16 classes.
SYNCD_512 __attribute__((always_inline)) inline __m512i contexts_nibbles(const uint8_t* nib) {
  __m128i out[2];
  for (int h = 0; h < 2; ++h) {  // 64 bytes: 8 rows of 8 bytes
    const __m512i b = _mm512_loadu_si512(nib + 64 * h), lo4 = _mm512_set1_epi8(0xF);
    __m512i m = _mm512_max_epu8(_mm512_and_si512(b, lo4), _mm512_and_si512(_mm512_srli_epi16(b, 4), lo4));
    m = _mm512_max_epu8(m, _mm512_srli_epi64(m, 32));
    m = _mm512_max_epu8(m, _mm512_srli_epi64(m, 16));
    m = _mm512_max_epu8(m, _mm512_srli_epi64(m, 8));
    out[h] = _mm512_cvtepi64_epi8(m);  // the low byte of each row's qword
  }
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(out[0], out[1]));
}

// The context of row t, from its classes one at a time (the partial end of a block).
inline uint8_t context_of(const Classes16& c, uint64_t t) {
  uint8_t cls[kLanes];
  scalar16::row_classes(c, t, cls);
  return *std::max_element(cls, cls + kLanes);
}

// A flagged row's lanes: classes, probabilities p (0: not coded) and chain probabilities q (v2_rows.h).
struct Lanes {
  __m512i p1, chain, etop, zero, fifteen, four, two, max16, lo16;
  __m128i shift;
  uint32_t emask;
  SYNCD_512 explicit Lanes(const Classes16& c)
      : p1(_mm512_loadu_si512(c.p1)),
        chain(_mm512_loadu_si512(kChainReciprocal)),
        etop(_mm512_set1_epi32(c.e_top)),
        zero(_mm512_setzero_si512()),
        fifteen(_mm512_set1_epi32(15)),
        four(_mm512_set1_epi32(28)),
        two(_mm512_set1_epi32(2)),
        max16(_mm512_set1_epi32(0xFFFF)),
        lo16(_mm512_set1_epi32(0xFFFF)),
        shift(_mm_cvtsi32_si128(c.shift)),
        emask(c.emask) {}
  template <bool kNibbles>
  SYNCD_512 __attribute__((always_inline)) inline __m512i classes(const Classes16& c, uint64_t t, __mmask16 live) const {
    if (kNibbles) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(__mmask16(live & 0xFF), c.nibbles + t * 8));
      const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
      const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(b, 4);
      return _mm512_maskz_mov_epi32(live, _mm512_mask_blend_epi32(0xAAAA, _mm512_permutexvar_epi32(idx, lo),
                                                                  _mm512_permutexvar_epi32(idx, hi)));
    }
    return of_words(_mm256_maskz_loadu_epi16(live, c.old + t * kLanes));
  }
  SYNCD_512 __attribute__((always_inline)) inline __m512i of_words(__m256i words) const {
    const __m512i w = _mm512_cvtepu16_epi32(words);
    const __m512i e = _mm512_and_si512(_mm512_srl_epi32(w, shift), _mm512_set1_epi32(int(emask)));
    return _mm512_min_epi32(_mm512_max_epi32(_mm512_sub_epi32(etop, e), zero), fifteen);
  }
  // p (0 past `live`) and q: q = min(65535, max(p, (p R[m]) >> (e + 2))), e = max(0, bitlen(S) - 4), m = S >> e
  SYNCD_512 __attribute__((always_inline)) inline void probabilities(__m512i cls, __mmask16 live, __m512i* p,
                                                                     __m512i* q) const {
    const __m512i pv = _mm512_maskz_permutexvar_epi32(live, cls, p1);
    __m512i s = _mm512_add_epi32(pv, _mm512_alignr_epi32(zero, pv, 1));  // suffix sums
    s = _mm512_add_epi32(s, _mm512_alignr_epi32(zero, s, 2));
    s = _mm512_add_epi32(s, _mm512_alignr_epi32(zero, s, 4));
    s = _mm512_add_epi32(s, _mm512_alignr_epi32(zero, s, 8));
    const __m512i e = _mm512_max_epi32(_mm512_sub_epi32(four, _mm512_lzcnt_epi32(s)), zero);  // 28 - lzcnt
    const __m512i r = _mm512_permutexvar_epi32(_mm512_srlv_epi32(s, e), chain);
    const __m512i qv = _mm512_srlv_epi32(_mm512_mullo_epi32(pv, r), _mm512_add_epi32(e, two));
    *p = pv;
    *q = _mm512_min_epu32(_mm512_max_epu32(qv, pv), max16);
  }
};

// The row contexts of a block (ctx: one byte per row).
template <bool kNibbles>
SYNCD_512 void contexts(const Classes16& c, uint8_t* ctx) {
  const ContextTree tree(c);
  const uint64_t whole = c.span / kSuper;
  for (uint64_t u = 0; u < whole; ++u) {
    __m512i cx;
    if (kNibbles) {
      cx = contexts_nibbles(c.nibbles + u * kSuper / 2);
    } else {
      prefetch_ahead(c.old + u * kSuper, 2 * kSuper);
      __m512i a[8];
      for (int i = 0; i < 8; ++i) a[i] = tree.leaf(_mm512_loadu_si512(c.old + u * kSuper + 32 * i));
      cx = tree.contexts(a);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ctx + u * kLanes), _mm512_cvtepi32_epi8(cx));
  }
  for (uint64_t t = whole * kLanes; t * kLanes < c.span; ++t) ctx[t] = context_of(c, t);
}

// The number of flagged rows (bitmap entries not 0) of a block of `rows` rows.
SYNCD_512 inline uint64_t count_flagged(const uint16_t* bitmap, uint64_t rows) {
  uint64_t n = 0;
  for (uint64_t t = 0; t < rows; t += 32) {
    const __m512i b = _mm512_maskz_loadu_epi16(rows - t >= 32 ? ~__mmask32(0) : __mmask32((1u << (rows - t)) - 1), bitmap + t);
    n += unsigned(__builtin_popcount(_mm512_test_epi16_mask(b, b)));
  }
  return n;
}

// The states of gp groups taken in turn, one step each: the step at hand is always x[0] (constant indices keep
// them in registers); next() rotates the next group's into x[0]. Group of x[k]: (s + k) mod gp going forwards
// (step s at hand), (s - k) mod gp going backwards.
template <int gp, class Ptr>
struct Turns {
  __m512i x[gp];
  Ptr q[gp];
  SYNCD_512 __attribute__((always_inline)) inline void next() {
    const __m512i x0 = x[0];
    const Ptr q0 = q[0];
#pragma GCC unroll 8
    for (int k = 0; k + 1 < gp; ++k) {
      x[k] = x[k + 1];
      q[k] = q[k + 1];
    }
    x[gp - 1] = x0;
    q[gp - 1] = q0;
  }
};

// Encodes a mode-3 block's position streams backwards: super-row by super-row, last first, its flagged rows (last
// first) and then its flag row, step s in group s % gp.
template <int gp, bool kNibbles>
SYNCD_512 void encode(const Classes16& c, const uint16_t* bitmap, const uint8_t* ctx, const uint32_t* pa,
                      const uint16_t* words, BinGroupEncoder* enc) {
  const Lanes ln(c);
  const uint64_t rows = (c.span + kLanes - 1) / kLanes, supers = (rows + kLanes - 1) / kLanes;
  const uint64_t nf = count_flagged(bitmap, rows), steps = supers + nf;
  uint64_t r = nf;  // the flagged rows' old words, last first (words: null, or from a scan's extras)
  Turns<gp, uint8_t*> st;
  for (int k = 0; k < gp; ++k) {  // x[k]: group (steps - 1 - k) mod gp
    BinGroupEncoder& e = enc[(steps - 1 - uint64_t(k) + uint64_t(gp) * steps) % gp];
    st.x[k] = _mm512_loadu_si512(e.x);
    st.q[k] = e.w;
  }
  const uint64_t last = c.span % kLanes ? rows - 1 : rows;  // a partial last row, if any
  const __m512i one16 = _mm512_set1_epi32(1 << 16), pav = _mm512_loadu_si512(pa), sixteen = _mm512_set1_epi32(16);
  const __m512 two = _mm512_set1_ps(2.0f);
  float i0[kLanes], i1[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    i0[l] = pa[l] ? 1.0f / float(kBinOne - pa[l]) : 0.0f;
    i1[l] = pa[l] ? 1.0f / float(pa[l]) : 0.0f;
  }
  const __m512 inv0 = _mm512_loadu_ps(i0), inv1 = _mm512_loadu_ps(i1);
  for (uint64_t u = supers; u-- > 0;) {
    if (!kNibbles && !words) prefetch_behind(c.old + u * kSuper, 64);
    const __mmask16 live = first_lanes(rows - u * kLanes);
    const __m256i bm = _mm256_maskz_loadu_epi16(live, bitmap + u * kLanes);
    const __mmask16 flags = _mm256_test_epi16_mask(bm, bm);
    for (uint32_t f = flags; f; f &= ~(0x80000000u >> __builtin_clz(f))) {  // its flagged rows, last first
      const uint64_t t = u * kLanes + 31 - unsigned(__builtin_clz(f));
      const __mmask16 lanes = t == last ? live_lanes(c.span, t) : __mmask16(0xFFFF);
      __m512i p, q;
      --r;
      const __m512i cls = words ? ln.of_words(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + r * kLanes)))
                                : ln.classes<kNibbles>(c, t, lanes);
      ln.probabilities(cls, lanes, &p, &q);
      const uint32_t bits = bitmap[t];
      const __m512i pr = _mm512_mask_mov_epi32(p, __mmask16(bits ^ (bits - 1)), q);  // q up to the first change
      const __mmask16 coded = _mm512_test_epi32_mask(p, p), bit = __mmask16(bits);  // a change is always coded
      const __m512 fv = _mm512_cvtepi32_ps(_mm512_mask_blend_epi32(bit, _mm512_sub_epi32(one16, pr), pr));
      __m512 inv = _mm512_rcp14_ps(fv);  // 1 / f within 2^-14, then one Newton step: within 2^-22
      inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(fv, inv, two));
      enc_step(st.x[0], coded, bit, pr, inv, st.q[0]);
      st.next();
    }
    const __m512i cx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, ctx + u * kLanes));
    const __m512i pr = _mm512_maskz_permutexvar_epi32(live, cx, pav);
    const __m512 inv = _mm512_permutex2var_ps(inv0, _mm512_mask_or_epi32(cx, flags, cx, sixteen), inv1);
    enc_step(st.x[0], _mm512_test_epi32_mask(pr, pr), flags, pr, inv, st.q[0]);  // a changed row's context is listed
    st.next();
  }
  for (int k = 0; k < gp; ++k) {  // x[k]: group (-1 - k) mod gp
    BinGroupEncoder& e = enc[(uint64_t(gp) * 2 - 1 - uint64_t(k)) % gp];
    _mm512_storeu_si512(e.x, st.x[k]);
    e.w = st.q[k];
  }
}

// Decodes a mode-3 block's position streams, super-row by super-row: its old words' checksum terms (*old_sum)
// and row contexts, its flag row, then its flagged rows (whose old words, still in L1, are copied to fr->words
// when given, for apply); step s in group s % gp.
template <int gp, bool kNibbles>
SYNCD_512 size_t decode(const Classes16& c, const uint32_t* pa, BinGroupDecoder* dec, uint16_t* bitmap, uint8_t* cls_ch,
                        size_t n_max, const std::string& what, uint64_t first_word, uint64_t* old_sum,
                        FlaggedRows* fr) {
  const ContextTree tree(c);
  const Lanes ln(c);
  Turns<gp, const uint8_t*> st;  // x[k]: group (s + k) mod gp
  const uint8_t* e[gp];          // their streams' ends, in the same turns
  for (int k = 0; k < gp; ++k) {
    st.x[k] = _mm512_loadu_si512(dec[k].x);
    st.q[k] = dec[k].p;
    e[k] = dec[k].end;
  }
  auto next = [&]() SYNCD_512 __attribute__((always_inline)) {
    st.next();
    const uint8_t* e0 = e[0];
#pragma GCC unroll 8
    for (int k = 0; k + 1 < gp; ++k) e[k] = e[k + 1];
    e[gp - 1] = e0;
  };
  const uint64_t rows = (c.span + kLanes - 1) / kLanes, supers = (rows + kLanes - 1) / kLanes;
  const uint64_t whole = c.span / kSuper;  // whole super-rows
  const uint64_t last = c.span % kLanes ? rows - 1 : rows;
  const __m512i step8 = _mm512_set1_epi64(int64_t(8 * core::kGolden)), pav = _mm512_loadu_si512(pa);
  __m512i key = word_keys512(first_word), acc = _mm512_setzero_si512();
  uint32_t* flagged = fr->rows;
  uint16_t* words = fr->words;  // null with nibbles, or when the caller keeps none
  size_t nf = 0, found = 0;
  uint64_t steps = 0;
  // super-row u's flag row (contexts cx of its live rows), then its flagged rows
  auto super_row = [&](uint64_t u, __m512i cx, __mmask16 live) SYNCD_512 __attribute__((always_inline)) {
    const __mmask16 f = dec_step<true, true>(st.x[0], 0xFFFF, _mm512_maskz_permutexvar_epi32(live, cx, pav), st.q[0],
                                             e[0], what);
    next();
    steps += 1 + unsigned(__builtin_popcount(f));
    if (__builtin_expect(nf + unsigned(__builtin_popcount(f)) > n_max, 0))
      check_flagged(nf + unsigned(__builtin_popcount(f)), n_max, what);
    for (uint32_t m = f; m; m &= m - 1) {
      const uint64_t t = u * kLanes + unsigned(__builtin_ctz(m));
      const __mmask16 lanes = t == last ? live_lanes(c.span, t) : __mmask16(0xFFFF);
      __m512i cls;
      if (kNibbles) {
        cls = ln.classes<true>(c, t, lanes);
      } else {
        const __m256i wv = _mm256_maskz_loadu_epi16(lanes, c.old + t * kLanes);
        if (words) _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + nf * kLanes), wv);
        cls = ln.of_words(wv);
      }
      flagged[nf++] = uint32_t(t);
      __m512i pv, q;
      ln.probabilities(cls, lanes, &pv, &q);
      const uint32_t hit = _mm512_cmplt_epu32_mask(_mm512_and_si512(st.x[0], ln.lo16), q);
      const __mmask16 le = __mmask16(hit ^ (hit - 1));  // up to the first lane that decodes 1 with q (all: none)
      const __mmask16 bits = dec_step<true, true>(st.x[0], 0xFFFF, _mm512_mask_mov_epi32(pv, le, q), st.q[0], e[0], what);
      next();
      if (__builtin_expect(!bits, 0)) flagged_row_without_change(t, what);
      bitmap[t] = uint16_t(bits);
      compress_bytes16(cls_ch + found, bits, _mm512_cvtepi32_epi8(cls));  // cls_ch has n_max + 64 bytes
      found += unsigned(__builtin_popcount(bits));
      if (__builtin_expect(found > n_max, 0)) fail(what, ": more changes than the block table says");
    }
  };
  for (uint64_t u = 0; u < whole; ++u) {
    __m512i cx;
    if (kNibbles) {
      cx = contexts_nibbles(c.nibbles + u * kSuper / 2);
    } else {
      prefetch_ahead(c.old + u * kSuper, 2 * kSuper);
      __m512i a[8];
      for (int i = 0; i < 8; ++i) {
        const __m512i v = _mm512_loadu_si512(c.old + u * kSuper + 32 * i);
        acc = _mm512_add_epi64(acc, mix512(_mm512_xor_si512(v, key)));
        key = _mm512_add_epi64(key, step8);
        a[i] = tree.leaf(v);
      }
      cx = tree.contexts(a);
    }
    super_row(u, cx, 0xFFFF);
  }
  if (!kNibbles) *old_sum = reduce_add_u64(acc) + scalar16::checksum(c.old, c.span, first_word, whole * kSuper);
  if (whole < supers) {  // a partial last super-row, its contexts one row at a time
    alignas(64) uint32_t cl[kLanes] = {};
    const __mmask16 live = first_lanes(rows - whole * kLanes);
    for (int i = 0; i < kLanes; ++i) cl[i] = live >> i & 1 ? context_of(c, whole * kLanes + i) : 0;
    super_row(whole, _mm512_load_si512(cl), live);
  }
  for (int k = 0; k < gp; ++k) {  // x[k]: group (steps + k) mod gp
    BinGroupDecoder& d = dec[(steps + uint64_t(k)) % gp];
    _mm512_storeu_si512(d.x, st.x[k]);
    d.p = st.q[k];
  }
  fr->n = nf;
  return found;
}

using ContextsFn = void (*)(const Classes16&, uint8_t*);
using EncodeFn = void (*)(const Classes16&, const uint16_t*, const uint8_t*, const uint32_t*, const uint16_t*,
                          BinGroupEncoder*);
using DecodeFn = size_t (*)(const Classes16&, const uint32_t*, BinGroupDecoder*, uint16_t*, uint8_t*, size_t,
                            const std::string&, uint64_t, uint64_t*, FlaggedRows*);
template <bool kNibbles>
constexpr EncodeFn kEncode[kMaxGroups] = {encode<1, kNibbles>, encode<2, kNibbles>, encode<3, kNibbles>,
                                          encode<4, kNibbles>, encode<5, kNibbles>, encode<6, kNibbles>,
                                          encode<7, kNibbles>, encode<8, kNibbles>};
template <bool kNibbles>
constexpr DecodeFn kDecode[kMaxGroups] = {decode<1, kNibbles>, decode<2, kNibbles>, decode<3, kNibbles>,
                                          decode<4, kNibbles>, decode<5, kNibbles>, decode<6, kNibbles>,
                                          decode<7, kNibbles>, decode<8, kNibbles>};

}  // namespace rows
}  // namespace avx512_16
}  // namespace syncd
