// 64-bit content checksum of a byte string (spec: syncd/ops/reference/checksum.py).
// Torch-free; every function is pure and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "codec_core.h"

namespace syncd {

using core::checksum_term;
using core::fmix64;
using core::kGolden;
using core::kLengthMul;
using core::kWordMul;
using core::word_mix;

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

// checksum of an element-strided view, equal to checksum() of its contiguous copy: `numel` elements of
// `itemsize` bytes (1, 2, 4 or 8), element i at p + i * stride_bytes (the caller guarantees that memory).
// Gathered 512 KiB at a time into a per-thread buffer, so the copy never leaves the cache.
uint64_t checksum_strided(const uint8_t* p, size_t numel, size_t itemsize, size_t stride_bytes, int threads);

// checksum of every (pointer, nbytes) buffer, with the 512 KiB pieces of all of them in one pool.
std::vector<uint64_t> checksum_many(const std::vector<std::pair<const uint8_t*, size_t>>& bufs, int threads);

}  // namespace syncd
