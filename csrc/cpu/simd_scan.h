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

// Whether extract_changes16 runs vectorised here (AVX-512 VBMI2); it is correct either way.
bool extract16_vectorised();

// The changed 16-bit elements of one group of 64 words: bit i of `word_mask` says word i differs between
// old_p and new_p (only those words are read, so the group may run past the tensor's end). For each changed
// element in order writes its position (first_pos + element index within the group) to pos[] and its coded
// value (zigzag of the key delta, minus one; float keys when is_float) to v[]; both need room for 256 + 32
// entries. Adds the checksum change of the group's words (first index first_word) to *adj. Returns the count.
size_t extract_changes16(const uint8_t* old_p, const uint8_t* new_p, uint64_t word_mask, uint64_t first_word,
                         uint32_t first_pos, bool is_float, uint32_t* pos, uint64_t* v, uint64_t* adj);

}  // namespace syncd
