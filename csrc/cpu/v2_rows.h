// Format 2's mode-3 positions, coded by row flags (spec: syncd/ops/reference/rows.py): the chain probabilities,
// the portable kernels over any source of classes, and the kernels' entry points for 16-bit dtypes (dispatched in
// v2_kernels.cpp to v2_rows_avx2.h / v2_rows_avx512.h, which write and read the same bytes). Torch-free.
//
// Row t is elements 16t .. 16t + 15 of a block; its context is its largest class. A flag per row (probability
// pa[context], 0: not listed, not coded) says whether it changed; super-row u (rows 16u .. 16u + 15) codes its
// rows' flags as one row of 16 lanes, followed by its flagged rows in order; these steps go to the position groups
// in turn (step s to group s % gp). A flagged row codes its lanes with their classes' probabilities p, except that
// lanes up to its first change use their chain probabilities q.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "binary_rans.h"
#include "block_coder.h"
#include "v2_kernels.h"

namespace syncd {

// Encoders write a context block in mode 3 when at most 1 / kRowFlagsDensity of its elements change.
constexpr uint64_t kRowFlagsDensity = 32;
// 2^18 / m for the leading 4 bits m of a suffix sum (index 0 unused)
constexpr uint32_t kChainReciprocal[16] = {0,     262144, 131072, 87381, 65536, 52428, 43690, 37449,
                                           32768, 29127,  26214,  23831, 21845, 20164, 18724, 17476};

// The chain probability of a lane with probability p whose suffix sum (p and the lanes above it) is s: about
// p 2^16 / s from the leading 4 bits of s, clamped to p .. 65535 (0 for p = 0; p for s >= 2^16).
inline uint32_t chain_probability(uint32_t p, uint32_t s) {
  const int e = s ? std::max(0, 28 - __builtin_clz(s)) : 0;
  const uint32_t q = (p * kChainReciprocal[s >> e]) >> (e + 2);  // below 2^31: s >> e >= 8 when e > 0
  return std::min(kBinOne - 1, std::max(p, q));
}

// A flagged row's probabilities: pr[l] = q_l for the lanes up to `first` (the lowest lane that decodes or
// encodes 1), p_l above; lanes not coded (p_l = 0) stay 0.
inline void chain_row(const uint32_t* p, int first, uint32_t* pr) {
  uint32_t s = 0;
  for (int l = kLanes - 1; l >= 0; --l) {
    s += p[l];
    pr[l] = l <= first ? chain_probability(p[l], s) : p[l];
  }
}

// The lowest coded lane of a flagged row that decodes 1 with its chain probability (16: none, a corrupt stream);
// a lane's bit depends only on its own state, so this is what stepping the lanes in order would find.
inline int chain_first(const uint32_t* x, const uint32_t* p) {
  uint32_t s = 0, q[kLanes];
  for (int l = kLanes - 1; l >= 0; --l) {
    s += p[l];
    q[l] = chain_probability(p[l], s);
  }
  for (int l = 0; l < kLanes; ++l)
    if ((x[l] & 0xFFFF) < q[l]) return l;
  return kLanes;
}

// The flag probability of each row context from its rows (rows[c]) and changed rows (hit[c]): 0 for a context
// without a changed row, else round(2^16 hit / rows) clamped to 1..65535.
inline void flag_probabilities(const uint64_t rows[16], const uint64_t hit[16], uint32_t pa[16]) {
  for (int c = 0; c < 16; ++c) {
    const uint64_t q = hit[c] ? ((hit[c] << 17) + rows[c]) / (2 * rows[c]) : 0;
    pa[c] = hit[c] ? uint32_t(std::min<uint64_t>(kBinOne - 1, std::max<uint64_t>(1, q))) : 0;
  }
}

// A flagged row must have a change: more flagged rows than changes, or a flagged row without one, is corrupt.
inline void check_flagged(size_t flagged, size_t n_max, const std::string& what) {
  if (flagged > n_max)
    throw DeltaError(what + ": " + std::to_string(flagged) + " rows flagged, more than the " + std::to_string(n_max) +
                     " changes");
}
[[noreturn]] inline void flagged_row_without_change(uint64_t t, const std::string& what) {
  throw DeltaError(what + ": flagged row " + std::to_string(t) + " has no change");
}

// ---- portable kernels over `classes(t, cls)`: fills cls[0..16) with row t's classes (0 past its live lanes)
// and returns its live lanes

// A flagged row's lanes: cls[l] its classes, p[l] = p1 of lane l's class (0 past the live lanes); returns the
// coded lanes' mask.
template <class RowClasses>
inline uint32_t lane_probabilities(RowClasses& classes, uint64_t t, const uint32_t* p1, uint8_t* cls, uint32_t* p) {
  const int live = classes(t, cls);
  uint32_t coded = 0;
  for (int l = 0; l < kLanes; ++l) {
    p[l] = l < live ? p1[cls[l]] : 0;
    coded |= uint32_t(p[l] != 0) << l;
  }
  return coded;
}

template <class RowClasses>
void row_contexts_scalar(RowClasses&& classes, uint64_t span, uint8_t* ctx) {
  for (uint64_t t = 0; t * kLanes < span; ++t) {
    uint8_t cls[kLanes];
    classes(t, cls);
    ctx[t] = *std::max_element(cls, cls + kLanes);
  }
}

template <class RowClasses>
void encode_rows_scalar(RowClasses&& classes, uint64_t span, const uint32_t* p1, const uint16_t* bitmap,
                        const uint8_t* ctx, const uint32_t* pa, BinGroupEncoder* enc, int gp) {
  const uint64_t rows = (span + kLanes - 1) / kLanes, supers = (rows + kLanes - 1) / kLanes;
  uint64_t step = supers;  // steps: a flag row per super-row and each flagged row
  for (uint64_t t = 0; t < rows; ++t) step += bitmap[t] != 0;
  for (uint64_t u = supers; u-- > 0;) {  // backwards: a super-row's flagged rows, last first, then its flag row
    uint32_t pr[kLanes] = {}, coded = 0, flags = 0;
    for (int i = 0; i < kLanes && u * kLanes + i < rows; ++i) {
      const uint64_t t = u * kLanes + i;
      pr[i] = pa[ctx[t]];
      coded |= uint32_t(pr[i] != 0) << i;
      flags |= uint32_t(bitmap[t] != 0) << i;
    }
    for (uint32_t f = flags; f; f &= ~(0x80000000u >> __builtin_clz(f))) {
      const uint64_t t = u * kLanes + 31 - __builtin_clz(f);
      const uint32_t bits = bitmap[t];
      uint8_t cls[kLanes];
      uint32_t p[kLanes], q[kLanes];
      const uint32_t rc = lane_probabilities(classes, t, p1, cls, p);
      chain_row(p, __builtin_ctz(bits), q);
      enc[--step % uint64_t(gp)].put_row(rc, q, bits & rc);
    }
    if (coded) enc[(step - 1) % uint64_t(gp)].put_row(coded, pr, flags & coded);
    --step;
  }
}

// Decodes into bitmap (zeroed by the caller) and cls_ch (each change's class, position order); returns the
// changes found. `flagged` (room for min(rows, n_max) + 32 entries) receives the flagged rows, their count
// *nflagged when given.
template <class RowClasses>
size_t decode_rows_scalar(RowClasses&& classes, uint64_t span, const uint32_t* p1, const uint32_t* pa,
                          BinGroupDecoder* dec, int gp, uint16_t* bitmap, uint8_t* cls_ch, size_t n_max,
                          const std::string& what, uint32_t* flagged, size_t* nflagged) {
  const uint64_t rows = (span + kLanes - 1) / kLanes, supers = (rows + kLanes - 1) / kLanes;
  size_t nf = 0, k = 0;
  uint64_t step = 0;
  for (uint64_t u = 0; u < supers; ++u) {
    uint32_t pr[kLanes] = {}, coded = 0;
    for (int i = 0; i < kLanes && u * kLanes + i < rows; ++i) {
      uint8_t cls[kLanes];
      classes(u * kLanes + i, cls);
      pr[i] = pa[*std::max_element(cls, cls + kLanes)];
      coded |= uint32_t(pr[i] != 0) << i;
    }
    const uint32_t f = coded ? dec[step % uint64_t(gp)].row(coded, pr) : 0;
    ++step;
    nf += size_t(__builtin_popcount(f));
    check_flagged(nf, n_max, what);
    for (uint32_t m = f; m; m &= m - 1) {
      const uint64_t t = u * kLanes + __builtin_ctz(m);
      uint8_t cls[kLanes];
      uint32_t p[kLanes], q[kLanes];
      const uint32_t rc = lane_probabilities(classes, t, p1, cls, p);
      BinGroupDecoder& d = dec[step++ % uint64_t(gp)];
      chain_row(p, chain_first(d.x, p), q);
      uint32_t bits = d.row(rc, q);
      if (!bits) flagged_row_without_change(t, what);
      flagged[nf - size_t(__builtin_popcount(m))] = uint32_t(t);
      bitmap[t] = uint16_t(bits);
      if (size_t(__builtin_popcount(bits)) > n_max - k) throw DeltaError(what + ": more changes than the block table says");
      for (; bits; bits &= bits - 1) cls_ch[k++] = cls[__builtin_ctz(bits)];
    }
  }
  if (nflagged) *nflagged = nf;
  return k;
}

// ---- 16-bit dtypes (classes from the old words or from nibbles, as Classes16 says; c.p1 the class probabilities)

// The context of every row of a block (ctx: one byte per row, room for 64 more).
void row_contexts16(const Classes16& c, uint8_t* ctx, Simd s);
// Encodes a mode-3 block's position streams backwards into enc[0..gp) (ctx: row_contexts16's; words: null, or the
// old words of each row with a change, as a scan's extras hold them).
void encode_rows16(const Classes16& c, const uint16_t* bitmap, const uint8_t* ctx, const uint32_t* pa,
                   const uint16_t* words, BinGroupEncoder* enc, int gp, Simd s);
// The flagged rows a mode-3 decoder found: their indices in order (room for min(rows, n_max) + 32) and, when
// `words` is given (room for min(rows, n_max) + 18 rows), a copy of each one's 16 old words (zero past the end).
struct FlaggedRows {
  uint32_t* rows;
  uint16_t* words;
  size_t n;
};

// Decodes a mode-3 block's position streams into bitmap (zeroed by the caller) and cls_ch (n_max + 64 bytes);
// returns the changes found; sets *old_sum as decode_positions16 does, and *fr. Throws DeltaError naming `what`.
size_t decode_rows16(const Classes16& c, const uint32_t* pa, BinGroupDecoder* dec, int gp, uint16_t* bitmap,
                     uint8_t* cls_ch, size_t n_max, const std::string& what, uint64_t first_word, uint64_t* old_sum,
                     FlaggedRows* fr, Simd s);

// Applies (forward) or undoes a mode-3 block's changes in place from its flagged rows (rows[0..n), their old
// words, bitmap entries and values v16 in order, readable 32 entries past the last change); returns the checksum
// change of the words written (words indexed from first_word). Undo writes the old words back.
uint64_t apply_rows16(uint16_t* target, uint64_t first_word, const uint32_t* rows, const uint16_t* words, uint64_t n,
                      const uint16_t* bitmap, const uint16_t* v16, bool is_float, bool forward, Simd s);

// Per row context, the rows of a block (rows[c]) and those with a change (hit[c]), from the contexts and bitmap.
void context_counts16(const uint8_t* ctx, const uint16_t* bitmap, uint64_t nrows, uint64_t rows[16], uint64_t hit[16],
                      Simd s);
inline void context_counts_scalar(const uint8_t* ctx, const uint16_t* bitmap, uint64_t from, uint64_t nrows,
                                  uint64_t rows[16], uint64_t hit[16]) {
  for (uint64_t t = from; t < nrows; ++t) {
    rows[ctx[t] & 15]++;
    hit[ctx[t] & 15] += bitmap[t] != 0;
  }
}

// A thread's scratch list of flagged rows (a decoder's), room for `rows` + 16.
uint32_t* flagged_rows_scratch(uint64_t rows);

}  // namespace syncd
