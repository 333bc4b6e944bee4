// Entropy coding of a block's changes (spec: syncd/ops/reference/entropy.py): symbol bucketing, frequency
// tables, two interleaved 32-bit rANS states with byte renormalisation, and an LSB-first raw-bits stream.
// Every read from untrusted bytes is bounds-checked and throws DeltaError.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace syncd {

struct DeltaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr int kProbBits = 14;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr uint32_t kRansL = 1u << 23;
constexpr int kAlphabet = 256;
constexpr uint64_t kDirect = 16;

struct Bucketed {
  uint32_t sym;
  uint32_t nbits;
  uint64_t extra;
};

inline Bucketed bucket(uint64_t v) {
  if (v < kDirect) return {static_cast<uint32_t>(v), 0, 0};
  uint32_t nb = 64 - __builtin_clzll(v);
  uint32_t extra_n = nb - 3;
  uint32_t top2 = static_cast<uint32_t>((v >> extra_n) & 3);
  return {static_cast<uint32_t>(kDirect) + 4 * (nb - 5) + top2, extra_n, v & ((uint64_t(1) << extra_n) - 1)};
}

// Base value and extra-bit count of a symbol (inverse of bucket).
inline void unbucket(uint32_t sym, uint64_t* base, uint32_t* extra_n) {
  if (sym < kDirect) {
    *base = sym;
    *extra_n = 0;
    return;
  }
  uint32_t nb = (sym - kDirect) / 4 + 5, top2 = (sym - kDirect) % 4;
  *extra_n = nb - 3;
  *base = uint64_t(4 | top2) << *extra_n;
}

// Deterministic normalisation shared by every backend (see the reference's docstring).
inline void normalize(const uint64_t* counts, uint32_t* freqs) {
  uint64_t total = 0;
  for (int s = 0; s < kAlphabet; ++s) total += counts[s];
  int64_t sum = 0;
  for (int s = 0; s < kAlphabet; ++s) {
    uint64_t f = counts[s] ? (counts[s] * kProbScale) / total : 0;  // counts < 2^40, no overflow
    if (counts[s] && f == 0) f = 1;
    freqs[s] = static_cast<uint32_t>(f);
    sum += f;
  }
  int64_t excess = sum - kProbScale;
  while (excess > 0) {
    int best = -1;
    for (int s = 0; s < kAlphabet; ++s)
      if (freqs[s] > 1 && (best < 0 || freqs[s] > freqs[best])) best = s;
    freqs[best] -= 1;
    --excess;
  }
  if (excess < 0) {
    int best = 0;
    for (int s = 1; s < kAlphabet; ++s)
      if (counts[s] > counts[best]) best = s;
    freqs[best] += static_cast<uint32_t>(-excess);
  }
}

inline void write_varint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

inline void write_table(std::vector<uint8_t>& out, const uint32_t* freqs) {
  int span = 0;
  for (int s = 0; s < kAlphabet; ++s)
    if (freqs[s]) span = s + 1;
  out.push_back(static_cast<uint8_t>(span - 1));
  size_t at = out.size();
  out.resize(at + (span + 7) / 8, 0);
  for (int s = 0; s < span; ++s)
    if (freqs[s]) out[at + (s >> 3)] |= uint8_t(1u << (s & 7));
  for (int s = 0; s < span; ++s)
    if (freqs[s]) write_varint(out, freqs[s]);
}

// Bounds-checked cursor over untrusted bytes.
class ByteReader {
 public:
  ByteReader(const uint8_t* p, size_t n, const std::string& what) : p_(p), n_(n), what_(what) {}
  const uint8_t* take(size_t k) {
    if (k > n_ - pos_) fail("truncated (needs " + std::to_string(k) + " bytes at offset " + std::to_string(pos_) + ")");
    const uint8_t* r = p_ + pos_;
    pos_ += k;
    return r;
  }
  uint8_t u8() { return *take(1); }
  uint32_t u32() {
    const uint8_t* b = take(4);
    return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift <= 28; shift += 7) {
      uint8_t b = u8();
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail("varint too long");
  }
  size_t pos() const { return pos_; }
  size_t size() const { return n_; }
  const uint8_t* data() const { return p_; }
  [[noreturn]] void fail(const std::string& msg) const { throw DeltaError(what_ + ": " + msg); }

 private:
  const uint8_t* p_;
  size_t n_, pos_ = 0;
  std::string what_;
};

inline void read_table(ByteReader& r, uint32_t* freqs) {
  int span = int(r.u8()) + 1;
  const uint8_t* bitmap = r.take((span + 7) / 8);
  uint32_t sum = 0;
  for (int s = 0; s < kAlphabet; ++s) freqs[s] = 0;
  for (int s = 0; s < span; ++s) {
    if (!(bitmap[s >> 3] >> (s & 7) & 1)) continue;
    uint64_t f = r.varint();
    if (f == 0 || f > kProbScale) r.fail("frequency " + std::to_string(f) + " of symbol " + std::to_string(s) + " out of range");
    freqs[s] = static_cast<uint32_t>(f);
    sum += static_cast<uint32_t>(f);
  }
  if ((span % 8) && (bitmap[(span - 1) >> 3] >> (span % 8))) r.fail("frequency table bitmap has bits past its span");
  if (!freqs[span - 1]) r.fail("frequency table span ends on an absent symbol");
  if (sum != kProbScale) r.fail("frequencies sum to " + std::to_string(sum) + ", expected " + std::to_string(kProbScale));
}

// Decoding tables of one model: slot -> symbol, and per symbol its frequency (low 16 bits) and cumulative
// frequency (high 16 bits) in one word.
struct DecodeModel {
  uint32_t freq_cum[kAlphabet];
  uint8_t lut[kProbScale];
  void build(const uint32_t* f) {
    uint32_t c = 0;
    for (int s = 0; s < kAlphabet; ++s) {
      freq_cum[s] = f[s] | c << 16;
      if (f[s]) std::memset(lut + c, s, f[s]);
      c += f[s];
    }
  }
};

// One symbol's encoding constants, packed into 16 bytes. Division by the frequency is replaced by a multiply
// with a rounded-up reciprocal and a shift (exact for 32-bit states below 2^31, as in Giesen's rans_byte).
struct EncodeSymbol {
  uint32_t x_max, rcp_freq, bias;
  uint16_t cmpl_freq;
  uint8_t rcp_shift, pad;
};

inline void build_encode_table(const uint32_t* f, EncodeSymbol* t) {
  uint32_t c = 0;
  for (int s = 0; s < kAlphabet; ++s) {
    uint32_t freq = f[s];
    EncodeSymbol& e = t[s];
    e.x_max = ((kRansL >> kProbBits) << 8) * freq;
    e.cmpl_freq = static_cast<uint16_t>(kProbScale - freq);
    e.pad = 0;
    if (freq < 2) {
      e.rcp_freq = ~0u;
      e.rcp_shift = 0;
      e.bias = c + kProbScale - 1;
    } else {
      uint32_t shift = 0;
      while (freq > (1u << shift)) ++shift;
      e.rcp_freq = static_cast<uint32_t>(((uint64_t(1) << (shift + 31)) + freq - 1) / freq);
      e.rcp_shift = static_cast<uint8_t>(shift - 1);
      e.bias = c;
    }
    c += freq;
  }
}

// Encodes one symbol into state x, writing renormalisation bytes backwards at *--w.
inline void rans_put(uint32_t& x, const EncodeSymbol& e, uint8_t*& w) {
  uint32_t xs = x;
  while (xs >= e.x_max) {
    *--w = static_cast<uint8_t>(xs);
    xs >>= 8;
  }
  uint32_t q = static_cast<uint32_t>((uint64_t(xs) * e.rcp_freq) >> 32) >> e.rcp_shift;
  x = xs + e.bias + q * e.cmpl_freq;
}

// LSB-first bit reader over untrusted bytes; reading past the end throws via `owner`.
class BitReader {
 public:
  BitReader(const uint8_t* p, size_t n, const ByteReader& owner) : p_(p), n_(n), owner_(&owner) {}
  uint64_t read(uint32_t n) {  // n <= 61
    if (n > 32) {
      uint64_t lo = read(32);
      return lo | (read(n - 32) << 32);
    }
    if (fill_ < n) refill(n);
    uint64_t v = acc_ & ((uint64_t(1) << n) - 1);
    acc_ = n == 64 ? 0 : acc_ >> n;
    fill_ -= n;
    return v;
  }
  void finish() const {
    if (pos_ != n_ || fill_ >= 8 || acc_ != 0) owner_->fail("raw-bits stream has unused bits");
  }

  // For an unchecked inner loop that keeps the reader in registers: bytes left to refill from, and the
  // state to copy out and back (see BlockDecoder::next_batch).
  size_t bytes_left() const { return n_ - pos_; }
  struct Cursor {
    const uint8_t* p;
    size_t pos;
    uint64_t acc;
    uint32_t fill;
    // Leaves 56..63 bits in acc; needs 8 readable bytes at p + pos.
    void refill_unchecked() {
      uint64_t w;
      std::memcpy(&w, p + pos, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
      w = __builtin_bswap64(w);
#endif
      acc |= w << fill;
      pos += (63 - fill) >> 3;
      fill |= 56;
    }
    uint64_t take(uint32_t n) {  // n <= fill, n < 64
      uint64_t v = acc & ((uint64_t(1) << n) - 1);
      acc >>= n;
      fill -= n;
      return v;
    }
  };
  Cursor cursor() const { return {p_, pos_, acc_, fill_}; }
  void set_cursor(const Cursor& c) {
    pos_ = c.pos;
    acc_ = c.acc;
    fill_ = c.fill;
  }

 private:
  void refill(uint32_t n) {
    if (n_ - pos_ >= 8) {  // whole-word refill: up to 7 bytes, leaving 56..63 bits
      Cursor c = cursor();
      c.refill_unchecked();
      set_cursor(c);
      return;
    }
    while (fill_ <= 56 && pos_ < n_) {
      acc_ |= uint64_t(p_[pos_++]) << fill_;
      fill_ += 8;
    }
    if (fill_ < n) owner_->fail("raw-bits stream truncated");
  }
  const uint8_t* p_;
  size_t n_, pos_ = 0;
  uint64_t acc_ = 0;
  uint32_t fill_ = 0;
  const ByteReader* owner_;
};

}  // namespace syncd
