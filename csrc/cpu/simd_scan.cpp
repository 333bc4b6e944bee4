#include "simd_scan.h"

#include "checksum.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SYNCD_NO_MULTIVERSION)
#define SYNCD_HAVE_AVX512_PATH 1
#include <immintrin.h>
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

#ifdef SYNCD_HAVE_AVX512_PATH
__attribute__((target("avx512f,avx512dq"))) inline __m512i mix512(__m512i x) {
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 32)), _mm512_set1_epi64(int64_t(kWordMul)));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 32));
}

// Little-endian only (x86). Two independent accumulators hide the multiply latency.
__attribute__((target("avx512f,avx512dq"))) uint64_t avx512_checksum_and_diff(const uint8_t* o, const uint8_t* n,
                                                                               size_t nwords, uint64_t first,
                                                                               uint64_t* masks) {
  const __m512i golden = _mm512_set1_epi64(int64_t(kGolden));
  const __m512i step8 = _mm512_set1_epi64(int64_t(8 * kGolden));
  // key of lane l in the current group of 8: (first + w + l + 1) * golden, advanced by adding 8 * golden
  __m512i key = _mm512_mullo_epi64(_mm512_add_epi64(_mm512_set1_epi64(int64_t(first + 1)),
                                                    _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0)),
                                   golden);
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  size_t groups = nwords / 64;
  for (size_t g = 0; g < groups; ++g) {
    uint64_t m = 0;
    const uint8_t* po = o + g * 512;
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

}  // namespace syncd
