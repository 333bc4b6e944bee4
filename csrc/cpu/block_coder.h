// One block's changes <-> its payload (format v1): the bucketed symbols of gaps and values, their two
// frequency tables, the raw-bits stream and the interleaved rANS stream. Torch-free. Thread-safe: each
// object is used by one thread at a time; buffers keep their capacity between blocks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "entropy.h"

namespace syncd {

// A growable array of trivially copyable T whose new elements are left uninitialised (no zeroing pass
// over memory that is about to be written).
template <class T>
class PodBuffer {
 public:
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  size_t capacity() const { return cap_; }
  // Makes room for `n` elements, keeping the first `keep` ones.
  void reserve(size_t n, size_t keep = 0) {
    if (n <= cap_) return;
    size_t c = std::max(n, cap_ + cap_ / 2);
    std::unique_ptr<T[]> q(new T[c]);
    if (keep) std::memcpy(q.get(), p_.get(), keep * sizeof(T));
    p_ = std::move(q);
    cap_ = c;
  }
  // Room for `n` elements, none of them kept: a scratch buffer that only grows.
  T* scratch(size_t n) {
    if (n > cap_) {
      p_.reset();  // the old contents are not kept, so they need not coexist with the new ones
      cap_ = 0;
      reserve(n);
    }
    return data();
  }

 private:
  std::unique_ptr<T[]> p_;
  size_t cap_ = 0;
};

// Accumulates one block's changes in order and writes its payload. Symbols, counts and raw bits are formed
// as changes arrive, so the changes themselves need not be kept.
class BlockEncoder {
 public:
  // Starts a new block.
  void reset();
  // Appends n changes: block-relative positions (ascending, after every change added before; below 2^26)
  // and coded values v = zigzag(key delta) - 1 (at most 2^W - 2 for a W-bit dtype).
  void add(const uint32_t* pos, const uint64_t* v, size_t n);
  uint64_t count() const { return n_; }
  // Appends the payload (requires count() >= 1) to `out`.
  void finish(std::vector<uint8_t>& out);

 private:
  PodBuffer<uint8_t> syms_, raw_, rans_;
  uint32_t counts_[2][2][kAlphabet];  // [model][parity of the change][symbol]: two tables break store chains
  int64_t prev_ = -1;
  uint64_t n_ = 0;
  size_t raw_at_ = 0;  // whole bytes written to raw_
  uint64_t acc_ = 0;   // pending raw bits (fewer than 8)
  uint32_t fill_ = 0;
};

// The calling thread's encoder (buffers reused across calls).
BlockEncoder& thread_block_encoder();

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
