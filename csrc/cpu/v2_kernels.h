// The hot loops of format 2's context blocks for 16-bit dtypes (bf16, fp16, int16), whose classes come from
// the old words: the encoder's scan, the position rows (one yes/no decision per element, with its class's
// probability) encoded backwards and decoded forwards, and the in-place apply. Each has a portable scalar
// version (v2_kernels.cpp), an AVX2 one (v2_kernels_avx2.cpp) and an AVX-512 one (v2_kernels_avx512.cpp),
// chosen at run time; every version writes and reads the same bytes (the tests run all three).
//
// A block's change bitmap holds one u16 per vector of 16 elements (bit l: element 16t + l changed), with
// room for one more u16 of slack; per-change arrays are in position order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include <vector>

#include "binary_rans.h"
#include "prefetch.h"

namespace syncd {

enum class Simd : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// What this CPU can run, capped by SYNCD_SIMD=scalar|avx2|avx512 (read once).
Simd simd_level();
const char* simd_name(Simd s);

// How the 16-bit position kernels find a class: clamp(e_top - ((w >> shift) & emask), 0, 15) of old word w.
struct Classes16 {
  const uint16_t* old;  // the block's old elements
  uint64_t span;        // elements in the block
  int shift;
  uint32_t emask;       // 0 for integer dtypes (every class 0)
  int e_top;
  const uint32_t* p1;   // the 16 classes' probabilities; 0: the class is not coded
  // the position kernels only: the classes computed elsewhere (a GPU), two per byte, element 0 in the low
  // nibble of byte 0; then `old` is not read (and decode_positions16 leaves *old_sum alone)
  const uint8_t* nibbles = nullptr;
};

// Decodes the position rows of a block (vector t with group t % gp): writes the bitmap and each change's
// class (cls_ch needs n_max + 64 bytes); returns the changes found. Also sets *old_sum to the checksum terms
// of the block's old words (indexed from first_word; a partial last word is zero-padded). Throws DeltaError
// (naming `what`) when a stream is short or there are more than n_max changes.
size_t decode_positions16(const Classes16& c, BinGroupDecoder* dec, int gp, uint16_t* bitmap, uint8_t* cls_ch,
                          size_t n_max, const std::string& what, uint64_t first_word, uint64_t* old_sum, Simd s);

// The encoder's statistics sample of a block (elements i with i % 16384 < 1024): the largest exponent field
// that is not all ones (-1 if none), and the class counts (with c.e_top).
int sample_max_exponent16(const Classes16& c, Simd s);
void sample_class_counts16(const Classes16& c, uint64_t counts[16], Simd s);

// Encodes the position rows of a block backwards into enc[0..gp) from its bitmap.
void encode_positions16(const Classes16& c, const uint16_t* bitmap, BinGroupEncoder* enc, int gp, Simd s);

// What a scan may also collect while the old words pass through: the class counts of the encoder's sample
// (counts_done), and, for mode 3, each row's context (ctx: a byte per row) and a copy of the 16 old words of each row
// with a change, in order (words: room for every row and 2 more; zero past the block's end) (rows_done). A kernel
// may leave either to the caller (the flags stay false).
struct ScanExtras {
  uint8_t* ctx = nullptr;
  uint16_t* words = nullptr;
  uint64_t counts[16] = {};
  bool counts_done = false, rows_done = false;
};

// The encoder's scan of a 16-bit block: the bitmap, each change's value v (zigzag of the key delta, minus one)
// and class (v16, cls_ch: room for span + 64 entries), and the checksum terms of the old words (*sum_old) and
// their change to the new ones (*adj); words are indexed from first_word, the block's last word may be
// partial (zero-padded). With `ex`, also its extras. Returns the number of changes.
uint64_t scan16(const Classes16& c, const uint16_t* nw, uint64_t first_word, bool is_float, uint16_t* bitmap,
                uint16_t* v16, uint8_t* cls_ch, uint64_t* sum_old, uint64_t* adj, ScanExtras* ex, Simd s);

// Applies (forward) or undoes the n changes of a 16-bit block in place: target[16t + l] for each bitmap bit,
// values v16 in order (readable 16 entries past the last change). Returns the checksum change of the words it
// wrote (new minus old terms). Given old_sum (the terms of every old word, as decode_positions16 gives them), it
// sums the terms of every new word instead of two terms per changed word where most words change (above a
// density measured per kernel: the AVX-512 sparse pass stays cheaper up to 1/8, the AVX2 one to 1/16).
uint64_t apply16(uint16_t* target, uint64_t span, uint64_t first_word, const uint16_t* bitmap, const uint16_t* v16,
                 uint64_t n, bool is_float, bool forward, const uint64_t* old_sum, Simd s);

// ---- values: every change's v = 2m + low; the changes J of classes with a value tree (in J's order, JBuckets)
// code the bit length nb of m by its binary digits, most significant first (row r of 16 consecutive J entries:
// digit r of each lane whose tree has more than r levels; group g of each step of 16 * gv), each with its tree
// node's probability, and the bits below m's leading one raw (`mant`, in J order); the low bits are the sign
// bytes.

// The value trees of a context block as the kernels read them.
struct ValueTrees {
  int depth[16];           // levels of each class's tree (0: its changes all have nb = 0)
  uint32_t node[16][128];  // node probabilities, heap order from node 1; the leaves' entries are unused
  bool by_depth;           // J's order: mode 2 (by tree depth, then position) or mode 1 (position)
};

// J's order as buckets: J takes bucket 1's changes in position order, then bucket 2's, ... up to `count`.
// Mode 1 has one bucket (every class with a tree); mode 2 one per tree depth, fewest levels first.
struct JBuckets {
  int count = 0;
  uint8_t of_class[16] = {};  // each class's bucket, 0 for a class without a tree (not in J)
  explicit JBuckets(const ValueTrees& lv) {
    for (int c = 0; c < 16; ++c) {
      of_class[c] = uint8_t(lv.depth[c] ? (lv.by_depth ? lv.depth[c] : 1) : 0);
      count = std::max(count, int(of_class[c]));
    }
  }
};

// Per class its number of changes, and how many of them have each bit length of m (hist[c][nb]).
template <class V>
void value_stats(const uint8_t* cls, const V* v, size_t n, uint64_t changed[16], uint64_t hist[16][65], Simd s);

// Encodes the value rows of the n changes backwards into venc[0..gv), and writes their mantissa bits
// (appended to `mant`) and sign bytes (ceil(n / 8) at `signs`).
template <class V>
void encode_values(const uint8_t* cls, const V* v, size_t n, const ValueTrees& lv, BinGroupEncoder* venc, int gv,
                   std::vector<uint8_t>& mant, uint8_t* signs, Simd s);

// Decodes the values of n changes (classes cls) into v, validating everything: gv against the changes with
// a value tree, the values against vmax, the mantissa bits (mant_len bytes at mant) used exactly. The
// caller checks the value groups' final states. Throws DeltaError naming `what`.
template <class V>
void decode_values(const uint8_t* cls, size_t n, const uint8_t* signs, const ValueTrees& lv, BinGroupDecoder* vdec,
                   int gv, const uint8_t* mant, size_t mant_len, uint64_t vmax, V* v, const std::string& what, Simd s);

// LSB-first bit writer into a buffer the caller sized for every bit plus 8 bytes (one 8-byte store per put).
struct RawBits {
  uint8_t* p;
  uint64_t acc = 0;
  uint32_t fill = 0;  // < 8 between puts
  void put(uint64_t bits, uint32_t len) {  // len <= 56, bits < 2^len
    acc |= bits << fill;
    fill += len;
    std::memcpy(p, &acc, 8);
    p += fill >> 3;
    acc >>= fill & ~7u;
    fill &= 7;
  }
  uint8_t* end() const { return p + (fill ? 1 : 0); }  // the partial byte was stored by the last put
};

// How many mantissa bits a value m < 2^16 has: those below its leading one (none for m < 2).
inline uint32_t mantissa_len16(uint32_t m) { return 31 - uint32_t(__builtin_clz(m | 1)); }

// Appends the mantissa bits of n values m_at(t) < 2^16, LSB first, to `out`, without a branch per value
// (whether a change has mantissa bits is not predictable).
template <class M>
inline void append_mantissa16(size_t n, M&& m_at, std::vector<uint8_t>& out) {
  const size_t at0 = out.size();
  out.resize(at0 + 2 * n + 8);
  RawBits w{out.data() + at0};
  for (size_t t = 0; t < n; ++t) {
    const uint32_t m = m_at(t), len = mantissa_len16(m);
    w.put(m & ((1u << len) - 1), len);
  }
  out.resize(size_t(w.end() - out.data()));
}

// Throws unless there are value groups exactly when some change has a value tree.
void check_value_groups(int gv, size_t nj, const std::string& what);

// The versions behind the dispatch (tests reach them through SYNCD_SIMD).
namespace scalar16 {
int sample_max_exponent(const Classes16& c, uint64_t from);
void sample_class_counts(const Classes16& c, uint64_t counts[16], uint64_t from);
// Checksum terms of the words of a 16-bit block from element `from` (a multiple of 4) to its end.
uint64_t checksum(const uint16_t* p, uint64_t span, uint64_t first_word, uint64_t from);
size_t decode_positions(const Classes16& c, BinGroupDecoder* dec, int gp, uint16_t* bitmap, uint8_t* cls_ch,
                        size_t n_max, const std::string& what);
void encode_positions(const Classes16& c, const uint16_t* bitmap, BinGroupEncoder* enc, int gp);
// from: the first element (a multiple of 16) to scan; k: the changes found before it; returns the total.
uint64_t scan(const Classes16& c, const uint16_t* nw, uint64_t first_word, bool is_float, uint16_t* bitmap,
              uint16_t* v16, uint8_t* cls_ch, uint64_t* sum_old, uint64_t* adj, uint64_t from, uint64_t k);
// Row t's classes into cls[0..16) (0 past the block's end); returns its live lanes.
int row_classes(const Classes16& c, uint64_t t, uint8_t* cls);
// from: the first element (a multiple of 16); v16 + k holds its first change's value.
uint64_t apply(uint16_t* target, uint64_t span, uint64_t first_word, const uint16_t* bitmap, const uint16_t* v16,
               bool is_float, bool forward, uint64_t from, uint64_t k);
}  // namespace scalar16

}  // namespace syncd
