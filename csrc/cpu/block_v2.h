// Format 2 block payloads (spec: syncd/ops/reference/delta_v2.py, context.py, rows.py): mode 0 is the format-1
// payload behind a mode byte; modes 1 and 2 code every element's "changed" decision with the probability of its
// context class (from the old value's exponent) and each change's value by its bit length, in binary rANS
// group streams; mode 3 is mode 2 whose positions are coded by row flags first (v2_rows.h). Torch-free. Thread-safe: each object is used by one thread at a time; buffers keep their
// capacity between blocks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "binary_rans.h"
#include "block_coder.h"
#include "delta_format.h"
#include "v2_kernels.h"
#include "v2_rows.h"

namespace syncd {

constexpr int kClasses = 16;
// payload modes: 0 the format-1 payload; 1, 2 and 3 context blocks (2: J by tree depth; 3: 2 with row flags;
// encoders write 2 and 3, see context_mode)
constexpr uint8_t kModeOrder0 = 0, kModeContext = 1, kModeContextByDepth = 2, kModeRowFlags = 3;
constexpr uint64_t kSamplePeriod = 1 << 14, kSampleRun = 1 << 10;
constexpr uint64_t kContextMinChanges = 256, kContextMinSpan = 4096, kContextMinChangesPerGroup = 128;
constexpr uint64_t kElementsPerGroup = 1 << 16, kChangesPerGroup = 2048;
constexpr int kEncoderMaxGroups = 4;

// The position groups an encoder gives a block of `span` elements (one per kElementsPerGroup, 1..4).
inline int position_groups(uint64_t span) {
  return int(std::min<uint64_t>(kEncoderMaxGroups, std::max<uint64_t>(1, span / kElementsPerGroup)));
}

// Whether encoders write a block of n changes in `span` elements in mode 1: float dtypes of 16 bits or more,
// enough changes in all and per position group (see delta_v2.use_context in the reference).
inline bool use_context(uint64_t n, uint64_t span, const DTypeInfo& dt) {
  return dt.exp_bits > 0 && dt.bits >= 16 && span >= kContextMinSpan &&
         n >= std::max<uint64_t>(kContextMinChanges, kContextMinChangesPerGroup * uint64_t(position_groups(span)));
}

// The mode encoders write a context block of n changes in `span` elements in: 3 when at most 1 / kRowFlagsDensity
// of its elements change, else 2.
inline uint8_t context_mode(uint64_t n, uint64_t span) {
  return n * kRowFlagsDensity <= span ? kModeRowFlags : kModeContextByDepth;
}

// Where the classes of a block's old elements come from: the old elements themselves (`old`, the block's
// first element), or classes computed elsewhere (a GPU), two per byte (`nibbles`, element 2i in the low
// nibble of byte i; `first` is the block's first element index in that array).
struct ClassSource {
  const uint8_t* old = nullptr;
  const uint8_t* nibbles = nullptr;
  uint64_t first = 0;
  uint64_t first_word = 0;  // with `old`: the checksum index of the block's first word
};

// The encoder's e_top of a block of `span` elements whose old elements start at `old`.
int choose_e_top(const uint8_t* old, uint64_t span, const DTypeInfo& dt);

// One block's changes as format 2 codes them: a bitmap (one u16 per 16 elements), and per change (in
// position order) its class and value v (v16 for 16-bit dtypes, else v64).
struct BlockChanges {
  uint64_t span = 0, n = 0;
  bool wide = false;  // values in v64
  bool has_old_sum = false;  // the decoder summed the checksum terms of the old words (old_sum)
  uint64_t old_sum = 0;
  PodBuffer<uint16_t> bitmap;
  PodBuffer<uint8_t> cls;
  PodBuffer<uint16_t> v16;
  PodBuffer<uint64_t> v64;
  // mode 3 (16-bit dtypes, from the old words): the flagged rows and a copy of each one's 16 old words, which
  // apply writes from (the old words are not read again) and undo restores
  bool has_rows = false;
  bool rows_listed = false;  // a mode-3 decode (16-bit dtypes) filled rows[0..nrows), with or without old words
  uint64_t nrows = 0;
  PodBuffer<uint32_t> rows;
  PodBuffer<uint16_t> row_words;
  void reset(uint64_t span_, bool wide_, uint64_t n_max);
  uint64_t value(uint64_t i) const { return wide ? v64.data()[i] : v16.data()[i]; }
  // Block-relative positions and values (for mode 0 and for unpack), in position order; `pos` must have room
  // for n + 8 entries (the ones past n are scratch).
  void list(uint32_t* pos, uint64_t* v) const;
  // The same as positions start + p, from the flagged rows when a mode-3 decode listed them (else from the
  // bitmap, as list()); nothing is written past pos[n - 1].
  void list_at(uint64_t start, uint64_t* pos, uint64_t* v) const;
  // The n values, widened to 64 bits, into v.
  void values(uint64_t* v) const;
};

// About the bytes a BlockChanges holds for a block of `span` elements with n changes (BlockChanges::reset and a
// mode-3 decode): what a pooled buffer for it should have, so that it is not grown (fresh pages fault).
inline size_t decoded_bytes(uint64_t span, uint64_t n, const DTypeInfo& dt) {
  const uint64_t words = span / kLanes + 2, wide = dt.bits == 16 ? 2 : 8;
  const uint64_t rows = dt.bits == 16 ? std::min<uint64_t>(n, (span + kLanes - 1) / kLanes) : 0;
  return size_t(2 * words + (1 + wide) * (n + 64) + (rows ? 4 * (rows + 32) + 2 * kLanes * (rows + 18) : 0));
}

// Accumulates one block's changes and writes its format-2 payload.
class V2BlockEncoder {
 public:
  // CPU, 16-bit dtypes: scans old/new of a block (classes from the old words; SIMD) and keeps its changes.
  // Sets the checksum terms of the old words (*sum_old) and their change to the new ones (*adj).
  void scan16(const uint16_t* old, const uint16_t* nw, uint64_t span, uint64_t first_word, const DTypeInfo& dt,
              uint64_t* sum_old, uint64_t* adj);
  // Any dtype: changes added as block-relative positions (ascending) and values; classes come at finish().
  void reset(uint64_t span, const DTypeInfo& dt);
  void add(const uint32_t* pos, const uint64_t* v, size_t n);
  uint64_t count() const { return n_; }
  // Appends the payload (count() >= 1) to `out`. Mode 1 takes the classes from `cs` and e_top from the old
  // elements (cs.old, chosen here) or from `e_top`.
  void finish(std::vector<uint8_t>& out, const DTypeInfo& dt, const ClassSource& cs, int e_top);

 private:
  void finish_context(std::vector<uint8_t>& out, const DTypeInfo& dt, const ClassSource& cs);
  BlockChanges ch_;
  PodBuffer<uint32_t> pos_;
  PodBuffer<uint64_t> v_;
  PodBuffer<uint8_t> all_cls_, words_, signs_, ctx_;
  PodBuffer<uint16_t> row_words_;  // a 16-bit scan's copies of the rows with a change
  ScanExtras ex_;
  std::vector<uint8_t> mant_;
  uint64_t n_ = 0, span_ = 0;
  bool scanned_ = false;  // scan16 filled ch_ (else pos_/v_ hold the changes)
  int e_top_ = 0;
};

V2BlockEncoder& thread_v2_encoder();

// Decodes one format-2 payload (mode 0, 1 or 2), validating everything (DeltaError names the block).
class V2BlockDecoder {
 public:
  // Parses the payload's parameters; decode() then needs the classes of the old elements.
  void parse(const uint8_t* payload, size_t len, uint32_t n, uint64_t span, const DTypeInfo& dt, size_t block);
  bool context() const { return mode_ != kModeOrder0; }
  // Decodes into `out` (for mode 0, cs is not used). Reads the old elements only.
  void decode(const ClassSource& cs, BlockChanges& out);

 private:
  void decode_values(BlockChanges& out);
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
  uint32_t pa_[kClasses] = {};  // mode 3: the row contexts' flag probabilities
  ValueTrees trees_{};
  const uint8_t* streams_[2 * kMaxGroups] = {};
  size_t stream_len_[2 * kMaxGroups] = {};
  const uint8_t* mant_ = nullptr;
  size_t mant_len_ = 0;
  const uint8_t* signs_ = nullptr;
};

// Applies (forward) or undoes a block's decoded changes at `target` (the block's first element) in place;
// returns the checksum change of the words written (words indexed from first_word). `with_old_sum` lets it
// use ch.old_sum (when ch.has_old_sum) to sum every new word instead of two terms per changed word, where
// that is cheaper.
uint64_t apply_changes(uint8_t* target, const BlockChanges& ch, const DTypeInfo& dt, uint64_t first_word,
                       bool forward, bool with_old_sum = false);

}  // namespace syncd
