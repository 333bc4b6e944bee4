// The words a change list touches, before and after, and what that does to the checksum: how an engine stages
// a tensor it holds whole with one decode (syncd.ops.delta.changed_words; reference: the NumPy path there).
// Torch-free and pure; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace syncd {

// Inputs: `words` (nw ascending 64-bit word indices of the old tensor's bytes) and `old_words` (their
// contents, little-endian, zero past the tensor's end); `pos` (n ascending element positions) and `v` (their
// coded values, docs/delta-format.md), every position lying in one of the listed words, each word holding at
// least one. Writes old_el[i] and new_el[i], the bits of element pos[i] before and after (n elements of the
// dtype's width each). Returns the change of the checksum's raw sum, sum of mix(new ^ k) - mix(old ^ k) over
// the words (mod 2^64). Throws DeltaError for an unknown dtype, a value too wide for it, positions that do not
// ascend, or positions that do not walk the listed words in order (then the outputs are partly written).
uint64_t changed_words(int dtype_code, const uint64_t* words, const uint64_t* old_words, size_t nw,
                       const uint64_t* pos, const uint64_t* v, size_t n, uint8_t* old_el, uint8_t* new_el);

// The 64-bit words `words` (nw ascending indices into the contiguous byte image) of a view of `numel`
// elements of `itemsize` bytes (1, 2, 4 or 8), element i at p + i * stride_bytes (contiguous: stride_bytes ==
// itemsize; the caller guarantees that memory), little-endian, zero past the last element: the old_words
// changed_words takes, read in place, on up to `threads` threads. Throws DeltaError for a word that starts past
// the view's end (then `out` is partly written).
void gather_words(const uint8_t* p, size_t numel, size_t itemsize, size_t stride_bytes, const uint64_t* words,
                  size_t nw, uint64_t* out, int threads);

}  // namespace syncd
