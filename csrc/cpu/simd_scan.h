// Vectorised word scans used by the checksum and the delta encoder, with runtime dispatch between an
// AVX-512 implementation and portable scalar code. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace syncd {

// Sum of checksum terms of `nwords` words at `p` (first index `first_word`). Same value as the scalar
// definition in checksum.h on every path.
uint64_t checksum_words_fast(const uint8_t* p, size_t nwords, uint64_t first_word);

// Like checksum_words_fast over `old_p`, and also sets bit i%64 of masks[i/64] when word i of old_p and
// new_p differ (masks must hold ceil(nwords/64) entries; they are overwritten).
uint64_t checksum_and_diff_words(const uint8_t* old_p, const uint8_t* new_p, size_t nwords, uint64_t first_word,
                                 uint64_t* masks);

}  // namespace syncd
