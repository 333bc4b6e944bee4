// Shared by the AVX2 format-2 kernels (v2_kernels_avx2.cpp: positions, scan, apply; v2_values_avx2.cpp:
// values): permute and shuffle tables, lane masks, and one binary rANS step per direction on 8 lanes. Each
// 16-lane row is two 8-lane halves, lanes 0..7 first (the order their renormalisation words are read in).
// Include only from those files, inside `#if defined(__x86_64__)`.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "v2_kernels.h"

#define SYNCD_256 __attribute__((target("avx2,bmi,bmi2,popcnt")))
#define SYNCD_INLINE __attribute__((always_inline)) inline

namespace syncd {
namespace avx2_16 {
namespace detail {

// expand[m][l]: for lane l of mask m, the index of its word among the m-lanes (lanes outside m: 0);
// top[m][l]: the lane whose word goes to slot l when the m-lanes are packed into the top popcount(m) slots.
struct Tables {
  alignas(32) int32_t expand[256][8];
  alignas(32) int32_t top[256][8];
  alignas(32) int32_t pack[256][8];  // the m-lanes in order, then lane 0: left-packing permute
  // byte shuffles of 8 16-bit lanes for mask m (-1: a zero byte): pack16 left-packs the m-lanes, expand16
  // puts the k-th of 8 packed values in the k-th m-lane, pack8 left-packs the m-lanes' low bytes
  alignas(16) int8_t pack16[256][16], expand16[256][16], pack8[256][16];
  Tables() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int l = 0; l < 8; ++l) expand[m][l] = (m >> l & 1) ? k++ : 0;
      const int cnt = __builtin_popcount(unsigned(m));
      for (int l = 0; l < 8; ++l) top[m][l] = 0;
      k = 8 - cnt;
      for (int l = 0; l < 8; ++l)
        if (m >> l & 1) top[m][k++] = l;
      k = 0;
      for (int l = 0; l < 8; ++l) pack[m][l] = 0;
      for (int l = 0; l < 8; ++l)
        if (m >> l & 1) pack[m][k++] = l;
      for (int b = 0; b < 16; ++b) pack16[m][b] = expand16[m][b] = pack8[m][b] = -1;
      k = 0;
      for (int l = 0; l < 8; ++l)
        if (m >> l & 1) {
          pack16[m][2 * k] = int8_t(2 * l), pack16[m][2 * k + 1] = int8_t(2 * l + 1);
          expand16[m][2 * l] = int8_t(2 * k), expand16[m][2 * l + 1] = int8_t(2 * k + 1);
          pack8[m][k++] = int8_t(2 * l);
        }
    }
  }
};
inline const Tables kTab;

[[noreturn]] __attribute__((noinline, cold)) inline void fail(const std::string& what, const char* msg) {
  throw DeltaError(what + msg);
}
SYNCD_256 SYNCD_INLINE __m256i lane_mask(uint32_t m8) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(m8)), bits), bits);
}

SYNCD_256 SYNCD_INLINE uint32_t mask8(__m256i v) { return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(v))); }

SYNCD_256 SYNCD_INLINE __m128i shuffle_by(__m128i x, const int8_t (&table)[256][16], uint32_t m8) {
  return _mm_shuffle_epi8(x, _mm_load_si128(reinterpret_cast<const __m128i*>(table[m8])));
}

// Appends the low bytes of the m-lanes (bit l of m: 16-bit lane l of x) at out; writes 16 bytes past them at
// most. Returns popcount(m).
SYNCD_256 SYNCD_INLINE uint32_t pack_low_bytes(__m256i x, uint32_t m, uint8_t* out) {
  const uint32_t c0 = uint32_t(__builtin_popcount(m & 0xFF));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), shuffle_by(_mm256_castsi256_si128(x), kTab.pack8, m & 0xFF));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out + c0), shuffle_by(_mm256_extracti128_si256(x, 1), kTab.pack8, m >> 8));
  return c0 + uint32_t(__builtin_popcount(m >> 8));
}

// One decoder step of 8 lanes (coded8: the lanes coded); returns their bits. With `every_lane` coded8 is not
// applied: a lane with p1 = 0 (a class that is not coded) steps to itself, as x stays at least 2^16.
//   bit 1: x = p1 * (x >> 16) + slot;  bit 0: x = (2^16 - p1) * (x >> 16) + slot - p1 = x - p1 * (x >> 16) - p1
template <bool every_lane = false>
SYNCD_256 SYNCD_INLINE uint32_t dec8(__m256i& x, uint32_t coded8, __m256i p1, const uint8_t*& p, const uint8_t* end,
                                     const std::string& what) {
  if (!every_lane && !coded8) return 0;
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF), zero = _mm256_setzero_si256();
  const __m256i slot = _mm256_and_si256(x, lo16);
  const __m256i m = _mm256_mullo_epi32(p1, _mm256_srli_epi32(x, 16));
  __m256i bitv = _mm256_cmpgt_epi32(p1, slot);
  __m256i nx = _mm256_blendv_epi8(_mm256_sub_epi32(x, _mm256_add_epi32(m, p1)), _mm256_add_epi32(m, slot), bitv);
  if (!every_lane) {
    const __m256i cm = lane_mask(coded8);
    bitv = _mm256_and_si256(bitv, cm);
    nx = _mm256_blendv_epi8(x, nx, cm);
  }
  x = nx;
  const __m256i renv = _mm256_cmpeq_epi32(_mm256_srli_epi32(x, 16), zero);  // never a lane that is not coded
  const uint32_t ren = mask8(renv);
  const unsigned cnt = unsigned(__builtin_popcount(ren));
  __m128i w8;
  if (__builtin_expect(end - p >= 16, 1)) {  // the next 8 words, whether or not this step takes them
    w8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    if (size_t(end - p) < 2 * size_t(cnt)) fail(what, ": binary stream truncated");
    alignas(16) uint8_t tmp[16] = {};
    std::memcpy(tmp, p, 2 * cnt);
    w8 = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
  }
  const __m256i w = _mm256_permutevar8x32_epi32(_mm256_cvtepu16_epi32(w8),
                                                _mm256_load_si256(reinterpret_cast<const __m256i*>(kTab.expand[ren])));
  x = _mm256_blendv_epi8(x, _mm256_or_si256(_mm256_slli_epi32(x, 16), w), renv);
  p += 2 * cnt;
  return mask8(bitv);
}

// One encoder step of 8 lanes, rows going backwards: words are written below w. With `every_lane` coded8 is not
// applied: a lane with p1 = 0 has f = 2^16, emits nothing (x >> 16 < f) and keeps its state (x / f, x % f).
template <bool every_lane = false>
SYNCD_256 SYNCD_INLINE void enc8(__m256i& x, uint32_t coded8, uint32_t bits8, __m256i p1, uint8_t*& w) {
  if (!every_lane && !coded8) return;
  const __m256i one16 = _mm256_set1_epi32(1 << 16), zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
  const __m256i cm = every_lane ? _mm256_set1_epi32(-1) : lane_mask(coded8);
  const __m256i bitv = lane_mask(every_lane ? bits8 : bits8 & coded8);  // a change's class is always coded
  const __m256i f = _mm256_blendv_epi8(_mm256_sub_epi32(one16, p1), p1, bitv);
  const __m256i cc = _mm256_andnot_si256(bitv, p1);
  const __m256i hi = _mm256_srli_epi32(x, 16);
  const __m256i lt = _mm256_cmpgt_epi32(f, hi);  // x < f << 16 (both sides below 2^17: no overflow)
  const __m256i emitv = _mm256_andnot_si256(lt, cm);
  const uint32_t emit = mask8(emitv);
  {  // the emitting lanes' low halves, packed into the top slots, stored to end at w
    const __m256i packed = _mm256_permutevar8x32_epi32(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(kTab.top[emit])));
    const __m256i lo = _mm256_shuffle_epi8(packed, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                   0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m128i words = _mm_unpacklo_epi64(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w - 16), words);  // below w is free space (and the states' room)
    w -= 2 * __builtin_popcount(emit);
  }
  const __m256i xs = _mm256_blendv_epi8(x, hi, emitv);
  // q = xs / f from a float estimate (xs may pass 2^31: converted halved), exact after one correction each way
  const __m256 xf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(xs, 1)), _mm256_set1_ps(2.0f));
  const __m256i fm = every_lane ? f : _mm256_blendv_epi8(one, f, cm);
  __m256i q = _mm256_cvttps_epi32(_mm256_div_ps(xf, _mm256_cvtepi32_ps(fm)));
  __m256i r = _mm256_sub_epi32(xs, _mm256_mullo_epi32(q, fm));
  const __m256i neg = _mm256_cmpgt_epi32(zero, r);
  q = _mm256_add_epi32(q, neg);
  r = _mm256_add_epi32(r, _mm256_and_si256(neg, fm));
  const __m256i big = _mm256_cmpgt_epi32(r, _mm256_sub_epi32(fm, one));
  q = _mm256_sub_epi32(q, big);
  r = _mm256_sub_epi32(r, _mm256_and_si256(big, fm));
  const __m256i nx = _mm256_add_epi32(_mm256_slli_epi32(q, 16), _mm256_add_epi32(r, cc));
  x = every_lane ? nx : _mm256_blendv_epi8(x, nx, cm);
}

struct State {
  __m256i lo, hi;
};
}  // namespace detail
}  // namespace avx2_16
}  // namespace syncd
