// The checksum's per-word mix (codec_core.h: word_mix) on 8 words at once, for the AVX-512 kernels.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "codec_core.h"

namespace syncd {

__attribute__((target("avx512f,avx512dq"))) inline __m512i mix512(__m512i x) {
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 32)), _mm512_set1_epi64(int64_t(core::kWordMul)));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 32));
}

// The checksum keys (i + 1) * golden of the 8 words first_word .. first_word + 7.
__attribute__((target("avx512f,avx512dq"))) inline __m512i word_keys512(uint64_t first_word) {
  return _mm512_mullo_epi64(_mm512_add_epi64(_mm512_set1_epi64(int64_t(first_word + 1)),
                                             _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0)),
                            _mm512_set1_epi64(int64_t(core::kGolden)));
}

// Sum of the 8 words, wrapping (GCC's _mm512_reduce_add_epi64 adds as signed, which UBSan reports).
__attribute__((target("avx512f"))) inline uint64_t reduce_add_u64(__m512i x) {
  alignas(64) uint64_t w[8];
  _mm512_store_si512(w, x);
  uint64_t s = 0;
  for (uint64_t v : w) s += v;
  return s;
}

}  // namespace syncd
#endif
