// Shared by the AVX-512 format-2 kernels (v2_kernels_avx512.cpp: positions, scan, apply; v2_values_avx512.cpp:
// values): constants, masked expand/compress of consecutive elements, and one binary rANS step per direction
// on 16 lanes. Include only from those files, inside `#if defined(__x86_64__)`.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <string>

#include "block_coder.h"
#include "v2_kernels.h"

// GCC's AVX-512 headers fill unused lanes from _mm512_undefined_*(), which -Wuninitialized reports
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define SYNCD_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512vbmi2,bmi2,popcnt")))

namespace syncd {
namespace avx512_16 {
namespace detail {


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

[[noreturn]] __attribute__((noinline, cold)) inline void fail(const std::string& what, const char* msg) {
  throw DeltaError(what + msg);
}

// One binary rANS decoder step of the lanes in `coded`, probabilities p1; returns their bits. With `checked`
// false the caller guarantees 32 readable bytes at p (16 words are loaded before the renormalisation mask is
// known, so that the load is off the state's dependency chain). With `every_lane` the mask is not applied: a lane
// with p1 = 0 (a class that is not coded) steps to itself, as x stays at least 2^16, so every lane may run.
//   bit 1: x = p1 * (x >> 16) + slot;  bit 0: x = (2^16 - p1) * (x >> 16) + slot - p1 = x - p1 * (x >> 16) - p1
template <bool checked, bool every_lane = false>
SYNCD_512 __attribute__((always_inline)) inline __mmask16 dec_step(__m512i& x, __mmask16 coded, __m512i p1,
                                                                 const uint8_t*& p, const uint8_t* end,
                                                                 const std::string& what) {
  const __m512i lo16 = _mm512_set1_epi32(0xFFFF), one16 = _mm512_set1_epi32(1 << 16);
  if (every_lane) coded = 0xFFFF;
  const __m512i slot = _mm512_and_si512(x, lo16);
  const __m512i m = _mm512_mullo_epi32(p1, _mm512_srli_epi32(x, 16));
  const __mmask16 bit = every_lane ? _mm512_cmplt_epu32_mask(slot, p1) : _mm512_mask_cmplt_epu32_mask(coded, slot, p1);
  const __m512i mp = _mm512_add_epi32(m, p1);
  const __m512i x0 = every_lane ? _mm512_sub_epi32(x, mp) : _mm512_mask_sub_epi32(x, coded, x, mp);
  x = _mm512_mask_add_epi32(x0, bit, m, slot);
  const __mmask16 ren = every_lane ? _mm512_cmplt_epu32_mask(x, one16) : _mm512_mask_cmplt_epu32_mask(coded, x, one16);
  const unsigned cnt = unsigned(__builtin_popcount(ren));
  __m256i words;
  if (!checked || __builtin_expect(end - p >= 32, 1)) {
    words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {  // the stream's last words: read only those this row takes
    if (size_t(end - p) < 2 * size_t(cnt)) fail(what, ": binary stream truncated");
    words = _mm256_maskz_loadu_epi16(__mmask16((1u << cnt) - 1), p);
  }
  // (a 16-bit expand into the lanes' high halves and a funnel shift, vpshldd, was 6% faster at 1% density, but
  // blocks failed to decode in the sanitizer build, GCC -O1 -fsanitize=address,undefined; not understood)
  const __m512i w = _mm512_maskz_expand_epi32(ren, _mm512_cvtepu16_epi32(words));
  x = _mm512_mask_or_epi32(x, ren, _mm512_slli_epi32(x, 16), w);
  p += 2 * cnt;
  return bit;
}

// One encoder step (rows go backwards): lanes in `coded` encode `bit`; inv holds 1 / f per lane, f the
// probability of the lane's bit. Words go backwards at w.
SYNCD_512 __attribute__((always_inline)) inline void enc_step(__m512i& x, __mmask16 coded, __mmask16 bit, __m512i p1, __m512 inv, uint8_t*& w) {
  const __m512i one16 = _mm512_set1_epi32(1 << 16), one = _mm512_set1_epi32(1);
  const __m512i f = _mm512_mask_blend_epi32(bit, _mm512_sub_epi32(one16, p1), p1);
  const __m512i cc = _mm512_maskz_mov_epi32(_knot_mask16(bit), p1);
  const __mmask16 emit = _mm512_mask_cmpge_epu32_mask(coded, x, _mm512_slli_epi32(f, 16));
  w -= 2 * __builtin_popcount(emit);
  compress_store16(w, emit, _mm512_cvtepi32_epi16(x));
  const __m512i xs = _mm512_mask_srli_epi32(x, emit, x, 16);
  // q = xs / f < 2^16 from a float estimate: |xs * inv - xs / f| < 0.02 (inv within 2^-22 of 1 / f), so
  // xs * inv - 1/16, truncated toward zero (a negative estimate means q = 0), is q or q - 1: one correction
  __m512i q = _mm512_cvttps_epi32(_mm512_fmsub_ps(_mm512_cvtepu32_ps(xs), inv, _mm512_set1_ps(0.0625f)));
  __m512i r = _mm512_sub_epi32(xs, _mm512_mullo_epi32(q, f));
  const __mmask16 big = _mm512_cmpge_epu32_mask(r, f);
  q = _mm512_mask_add_epi32(q, big, q, one);
  r = _mm512_mask_sub_epi32(r, big, r, f);
  x = _mm512_mask_mov_epi32(x, coded, _mm512_add_epi32(_mm512_slli_epi32(q, 16), _mm512_add_epi32(r, cc)));
}

}  // namespace detail
}  // namespace avx512_16
}  // namespace syncd
