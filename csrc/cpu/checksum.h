// 64-bit content checksum of a byte string (spec: syncd/ops/reference/checksum.py).
// Torch-free; every function is pure and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace syncd {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kLengthMul = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kWordMul = 0xD6E8FEB86659FD93ull;

// The per-word mix: a bijection, one multiply between two xor-shifts (the first folds the high half down so
// every input bit reaches the multiply's carries).
inline uint64_t word_mix(uint64_t x) {
  x = (x ^ (x >> 32)) * kWordMul;
  return x ^ (x >> 32);
}

inline uint64_t fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  return x;
}

// Term of word index `i` holding the little-endian value `w`.
inline uint64_t checksum_term(uint64_t w, uint64_t i) { return word_mix(w ^ ((i + 1) * kGolden)); }

inline uint64_t load_le64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  w = __builtin_bswap64(w);
#endif
  return w;
}

// Sum of terms over `nwords` whole words at `p`, the first having index `first_word`.
uint64_t checksum_words(const uint8_t* p, size_t nwords, uint64_t first_word);

// `raw` over bytes [begin, end) of a buffer whose word 0 is at `base` (begin must be 8-aligned relative to
// base); a partial last word is zero-padded.
uint64_t checksum_raw_range(const uint8_t* base, size_t begin, size_t end);

inline uint64_t checksum_finalize(uint64_t raw, uint64_t nbytes) { return fmix64(raw + nbytes * kLengthMul); }

// Whole checksum, using up to `threads` threads.
uint64_t checksum_raw_parallel(const uint8_t* p, size_t nbytes, int threads);
inline uint64_t checksum(const uint8_t* p, size_t nbytes, int threads) {
  return checksum_finalize(checksum_raw_parallel(p, nbytes, threads), nbytes);
}

}  // namespace syncd
