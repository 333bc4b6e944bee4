#include "simd_scan.h"

#include "checksum.h"
#include "codec_core.h"
#include "prefetch.h"
#include "simd_mix.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SYNCD_NO_MULTIVERSION)
#define SYNCD_HAVE_AVX512_PATH 1
#include <immintrin.h>
// GCC's AVX-512 headers fill unused lanes from _mm512_undefined_*(), which -Wuninitialized reports
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace syncd {

namespace {

uint64_t scalar_checksum_and_diff(const uint8_t* o, const uint8_t* n, size_t nwords, uint64_t first, uint64_t* masks) {
  uint64_t s = 0;
  for (size_t g = 0; g * 64 < nwords; ++g) {
    uint64_t m = 0;
    size_t end = nwords - g * 64 < 64 ? nwords - g * 64 : 64;
    for (size_t i = 0; i < end; ++i) {
      size_t w = g * 64 + i;
      uint64_t a = load_le64(o + 8 * w);
      s += checksum_term(a, first + w);
      if (n) m |= uint64_t(a != load_le64(n + 8 * w)) << i;
    }
    if (masks) masks[g] = m;
  }
  return s;
}

// Scalar extraction: per changed word, its checksum change and each differing lane.
size_t scalar_extract16(const uint8_t* o, const uint8_t* n, uint64_t mask, uint64_t first_word, uint32_t first_pos,
                        bool is_float, uint32_t* pos, uint64_t* v, uint64_t* adj) {
  size_t k = 0;
  uint64_t ad = 0;
  for (uint64_t m = mask; m; m &= m - 1) {
    unsigned i = unsigned(__builtin_ctzll(m));
    uint64_t a = load_le64(o + 8 * i), b = load_le64(n + 8 * i);
    ad += checksum_term(b, first_word + i) - checksum_term(a, first_word + i);
    for (unsigned l = 0; l < 4; ++l) {
      uint16_t oa = uint16_t(a >> (16 * l)), nb = uint16_t(b >> (16 * l));
      if (oa == nb) continue;
      pos[k] = first_pos + 4 * i + l;
      v[k++] = core::code_value<uint16_t>(oa, nb, is_float);
    }
  }
  *adj += ad;
  return k;
}

#ifdef SYNCD_HAVE_AVX512_PATH

// Little-endian only (x86). Two independent accumulators hide the multiply latency.
__attribute__((target("avx512f,avx512dq"))) uint64_t avx512_checksum_and_diff(const uint8_t* o, const uint8_t* n,
                                                                               size_t nwords, uint64_t first,
                                                                               uint64_t* masks) {
  const __m512i step8 = _mm512_set1_epi64(int64_t(8 * kGolden));
  // key of lane l in the current group of 8: (first + w + l + 1) * golden, advanced by adding 8 * golden
  __m512i key = word_keys512(first);
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  size_t groups = nwords / 64;
  for (size_t g = 0; g < groups; ++g) {
    uint64_t m = 0;
    const uint8_t* po = o + g * 512;
    prefetch_ahead(po, 512);
    if (n) prefetch_ahead(n + g * 512, 512);
    for (int k = 0; k < 8; k += 2) {
      __m512i a0 = _mm512_loadu_si512(po + 64 * k), a1 = _mm512_loadu_si512(po + 64 * (k + 1));
      __m512i key1 = _mm512_add_epi64(key, step8);
      acc0 = _mm512_add_epi64(acc0, mix512(_mm512_xor_si512(a0, key)));
      acc1 = _mm512_add_epi64(acc1, mix512(_mm512_xor_si512(a1, key1)));
      key = _mm512_add_epi64(key1, step8);
      if (n) {
        const uint8_t* pn = n + g * 512;
        m |= uint64_t(_mm512_cmpneq_epu64_mask(a0, _mm512_loadu_si512(pn + 64 * k))) << (8 * k);
        m |= uint64_t(_mm512_cmpneq_epu64_mask(a1, _mm512_loadu_si512(pn + 64 * (k + 1)))) << (8 * (k + 1));
      }
    }
    if (masks) masks[g] = m;
  }
  uint64_t s = uint64_t(_mm512_reduce_add_epi64(_mm512_add_epi64(acc0, acc1)));
  size_t done = groups * 64;
  if (done < nwords)
    s += scalar_checksum_and_diff(o + 8 * done, n ? n + 8 * done : nullptr, nwords - done, first + done,
                                  masks ? masks + groups : nullptr);
  return s;
}

bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return ok;
}
// One 64-byte vector (8 words, 32 elements) at a time: masked loads of the changed words only, the coded
// values of all 32 lanes at once, then compress-stores of the changed lanes' positions and values.
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vbmi2"))) size_t avx512_extract16(
    const uint8_t* o, const uint8_t* n, uint64_t mask, uint64_t first_word, uint32_t first_pos, bool is_float,
    uint32_t* pos, uint64_t* v, uint64_t* adj) {
  const __m512i iota = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                        13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i sign = _mm512_set1_epi16(int16_t(0x8000));
  const __m512i one = _mm512_set1_epi16(1);
  const __m512i key0 = word_keys512(first_word);
  __m512i acc = _mm512_setzero_si512();
  size_t k = 0;
  // only the vectors holding a changed word: one loop exit to predict per group, not one branch per vector
  for (uint64_t rest = mask; rest;) {
    const unsigned j = unsigned(__builtin_ctzll(rest)) / 8;
    rest &= ~(uint64_t(0xFF) << (8 * j));
    __mmask8 wm = __mmask8(mask >> (8 * j));
    __m512i a = _mm512_maskz_loadu_epi64(wm, o + 64 * j), b = _mm512_maskz_loadu_epi64(wm, n + 64 * j);
    __m512i key = _mm512_add_epi64(key0, _mm512_set1_epi64(int64_t(8 * j * kGolden)));
    // masked-off words are zero in both, so they add mix(key) - mix(key) = 0
    acc = _mm512_add_epi64(acc, _mm512_sub_epi64(mix512(_mm512_xor_si512(b, key)), mix512(_mm512_xor_si512(a, key))));
    __mmask32 lm = _mm512_cmpneq_epi16_mask(a, b);
    __m512i ka = a, kb = b;
    if (is_float) {  // negative: flip every bit; positive: set the sign
      ka = _mm512_xor_si512(a, _mm512_or_si512(_mm512_srai_epi16(a, 15), sign));
      kb = _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi16(b, 15), sign));
    }
    __m512i d = _mm512_sub_epi16(kb, ka);
    __m512i u = _mm512_xor_si512(_mm512_slli_epi16(d, 1), _mm512_srai_epi16(d, 15));
    __m512i cv = _mm512_maskz_compress_epi16(lm, _mm512_sub_epi16(u, one));
    __m512i cp = _mm512_maskz_compress_epi16(lm, iota);
    const __m512i base = _mm512_set1_epi32(int32_t(first_pos + 32 * j));
    _mm512_storeu_si512(pos + k, _mm512_add_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(cp)), base));
    _mm512_storeu_si512(v + k, _mm512_cvtepu16_epi64(_mm512_castsi512_si128(cv)));
    unsigned cnt = unsigned(__builtin_popcount(lm));
    if (cnt > 8) {
      _mm512_storeu_si512(v + k + 8, _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(cv, 1)));
      if (cnt > 16) {
        _mm512_storeu_si512(pos + k + 16,
                            _mm512_add_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(cp, 1)), base));
        _mm512_storeu_si512(v + k + 16, _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(cv, 2)));
        if (cnt > 24) _mm512_storeu_si512(v + k + 24, _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(cv, 3)));
      }
    }
    k += cnt;
  }
  *adj += uint64_t(_mm512_reduce_add_epi64(acc));
  return k;
}

bool have_vbmi2() {
  static const bool ok = have_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi2");
  return ok;
}
#endif

}  // namespace

uint64_t checksum_and_diff_words(const uint8_t* old_p, const uint8_t* new_p, size_t nwords, uint64_t first_word,
                                 uint64_t* masks) {
#ifdef SYNCD_HAVE_AVX512_PATH
  if (have_avx512()) return avx512_checksum_and_diff(old_p, new_p, nwords, first_word, masks);
#endif
  return scalar_checksum_and_diff(old_p, new_p, nwords, first_word, masks);
}

uint64_t checksum_words_fast(const uint8_t* p, size_t nwords, uint64_t first_word) {
#ifdef SYNCD_HAVE_AVX512_PATH
  if (have_avx512()) return avx512_checksum_and_diff(p, nullptr, nwords, first_word, nullptr);
#endif
  return checksum_words(p, nwords, first_word);
}

bool extract16_vectorised() {
#ifdef SYNCD_HAVE_AVX512_PATH
  return have_vbmi2();
#else
  return false;
#endif
}

size_t extract_changes16(const uint8_t* old_p, const uint8_t* new_p, uint64_t word_mask, uint64_t first_word,
                         uint32_t first_pos, bool is_float, uint32_t* pos, uint64_t* v, uint64_t* adj) {
#ifdef SYNCD_HAVE_AVX512_PATH
  if (have_vbmi2()) return avx512_extract16(old_p, new_p, word_mask, first_word, first_pos, is_float, pos, v, adj);
#endif
  return scalar_extract16(old_p, new_p, word_mask, first_word, first_pos, is_float, pos, v, adj);
}

}  // namespace syncd
