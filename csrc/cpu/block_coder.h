// One block's changes <-> its payload (format v1): the bucketed symbols of gaps and values, their two
// frequency tables, the raw-bits stream and the interleaved rANS stream. Torch-free. Thread-safe: each
// call uses its own state plus thread-local scratch buffers that keep their capacity between calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "entropy.h"

namespace syncd {

struct BlockChanges {
  std::vector<uint32_t> pos;  // block-relative, ascending
  std::vector<uint64_t> v;    // zigzag(key delta) - 1
  void clear() {
    pos.clear();
    v.clear();
  }
};

// Appends the payload of `c` (at least one change) to `out`.
void encode_block(const BlockChanges& c, std::vector<uint8_t>& out);

// Streams the changes of one payload, validating as it goes; every problem throws DeltaError naming the
// block. Call next() exactly n times, then finish() to check the end of the streams.
class BlockDecoder {
 public:
  BlockDecoder(const uint8_t* payload, size_t len, uint32_t n, uint64_t span, int bits_w, size_t block);
  BlockDecoder(const BlockDecoder&) = delete;  // bits_ points into reader_
  BlockDecoder& operator=(const BlockDecoder&) = delete;
  // Decodes the next `count` changes into pos[] / v[] (block-relative positions, coded values). The loop
  // keeps the coder state in locals, so batches of a few hundred run at register speed.
  void next_batch(uint32_t* pos, uint64_t* v, size_t count);
  void next(uint32_t* pos, uint64_t* v) { next_batch(pos, v, 1); }
  void finish();

 private:
  ByteReader reader_;
  std::unique_ptr<DecodeModel[]> models_;
  BitReader bits_;
  uint32_t x_[2] = {0, 0};
  const uint8_t* data_ = nullptr;
  size_t p_ = 0, end_ = 0;
  uint64_t span_, vmax_;
  int64_t prev_ = -1;
};

}  // namespace syncd
