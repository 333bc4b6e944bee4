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
  void next(uint32_t* pos, uint64_t* v) {
    uint64_t val[2];
    for (int st = 0; st < 2; ++st) {
      const DecodeModel& m = models_[st];
      uint32_t xs = x_[st];
      uint32_t slot = xs & (kProbScale - 1);
      uint32_t sym = m.lut[slot];
      xs = m.freq[sym] * (xs >> kProbBits) + slot - m.cum[sym];
      while (xs < kRansL) {
        if (p_ >= end_) reader_.fail("entropy-coded stream truncated");
        xs = (xs << 8) | data_[p_++];
      }
      x_[st] = xs;
      uint32_t extra_n = kBucketNbits[sym];
      val[st] = extra_n ? kBucketBase[sym] + bits_.read(extra_n) : kBucketBase[sym];
    }
    if (val[0] >= span_ || int64_t(val[0]) >= int64_t(span_) - 1 - prev_)
      reader_.fail("change position outside the block of " + std::to_string(span_) + " elements");
    prev_ += 1 + int64_t(val[0]);
    if (val[1] > vmax_) reader_.fail("value change " + std::to_string(val[1]) + " too wide for the dtype");
    *pos = static_cast<uint32_t>(prev_);
    *v = val[1];
  }
  void finish();

  static const uint64_t* const kBucketBase;
  static const uint32_t* const kBucketNbits;

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
