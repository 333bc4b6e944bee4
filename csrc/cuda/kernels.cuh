// CUDA kernels of the delta codec's GPU half: content checksum, changed-element count and compaction, and
// in-place scatter apply. Torch-free; launchers take raw device pointers and a cudaStream_t (as an integer).
// Contracts mirror syncd/ops/triton_kernels (see that module's docstrings).
#pragma once

#include <cstddef>
#include <cstdint>

namespace syncd_cuda {

constexpr int kScanTile = 4096;  // elements per block of the count / compact kernels

// Adds the unfinalised checksum sum of `nbytes` bytes at `data` into *out (a device u64, zeroed by caller).
void checksum_raw(const void* data, size_t nbytes, uint64_t* out, uintptr_t stream);

// counts[t] = number of differing elements in tile t (grid = ceil(n / kScanTile)).
void count_changes(const void* old_p, const void* new_p, size_t n, int bits, int64_t* counts, uintptr_t stream);

// Writes positions and coded values of differing elements, tile t starting at offsets[t].
void compact_changes(const void* old_p, const void* new_p, size_t n, int bits, bool is_float, const int64_t* offsets,
                     int64_t* pos, uint64_t* v, uintptr_t stream);

// target[pos[j]] = apply(target[pos[j]], v[j]) for j < m (forward=false undoes it).
void scatter_apply(void* target, const int64_t* pos, const uint64_t* v, size_t m, int bits, bool is_float,
                   bool forward, uintptr_t stream);

// Throws std::runtime_error with the CUDA error string if the last launch failed.
void check_last(const char* what);

}  // namespace syncd_cuda
