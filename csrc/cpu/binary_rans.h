// Format 2's binary rANS (spec: syncd/ops/reference/binary_rans.py): groups of 16 interleaved 32-bit states
// coding yes/no decisions, each lane with its own probability p1 (1..65535 in 1/2^16), 16-bit
// renormalisation words, one word stream per group. These are the portable scalar steps; the SIMD kernels
// (binary_rans_simd.cpp) step the same states 16 lanes at a time and must give the same words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "entropy.h"

namespace syncd {

constexpr uint32_t kBinL = 1u << 16;
constexpr uint32_t kBinOne = 1u << 16;
constexpr int kLanes = 16;
constexpr int kMaxGroups = 8;

inline uint16_t load_le16(const uint8_t* p) { return uint16_t(p[0] | p[1] << 8); }
inline uint32_t load_le32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// Encoder of one group: rows are put in reverse decode order; words are written backwards from `top` (the
// buffer must hold every word: at most one per coded lane per row). finish() writes the 16 final states in
// front of the words and returns the stream's first byte.
struct BinGroupEncoder {
  uint32_t x[kLanes];
  uint8_t* w;  // next word goes at w - 2
  explicit BinGroupEncoder(uint8_t* top = nullptr) : w(top) {
    for (int l = 0; l < kLanes; ++l) x[l] = kBinL;
  }
  // Lanes in `coded` encode bit (bits >> l & 1) with probability p1[l] of a one.
  void put_row(uint32_t coded, const uint32_t* p1, uint32_t bits) {
    // the decoder reads a row's words in lane order, so they are written from the highest lane down
    for (int l = kLanes - 1; l >= 0; --l) {
      if (!(coded >> l & 1)) continue;
      const bool one = bits >> l & 1;
      const uint32_t f = one ? p1[l] : kBinOne - p1[l], c = one ? 0 : p1[l];
      uint32_t xs = x[l];
      if (xs >= (f << 16)) {
        w -= 2;
        w[0] = uint8_t(xs);
        w[1] = uint8_t(xs >> 8);
        xs >>= 16;
      }
      x[l] = ((xs / f) << 16) + xs % f + c;
    }
  }
  uint8_t* finish() {
    w -= 4 * kLanes;
    for (int l = 0; l < kLanes; ++l)
      for (int b = 0; b < 4; ++b) w[4 * l + b] = uint8_t(x[l] >> (8 * b));
    return w;
  }
};

// Decoder of one group stream of untrusted bytes; every failure throws DeltaError naming `what`.
struct BinGroupDecoder {
  uint32_t x[kLanes];
  const uint8_t* p;    // next word
  const uint8_t* end;  // one past the last word
  std::string what;

  void init(const uint8_t* data, size_t n, const std::string& name) {
    what = name;
    if (n < 4 * kLanes || (n - 4 * kLanes) % 2)
      throw DeltaError(what + ": binary stream of " + std::to_string(n) + " bytes is not 64 bytes of states plus words");
    for (int l = 0; l < kLanes; ++l) {
      x[l] = load_le32(data + 4 * l);
      if (x[l] < kBinL) throw DeltaError(what + ": binary stream has an initial state below 2**16");
    }
    p = data + 4 * kLanes;
    end = data + n;
  }
  // Decodes the lanes in `coded` (probabilities p1[l]); returns their bits.
  uint32_t row(uint32_t coded, const uint32_t* p1) {
    uint32_t bits = 0;
    for (int l = 0; l < kLanes; ++l) {
      if (!(coded >> l & 1)) continue;
      const uint32_t xs = x[l], slot = xs & 0xFFFF, q = p1[l];
      uint32_t y;
      if (slot < q) {
        bits |= 1u << l;
        y = q * (xs >> 16) + slot;
      } else {
        y = (kBinOne - q) * (xs >> 16) + slot - q;
      }
      if (y < kBinL) {
        if (p == end) throw DeltaError(what + ": binary stream truncated");
        y = (y << 16) | load_le16(p);
        p += 2;
      }
      x[l] = y;
    }
    return bits;
  }
  void finish() const {
    for (int l = 0; l < kLanes; ++l)
      if (x[l] != kBinL) throw DeltaError(what + ": binary stream corrupt (final state check failed)");
    if (p != end) throw DeltaError(what + ": binary stream corrupt (final state check failed)");
  }
};

}  // namespace syncd
