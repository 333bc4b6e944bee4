#include "block_coder.h"

#include "codec_core.h"

namespace syncd {

namespace {

struct BucketTable {
  uint64_t base[kAlphabet];
  uint32_t nbits[kAlphabet];
  BucketTable() {
    for (int s = 0; s < kAlphabet; ++s) unbucket(uint32_t(s), &base[s], &nbits[s]);
  }
};
const BucketTable kBuckets;

using core::max_value;

// Symbol and raw-bit count of x (format: x < 16 is its own symbol; otherwise the bit length and the two
// bits below the leading one), without branches.
inline void bucket_fast(uint64_t x, uint32_t* sym, uint32_t* nbits) {
  uint32_t nb = 64 - uint32_t(__builtin_clzll(x | 1));
  uint32_t extra = nb - 3;
  uint32_t big = 4 * nb - 4 + uint32_t((x >> (extra & 63)) & 3);
  bool small = x < kDirect;
  *sym = small ? uint32_t(x) : big;
  *nbits = small ? 0 : extra;
}

inline void store_le64(uint8_t* p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  std::memcpy(p, &v, 8);
}

}  // namespace

BlockEncoder& thread_block_encoder() {
  thread_local BlockEncoder e;
  return e;
}

void BlockEncoder::reset() {
  std::memset(counts_, 0, sizeof counts_);
  prev_ = -1;
  n_ = 0;
  raw_at_ = 0;
  acc_ = 0;
  fill_ = 0;
}

void BlockEncoder::add(const uint32_t* pos, const uint64_t* v, size_t n) {
  if (!n) return;
  // gap raw bits <= 23 (positions < 2^26), value raw bits <= 61: at most 11 bytes per change, plus the
  // 8-byte store past the end
  syms_.reserve(2 * (n_ + n), 2 * n_);
  raw_.reserve(raw_at_ + 11 * n + 16, raw_at_);
  uint8_t* syms = syms_.data() + 2 * n_;
  uint8_t* raw = raw_.data();
  size_t at = raw_at_;
  uint64_t acc = acc_;
  uint32_t fill = fill_;
  int64_t prev = prev_;
  uint32_t(*c)[kAlphabet] = counts_[0];
  uint32_t(*cv)[kAlphabet] = counts_[1];
  unsigned par = unsigned(n_ & 1);
  for (size_t i = 0; i < n; ++i) {
    uint64_t gap = uint64_t(int64_t(pos[i]) - prev - 1);
    prev = pos[i];
    uint32_t gs, gn, vs, vn;
    bucket_fast(gap, &gs, &gn);
    bucket_fast(v[i], &vs, &vn);
    syms[2 * i] = uint8_t(gs);
    syms[2 * i + 1] = uint8_t(vs);
    c[par][gs]++;
    cv[par][vs]++;
    par ^= 1;
    // raw bits, LSB first: the gap's then the value's; flushed after every change (fill < 8 on entry)
    uint64_t gx = gap & ((uint64_t(1) << gn) - 1);
    uint64_t vx = v[i] & ((uint64_t(1) << vn) - 1);
    acc |= gx << fill;
    fill += gn;
    if (vn > 32) {  // 64-bit dtypes only: flush the gap first so fill + vn stays within the word
      store_le64(raw + at, acc);
      at += fill >> 3;
      acc >>= (fill & ~7u);
      fill &= 7;
      acc |= (vx & 0xFFFFFFFFull) << fill;
      fill += 32;
      vx >>= 32;
      vn -= 32;
      store_le64(raw + at, acc);
      at += fill >> 3;
      acc >>= (fill & ~7u);
      fill &= 7;
    }
    acc |= vx << fill;  // fill <= 30 + 32: at most 62 bits held
    fill += vn;
    store_le64(raw + at, acc);
    at += fill >> 3;
    acc >>= (fill & ~7u);
    fill &= 7;
  }
  raw_at_ = at;
  acc_ = acc;
  fill_ = fill;
  prev_ = prev;
  n_ += n;
}

void BlockEncoder::finish(std::vector<uint8_t>& out) {
  size_t raw_len = raw_at_ + (fill_ ? 1 : 0);  // the last partial byte was stored by add()'s final store
  uint32_t freqs[2][kAlphabet];
  EncodeSymbol tables[2][kAlphabet];
  size_t at = out.size();
  out.reserve(at + 2 * (1 + 32 + 3 * kAlphabet) + 4 + raw_len + 2 * n_ + 16);
  for (int m = 0; m < 2; ++m) {
    uint64_t counts[kAlphabet];
    for (int s = 0; s < kAlphabet; ++s) counts[s] = uint64_t(counts_[m][0][s]) + counts_[m][1][s];
    normalize(counts, freqs[m]);
    build_encode_table(freqs[m], tables[m]);
    write_table(out, freqs[m]);
  }
  uint32_t rl = static_cast<uint32_t>(raw_len);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(rl >> (8 * i)));
  out.insert(out.end(), raw_.data(), raw_.data() + raw_len);
  // rANS runs backwards: the last change first, its value (state 1) before its gap (state 0)
  rans_.reserve(4 * n_ + 8);
  uint8_t* end = rans_.data() + 4 * n_ + 8;
  uint8_t* w = end;
  uint32_t x0 = kRansL, x1 = kRansL;
  const uint8_t* syms = syms_.data();
  const EncodeSymbol* t0 = tables[0];
  const EncodeSymbol* t1 = tables[1];
  for (uint64_t k = n_; k-- > 0;) {
    rans_put(x1, t1[syms[2 * k + 1]], w);
    rans_put(x0, t0[syms[2 * k]], w);
  }
  for (uint32_t x : {x1, x0})
    for (int b = 3; b >= 0; --b) *--w = static_cast<uint8_t>(x >> (8 * b));
  out.insert(out.end(), w, end);
}

BlockDecoder::BlockDecoder(const uint8_t* payload, size_t len, uint32_t n, uint64_t span, int bits_w, size_t block)
    : reader_(payload, len, "block " + std::to_string(block)),
      models_(new DecodeModel[2]),
      bits_(nullptr, 0, reader_),
      span_(span),
      vmax_(max_value(bits_w)) {
  (void)n;
  uint32_t f[2][kAlphabet];
  read_table(reader_, f[0]);
  read_table(reader_, f[1]);
  models_[0].build(f[0]);
  models_[1].build(f[1]);
  uint32_t raw_len = reader_.u32();
  const uint8_t* raw = reader_.take(raw_len);
  bits_ = BitReader(raw, raw_len, reader_);
  const uint8_t* st = reader_.take(8);
  x_[0] = uint32_t(st[0]) | uint32_t(st[1]) << 8 | uint32_t(st[2]) << 16 | uint32_t(st[3]) << 24;
  x_[1] = uint32_t(st[4]) | uint32_t(st[5]) << 8 | uint32_t(st[6]) << 16 | uint32_t(st[7]) << 24;
  data_ = reader_.data();
  p_ = reader_.pos();
  end_ = reader_.size();
}

void BlockDecoder::next_batch(uint32_t* pos, uint64_t* v, size_t count) {
  const DecodeModel& m0 = models_[0];
  const DecodeModel& m1 = models_[1];
  uint32_t x0 = x_[0], x1 = x_[1];
  size_t p = p_;
  const size_t end = end_;
  const uint8_t* data = data_;
  int64_t prev = prev_;
  const uint64_t span = span_, vmax = vmax_;
  auto step = [&](const DecodeModel& m, uint32_t& x) -> uint32_t {
    uint32_t slot = x & (kProbScale - 1);
    uint32_t sym = m.lut[slot];
    uint32_t fc = m.freq_cum[sym];
    x = (fc & 0xFFFF) * (x >> kProbBits) + slot - (fc >> 16);
    while (x < kRansL) {
      if (p >= end) {
        p_ = p;
        reader_.fail("entropy-coded stream truncated");
      }
      x = (x << 8) | data[p++];
    }
    return sym;
  };
  // Fast path: while the states are normalised (x >= L, which every step keeps), one step needs at most
  // two renormalisation bytes, so while 4 bytes per change are left the loop reads them without branches
  // or bounds checks; with at most 52 raw bits per change (dtypes up to 32 bits) one 8-byte refill per
  // change covers both numbers. Same results as the checked loop below, which does the rest (a stream's
  // last bytes, 64-bit dtypes, unnormalised initial states of a hostile blob).
  size_t i = 0;
  while (i < count && x0 >= kRansL && x1 >= kRansL && vmax < (uint64_t(1) << 32)) {
    const size_t raw_left = bits_.bytes_left();
    const size_t safe = std::min({count - i, (end - p) / 4, raw_left >= 8 ? (raw_left - 8) / 7 : size_t(0)});
    if (safe < 8) break;
    BitReader::Cursor bc = bits_.cursor();
    auto fast_step = [&](const DecodeModel& m, uint32_t& x) -> uint32_t {
      uint32_t slot = x & (kProbScale - 1);
      uint32_t sym = m.lut[slot];
      uint32_t fc = m.freq_cum[sym];
      uint32_t y = (fc & 0xFFFF) * (x >> kProbBits) + slot - (fc >> 16);
      for (int r = 0; r < 2; ++r) {
        bool low = y < kRansL;
        uint32_t z = (y << 8) | data[p];
        y = low ? z : y;
        p += low;
      }
      x = y;
      return sym;
    };
    for (const size_t stop = i + safe; i < stop; ++i) {
      uint32_t s0 = fast_step(m0, x0);
      uint32_t s1 = fast_step(m1, x1);
      bc.refill_unchecked();
      uint64_t gap = kBuckets.base[s0] + bc.take(kBuckets.nbits[s0]);
      uint64_t val = kBuckets.base[s1] + bc.take(kBuckets.nbits[s1]);
      if (gap >= uint64_t(int64_t(span) - 1 - prev) || val > vmax) {
        bits_.set_cursor(bc);
        x_[0] = x0;
        x_[1] = x1;
        p_ = p;
        if (val > vmax) reader_.fail("value change " + std::to_string(val) + " too wide for the dtype");
        reader_.fail("change position outside the block of " + std::to_string(span) + " elements");
      }
      prev += 1 + int64_t(gap);
      pos[i] = static_cast<uint32_t>(prev);
      v[i] = val;
    }
    bits_.set_cursor(bc);
  }
  for (; i < count; ++i) {
    uint32_t s0 = step(m0, x0);
    uint32_t s1 = step(m1, x1);
    uint32_t n0 = kBuckets.nbits[s0], n1 = kBuckets.nbits[s1];
    uint64_t gap = n0 ? kBuckets.base[s0] + bits_.read(n0) : kBuckets.base[s0];
    uint64_t val = n1 ? kBuckets.base[s1] + bits_.read(n1) : kBuckets.base[s1];
    if (gap >= uint64_t(int64_t(span) - 1 - prev))  // prev < span: the room left is >= 0
      reader_.fail("change position outside the block of " + std::to_string(span) + " elements");
    prev += 1 + int64_t(gap);
    if (val > vmax) reader_.fail("value change " + std::to_string(val) + " too wide for the dtype");
    pos[i] = static_cast<uint32_t>(prev);
    v[i] = val;
  }
  x_[0] = x0;
  x_[1] = x1;
  p_ = p;
  prev_ = prev;
}

void BlockDecoder::finish() {
  if (x_[0] != kRansL || x_[1] != kRansL || p_ != end_)
    reader_.fail("entropy-coded stream corrupt (final state check failed)");
  bits_.finish();
}

}  // namespace syncd
