// AVX2 kernels of format 2's mode-3 positions for 16-bit dtypes (v2_rows.h), on 8-lane halves as the other AVX2
// kernels: row contexts from a row's least magnitude (phminposuw), a flag row as one 16-lane step, and each flagged
// row as one step whose chain probabilities are computed in the vector (bit lengths from float conversions, as AVX2
// has no lzcnt). Bit for bit the portable kernels' results. Included by v2_kernels_avx2.cpp only (inside its `#if`).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "v2_avx2.h"
#include "v2_rows.h"

namespace syncd {
namespace avx2_16 {
namespace rows {
using namespace detail;

struct Half2 {
  __m256i lo, hi;  // lanes 0..7, 8..15 (32 bits each)
};

struct Lanes {
  __m256i emask, etop, fifteen, zero, tlo, thi, hibit, lo15, r_lo, r_hi, seven, four, two, one, max16, lo16;
  __m256i shift_idx[4], keep[4];  // lane l takes lane l + k (k = 1, 2, 4) where it exists, else 0
  __m128i shift;
  int sh;
  uint32_t em;
  int etop_i;
  bool magnitude;
  SYNCD_256 explicit Lanes(const Classes16& c)
      : emask(_mm256_set1_epi16(int16_t(c.emask))),
        etop(_mm256_set1_epi16(int16_t(c.e_top))),
        fifteen(_mm256_set1_epi16(15)),
        zero(_mm256_setzero_si256()),
        hibit(_mm256_set1_epi16(int16_t(0x8000))),
        lo15(_mm256_set1_epi16(0x7FFF)),
        r_lo(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kChainReciprocal))),
        r_hi(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kChainReciprocal + 8))),
        seven(_mm256_set1_epi32(7)),
        four(_mm256_set1_epi32(4)),
        two(_mm256_set1_epi32(2)),
        one(_mm256_set1_epi32(1)),
        max16(_mm256_set1_epi32(0xFFFF)),
        lo16(_mm256_set1_epi32(0xFFFF)),
        shift(_mm_cvtsi32_si128(c.shift)),
        sh(c.shift),
        em(c.emask),
        etop_i(c.e_top),
        magnitude(c.emask && (c.emask << c.shift) == 0x7FFF) {
    alignas(16) uint8_t lo[16], hi[16];
    for (int l = 0; l < 16; ++l) {
      lo[l] = uint8_t(c.p1 ? c.p1[l] : 0);
      hi[l] = uint8_t(c.p1 ? c.p1[l] >> 8 : 0);
    }
    tlo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(lo)));
    thi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(hi)));
    for (int s = 0, k = 1; s < 3; ++s, k *= 2) {
      alignas(32) int32_t idx[8], m[8];
      for (int l = 0; l < 8; ++l) {
        idx[l] = l + k < 8 ? l + k : 0;
        m[l] = l + k < 8 ? -1 : 0;
      }
      shift_idx[s] = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
      keep[s] = _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
    }
  }
  // The context of the row whose 16 words are w (all live): the class of its least exponent.
  SYNCD_256 SYNCD_INLINE uint32_t context(__m256i w) const {
    const __m256i x = magnitude ? _mm256_and_si256(w, lo15) : _mm256_and_si256(_mm256_srl_epi16(w, shift), emask);
    const __m128i m = _mm_min_epu16(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    const int least = _mm_cvtsi128_si32(_mm_minpos_epu16(m)) & 0xFFFF;
    const int e = magnitude ? least >> sh : least;
    return uint32_t(std::min(15, std::max(0, etop_i - e)));
  }
  // A row's classes (16-bit lanes) and probabilities p (two halves; 0 for classes not coded and past `live`).
  SYNCD_256 SYNCD_INLINE void probabilities(__m256i w, uint32_t live, __m256i* cls, Half2* p) const {
    const __m256i e = _mm256_and_si256(_mm256_srl_epi16(w, shift), emask);
    *cls = _mm256_min_epi16(_mm256_max_epi16(_mm256_sub_epi16(etop, e), zero), fifteen);
    const __m256i idx = _mm256_or_si256(*cls, hibit);  // the high byte of each index zeroes its byte
    const __m256i pw = _mm256_or_si256(_mm256_shuffle_epi8(tlo, idx), _mm256_slli_epi16(_mm256_shuffle_epi8(thi, idx), 8));
    p->lo = _mm256_and_si256(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(pw)), lane_mask(live & 0xFF));
    p->hi = _mm256_and_si256(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(pw, 1)), lane_mask(live >> 8));
  }
  SYNCD_256 SYNCD_INLINE __m256i suffix8(__m256i s) const {
    for (int k = 0; k < 3; ++k)
      s = _mm256_add_epi32(s, _mm256_and_si256(_mm256_permutevar8x32_epi32(s, shift_idx[k]), keep[k]));
    return s;
  }
  // q = min(65535, max(p, (p R[m]) >> (e + 2))), e = max(0, bitlen(S) - 4), m = S >> e (v2_rows.h)
  SYNCD_256 SYNCD_INLINE __m256i chain(__m256i p, __m256i s) const {
    // bitlen(S) from the exponent of float(S) (exact below 2^24): 0 -> -126, which e clamps to 0
    const __m256i bl = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(s)), 23),
                                        _mm256_set1_epi32(126));
    const __m256i e = _mm256_max_epi32(_mm256_sub_epi32(bl, four), zero);
    const __m256i m = _mm256_srlv_epi32(s, e);
    const __m256i r = _mm256_blendv_epi8(_mm256_permutevar8x32_epi32(r_lo, m), _mm256_permutevar8x32_epi32(r_hi, m),
                                         _mm256_cmpgt_epi32(m, seven));
    const __m256i q = _mm256_srlv_epi32(_mm256_mullo_epi32(p, r), _mm256_add_epi32(e, two));
    return _mm256_min_epu32(_mm256_max_epu32(q, p), max16);
  }
  SYNCD_256 SYNCD_INLINE Half2 chain(const Half2& p) const {
    const __m256i s_hi = suffix8(p.hi);
    const __m256i total_hi = _mm256_permutevar8x32_epi32(s_hi, zero);  // lane 8's suffix sum, everywhere
    const __m256i s_lo = _mm256_add_epi32(suffix8(p.lo), total_hi);
    return {chain(p.lo, s_lo), chain(p.hi, s_hi)};
  }
};

inline uint32_t live_lanes(uint64_t span, uint64_t t) {
  const uint64_t left = span - t * kLanes;
  return left >= kLanes ? 0xFFFFu : (1u << left) - 1;
}

SYNCD_256 SYNCD_INLINE uint32_t lanes_below(__m256i x, __m256i q) {  // x < q, both below 2^31
  return mask8(_mm256_cmpgt_epi32(q, x));
}

SYNCD_256 SYNCD_INLINE __m256i row_words(const Classes16& c, uint64_t t, uint32_t live) {
  if (live == 0xFFFF) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.old + t * kLanes));
  alignas(32) uint16_t tmp[16] = {};
  std::memcpy(tmp, c.old + t * kLanes, size_t(__builtin_popcount(live)) * 2);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
}

// The row contexts of a block (ctx: one byte per row).
SYNCD_256 inline void contexts(const Classes16& c, uint8_t* ctx) {
  const Lanes ln(c);
  const uint64_t whole = c.span / kLanes;
  for (uint64_t t = 0; t < whole; ++t) {
    if (t % 4 == 0) prefetch_ahead(c.old + t * kLanes, 128);
    ctx[t] = uint8_t(ln.context(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.old + t * kLanes))));
  }
  for (uint64_t t = whole; t * kLanes < c.span; ++t) {  // a partial last row
    uint8_t cls[kLanes];
    scalar16::row_classes(c, t, cls);
    ctx[t] = *std::max_element(cls, cls + kLanes);
  }
}

// Encodes a mode-3 block's position streams backwards (v2_rows.h; the old words are read again).
SYNCD_256 inline void encode(const Classes16& c, const uint16_t* bitmap, const uint8_t* ctx, const uint32_t* pa,
                             BinGroupEncoder* enc, int gp) {
  const Lanes ln(c);
  const uint64_t rows = (c.span + kLanes - 1) / kLanes, supers = (rows + kLanes - 1) / kLanes;
  uint64_t steps = supers;
  for (uint64_t t = 0; t < rows; ++t) steps += bitmap[t] != 0;
  auto step = [&](uint64_t s, uint32_t coded, uint32_t bits, const Half2& pr) SYNCD_256 {
    BinGroupEncoder& e = enc[s % uint64_t(gp)];
    State x{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.x + 8))};
    enc8(x.hi, coded >> 8, bits >> 8, pr.hi, e.w);  // backwards: the upper half's words first
    enc8(x.lo, coded & 0xFF, bits & 0xFF, pr.lo, e.w);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(e.x), x.lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(e.x + 8), x.hi);
  };
  for (uint64_t u = supers; u-- > 0;) {
    uint32_t flags = 0, live_rows = 0;
    alignas(32) uint32_t pr[kLanes] = {};
    for (int i = 0; i < kLanes && u * kLanes + i < rows; ++i) {
      const uint64_t t = u * kLanes + i;
      pr[i] = pa[ctx[t]];
      live_rows |= uint32_t(pr[i] != 0) << i;
      flags |= uint32_t(bitmap[t] != 0) << i;
    }
    for (uint32_t f = flags; f; f &= ~(0x80000000u >> __builtin_clz(f))) {  // its flagged rows, last first
      const uint64_t t = u * kLanes + 31 - unsigned(__builtin_clz(f));
      const uint32_t live = live_lanes(c.span, t), bits = bitmap[t];
      __m256i cls;
      Half2 p;
      ln.probabilities(row_words(c, t, live), live, &cls, &p);
      const Half2 q = ln.chain(p);
      const uint32_t le = bits ^ (bits - 1);  // lanes up to the first change take q
      const Half2 use{_mm256_blendv_epi8(p.lo, q.lo, lane_mask(le & 0xFF)), _mm256_blendv_epi8(p.hi, q.hi, lane_mask(le >> 8 & 0xFF))};
      const uint32_t coded = mask8(_mm256_cmpgt_epi32(p.lo, ln.zero)) | mask8(_mm256_cmpgt_epi32(p.hi, ln.zero)) << 8;
      step(--steps, coded, bits, use);
    }
    step(--steps, live_rows, flags & live_rows,
         {_mm256_load_si256(reinterpret_cast<const __m256i*>(pr)), _mm256_load_si256(reinterpret_cast<const __m256i*>(pr + 8))});
  }
}

// Decodes a mode-3 block's position streams (v2_rows.h); *old_sum: the old words' checksum terms.
SYNCD_256 inline size_t decode(const Classes16& c, const uint32_t* pa, BinGroupDecoder* dec, int gp, uint16_t* bitmap,
                               uint8_t* cls_ch, size_t n_max, const std::string& what, uint32_t* flagged,
                               size_t* nflagged) {
  const Lanes ln(c);
  const uint64_t rows = (c.span + kLanes - 1) / kLanes, supers = (rows + kLanes - 1) / kLanes;
  const uint64_t whole = c.span / kLanes;  // rows with 16 elements
  uint64_t s = 0;
  size_t nf = 0, found = 0;
  auto step = [&](uint32_t coded, const Half2& pr, uint32_t* bits_out, const Half2* q) SYNCD_256 {
    BinGroupDecoder& d = dec[s++ % uint64_t(gp)];
    State x{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d.x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d.x + 8))};
    Half2 use = pr;
    if (q) {  // a flagged row: q up to the first lane that decodes 1 with it (all: none)
      const uint32_t hit = lanes_below(_mm256_and_si256(x.lo, ln.lo16), q->lo) |
                           lanes_below(_mm256_and_si256(x.hi, ln.lo16), q->hi) << 8;
      const uint32_t le = hit ^ (hit - 1);
      use = {_mm256_blendv_epi8(pr.lo, q->lo, lane_mask(le & 0xFF)), _mm256_blendv_epi8(pr.hi, q->hi, lane_mask(le >> 8 & 0xFF))};
    }
    const uint32_t lo = dec8<true>(x.lo, 0xFF, use.lo, d.p, d.end, what);
    *bits_out = (lo | dec8<true>(x.hi, 0xFF, use.hi, d.p, d.end, what) << 8) & coded;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d.x), x.lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d.x + 8), x.hi);
  };
  for (uint64_t u = 0; u < supers; ++u) {
    alignas(32) uint32_t pr[kLanes] = {};
    uint32_t coded = 0;
    for (int i = 0; i < kLanes && u * kLanes + i < rows; ++i) {
      const uint64_t t = u * kLanes + i;
      uint32_t cx;
      if (t < whole) {
        cx = ln.context(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.old + t * kLanes)));
      } else {
        uint8_t cls[kLanes];
        scalar16::row_classes(c, t, cls);
        cx = *std::max_element(cls, cls + kLanes);
      }
      pr[i] = pa[cx];
      coded |= uint32_t(pr[i] != 0) << i;
    }
    uint32_t f;  // a lane whose probability is 0 steps to itself and decodes 0
    step(coded, {_mm256_load_si256(reinterpret_cast<const __m256i*>(pr)), _mm256_load_si256(reinterpret_cast<const __m256i*>(pr + 8))},
         &f, nullptr);
    nf += size_t(__builtin_popcount(f));
    check_flagged(nf, n_max, what);
    for (uint32_t m = f; m; m &= m - 1) {
      const uint64_t t = u * kLanes + unsigned(__builtin_ctz(m));
      const uint32_t live = live_lanes(c.span, t);
      __m256i cls;
      Half2 p;
      ln.probabilities(row_words(c, t, live), live, &cls, &p);
      const Half2 q = ln.chain(p);
      const uint32_t rc = mask8(_mm256_cmpgt_epi32(p.lo, ln.zero)) | mask8(_mm256_cmpgt_epi32(p.hi, ln.zero)) << 8;
      uint32_t bits;
      step(rc, p, &bits, &q);
      if (!bits) flagged_row_without_change(t, what);
      flagged[nf - size_t(__builtin_popcount(m))] = uint32_t(t);
      bitmap[t] = uint16_t(bits);
      if (size_t(__builtin_popcount(bits)) > n_max - found) fail(what, ": more changes than the block table says");
      found += pack_low_bytes(cls, bits, cls_ch + found);  // cls_ch has n_max + 64 bytes
    }
  }
  *nflagged = nf;
  return found;
}

}  // namespace rows
}  // namespace avx2_16
}  // namespace syncd
