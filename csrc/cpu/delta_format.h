// Delta blob formats 1 and 2: header layout and validation (spec: syncd/ops/_format.py, docs/delta-format.md).
// Both versions share the header and block table; they differ in the block payloads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "entropy.h"

namespace syncd {

constexpr uint16_t kMinFormat = 1, kMaxFormat = 2, kDefaultFormat = 1;
constexpr int kDefaultBlockLog2 = 20;
constexpr int kMinBlockLog2 = 8;
constexpr int kMaxBlockLog2 = 26;
constexpr int kMaxNdim = 8;
constexpr uint64_t kMaxNumel = uint64_t(1) << 48;
constexpr size_t kHeaderFixed = 48;
constexpr size_t kBlockEntry = 16;

struct DTypeInfo {
  int code;
  int bits;
  bool is_float;
  int exp_shift;  // floats: where the exponent field sits (format 2's context); 0, 0 for integers
  int exp_bits;
};

// Throws DeltaError for an unknown code.
DTypeInfo dtype_info(int code);

struct BlockEntry {
  uint32_t payload_bytes;
  uint32_t n_changed;
  uint64_t payload_checksum;
};

struct Header {
  int version = kDefaultFormat;
  DTypeInfo dtype;
  std::vector<uint64_t> shape;
  uint64_t numel = 0;
  int block_log2 = kDefaultBlockLog2;
  uint64_t n_changed = 0;
  uint64_t base_checksum = 0;
  uint64_t new_checksum = 0;
  std::vector<BlockEntry> blocks;
  std::vector<uint64_t> payload_offset;  // absolute offset of each block's payload in the blob
  size_t header_bytes = 0;

  uint64_t block_start(size_t b) const { return uint64_t(b) << block_log2; }
  uint64_t block_span(size_t b) const {
    uint64_t s = block_start(b), e = s + (uint64_t(1) << block_log2);
    return (e < numel ? e : numel) - s;
  }
};

size_t header_size(size_t ndim, size_t n_blocks);
uint64_t blocks_for(uint64_t numel, int block_log2);

// Parses and validates everything but the payloads (see parse_header in _format.py); throws DeltaError.
Header parse_header(const uint8_t* blob, size_t n);

// Throws DeltaError when the blob's dtype or shape is not the target's.
void check_target(const Header& h, int dtype_code, const std::vector<uint64_t>& shape);

// Serialises a header for the given block table (payloads follow it in order).
std::vector<uint8_t> pack_header(const DTypeInfo& dt, const std::vector<uint64_t>& shape, int block_log2,
                                 const std::vector<BlockEntry>& blocks, uint64_t base_checksum,
                                 uint64_t new_checksum, int version);

}  // namespace syncd
