// Native CPU delta codec (formats 1 and 2). Torch-free: callers pass raw byte buffers they own for the duration of
// the call. Thread-safe (no shared state); each call uses up to `threads` threads. All errors are DeltaError
// and, for apply, leave the target unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "delta_format.h"

namespace syncd {

// Blob taking `old_bytes` to `new_bytes` (both numel * itemsize bytes, element bits in machine order).
std::vector<uint8_t> delta_encode(const uint8_t* old_bytes, const uint8_t* new_bytes, int dtype_code,
                                  const std::vector<uint64_t>& shape, int block_log2, int threads, int version);

// Applies `blob` to `target` in place in one pass. With verify, checks the base checksum against the target
// and the result checksum (from the changed words); otherwise only the blob's own integrity is checked. On
// any failure every written element is restored before DeltaError propagates.
void delta_apply(uint8_t* target, const uint8_t* blob, size_t blob_len, int dtype_code,
                 const std::vector<uint64_t>& shape, bool verify, int threads);

// One tensor of a batch (same contracts as delta_encode / delta_apply).
struct EncodeJob {
  const uint8_t* old_bytes;
  const uint8_t* new_bytes;
  int dtype_code;
  std::vector<uint64_t> shape;
};
struct ApplyJob {
  uint8_t* target;
  const uint8_t* blob;
  size_t blob_len;
  int dtype_code;
  std::vector<uint64_t> shape;
};

// delta_encode of every job, with all blocks of all tensors in one pool of `threads` threads. Throws
// DeltaError for a bad dtype, shape or block_log2.
std::vector<std::vector<uint8_t>> delta_encode_many(const std::vector<EncodeJob>& jobs, int block_log2, int threads,
                                                    int version);

// delta_apply of every job, each tensor independently: returns one string per job, empty when it was
// applied, else the DeltaError message (and that target is unchanged). Targets must not overlap.
std::vector<std::string> delta_apply_many(const std::vector<ApplyJob>& jobs, bool verify, int threads);

// Format 2's context of the old tensor for delta_pack, computed where the old tensor lives (a GPU): the
// class of every element, two per byte (element 2i in the low nibble of byte i), and each block's e_top.
struct Context {
  const uint8_t* nibbles = nullptr;
  uint64_t numel = 0;
  std::vector<int> e_tops;
};

// Entropy-codes already-found changes: global positions (ascending, < numel) and coded values
// v = zigzag(key delta) - 1. Used by the GPU encoders; format 2 needs `ctx`.
std::vector<uint8_t> delta_pack(int dtype_code, const std::vector<uint64_t>& shape, int block_log2,
                                const uint64_t* pos, const uint64_t* v, size_t n, uint64_t base_checksum,
                                uint64_t new_checksum, int threads, int version, const Context& ctx);

// What a format-2 decoder knows of the base: its bytes, or the classes of its elements for the blob's
// e_tops (delta_block_e_tops), two per byte. Neither: context blocks raise DeltaError.
struct BaseView {
  const uint8_t* bytes = nullptr;
  const uint8_t* nibbles = nullptr;
};

// Decodes a blob whose header `h` was parsed (parse_header) and checked (check_target) into global
// positions and values; `pos` and `v` hold h.n_changed entries each. Validates every payload.
void delta_unpack_into(const Header& h, const uint8_t* blob, uint64_t* pos, uint64_t* v, int threads,
                       const BaseView& base);

// Each block's e_top (format 2 context blocks), -1 for the others. The header must be parsed; the payloads
// are not validated here.
std::vector<int> delta_block_e_tops(const Header& h, const uint8_t* blob);

}  // namespace syncd
