// Format 2 block payloads (spec: syncd/ops/reference/delta_v2.py, context.py): mode 0 is the format-1
// payload behind a mode byte; mode 1 codes every element's "changed" decision with the probability of its
// context class (from the old value's exponent) and each change's value by its bit length, in binary rANS
// group streams. Torch-free. Thread-safe: each object is used by one thread at a time; buffers keep their
// capacity between blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "binary_rans.h"
#include "block_coder.h"
#include "delta_format.h"

namespace syncd {

constexpr int kClasses = 16;
constexpr uint8_t kModeOrder0 = 0, kModeContext = 1;
constexpr uint64_t kSamplePeriod = 1 << 14, kSampleRun = 1 << 10;
constexpr uint64_t kContextMinChanges = 256, kContextMinSpan = 4096;
constexpr uint64_t kChangesPerGroup = 2048;
constexpr int kEncoderMaxGroups = 4;

// Whether encoders write a block of n changes in `span` elements in mode 1.
inline bool use_context(uint64_t n, uint64_t span) { return n >= kContextMinChanges && span >= kContextMinSpan; }

// Where the classes of a block's old elements come from: the old elements themselves (`old`, the block's
// first element), or classes computed elsewhere (a GPU), two per byte (`nibbles`, element 2i in the low
// nibble of byte i; `first` is the block's first element index in that array).
struct ClassSource {
  const uint8_t* old = nullptr;
  const uint8_t* nibbles = nullptr;
  uint64_t first = 0;
};

// The classes of elements [lo, lo + n) of a block (block-relative), into out[0..n).
void block_classes(const ClassSource& cs, const DTypeInfo& dt, int e_top, uint64_t lo, size_t n, uint8_t* out);

// The encoder's e_top of a block of `span` elements whose old elements start at `old`.
int choose_e_top(const uint8_t* old, uint64_t span, const DTypeInfo& dt);

// Accumulates one block's changes (as BlockEncoder) and writes its format-2 payload.
class V2BlockEncoder {
 public:
  void reset();
  void add(const uint32_t* pos, const uint64_t* v, size_t n);
  uint64_t count() const { return n_; }
  // Appends the payload of a block of `span` elements (count() >= 1) to `out`. Mode 1 needs the classes
  // (`cs`) and e_top: chosen here from the old elements when cs.old is set, else `e_top` is used.
  void finish(std::vector<uint8_t>& out, uint64_t span, const DTypeInfo& dt, const ClassSource& cs, int e_top);

 private:
  void finish_context(std::vector<uint8_t>& out, uint64_t span, const DTypeInfo& dt, const ClassSource& cs,
                      int e_top);
  PodBuffer<uint32_t> pos_;
  PodBuffer<uint64_t> v_;
  PodBuffer<uint8_t> cls_, cls_ch_, nb_, words_;
  PodBuffer<uint64_t> bitmap_;
  PodBuffer<uint32_t> jidx_;
  uint64_t n_ = 0;
};

V2BlockEncoder& thread_v2_encoder();

// Decodes one format-2 payload (mode 0 or 1) into block-relative positions and values, validating
// everything (DeltaError names the block). Positions come out ascending.
class V2BlockDecoder {
 public:
  // Parses the payload's parameters; decode() then needs the classes of the old elements.
  void parse(const uint8_t* payload, size_t len, uint32_t n, uint64_t span, const DTypeInfo& dt, size_t block);
  bool context() const { return mode_ == kModeContext; }
  int e_top() const { return e_top_; }
  // Writes n positions and values (for mode 0, cs is not used).
  void decode(const ClassSource& cs, uint32_t* pos, uint64_t* v);

 private:
  void decode_context(const ClassSource& cs, uint32_t* pos, uint64_t* v);
  std::string what_;
  const uint8_t* payload_ = nullptr;
  size_t len_ = 0;
  uint32_t n_ = 0;
  uint64_t span_ = 0;
  DTypeInfo dt_{};
  size_t block_ = 0;
  uint8_t mode_ = 0;
  int e_top_ = 0, gp_ = 0, gv_ = 0;
  uint32_t p1_[kClasses] = {};
  int depth_[kClasses] = {};
  uint32_t levels_[kClasses][64] = {};
  const uint8_t* streams_[2 * kMaxGroups] = {};
  size_t stream_len_[2 * kMaxGroups] = {};
  const uint8_t* mant_ = nullptr;
  size_t mant_len_ = 0;
  const uint8_t* signs_ = nullptr;
};

// The decoded form of one block kept by an apply until its tensor is known good (for undo).
struct DecodedBlock {
  std::vector<uint32_t> pos;
  std::vector<uint64_t> v;
};

}  // namespace syncd
