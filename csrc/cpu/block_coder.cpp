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

struct Scratch {
  std::vector<uint8_t> syms, raw, rans;
};

}  // namespace


__attribute__((noinline)) Scratch& scratch() {  // not inlined: keeps TLS lookups out of loops
  thread_local Scratch s;
  return s;
}

void encode_block(const BlockChanges& c, std::vector<uint8_t>& out) {
  Scratch& s = scratch();  // one TLS lookup per block, not per change
  size_t n = c.pos.size();
  s.syms.resize(2 * n);
  s.raw.clear();
  BitWriter bits(s.raw);
  uint64_t counts[2][kAlphabet] = {};
  int64_t prev = -1;
  for (size_t i = 0; i < n; ++i) {
    Bucketed g = bucket(uint64_t(int64_t(c.pos[i]) - prev - 1));
    prev = c.pos[i];
    s.syms[2 * i] = static_cast<uint8_t>(g.sym);
    counts[0][g.sym]++;
    bits.write(g.extra, g.nbits);
    Bucketed x = bucket(c.v[i]);
    s.syms[2 * i + 1] = static_cast<uint8_t>(x.sym);
    counts[1][x.sym]++;
    bits.write(x.extra, x.nbits);
  }
  bits.flush();
  uint32_t freqs[2][kAlphabet];
  EncodeModel models[2];
  for (int m = 0; m < 2; ++m) {
    normalize(counts[m], freqs[m]);
    models[m].build(freqs[m]);
    write_table(out, freqs[m]);
  }
  uint32_t rl = static_cast<uint32_t>(s.raw.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(rl >> (8 * i)));
  out.insert(out.end(), s.raw.begin(), s.raw.end());
  rans_encode(s.syms.data(), s.syms.size(), models, s.rans, out);
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
    x = m.freq[sym] * (x >> kProbBits) + slot - m.cum[sym];
    while (x < kRansL) {
      if (p >= end) {
        p_ = p;
        reader_.fail("entropy-coded stream truncated");
      }
      x = (x << 8) | data[p++];
    }
    return sym;
  };
  for (size_t i = 0; i < count; ++i) {
    uint32_t s0 = step(m0, x0);
    uint32_t s1 = step(m1, x1);
    uint32_t n0 = kBuckets.nbits[s0], n1 = kBuckets.nbits[s1];
    uint64_t gap = n0 ? kBuckets.base[s0] + bits_.read(n0) : kBuckets.base[s0];
    uint64_t val = n1 ? kBuckets.base[s1] + bits_.read(n1) : kBuckets.base[s1];
    if (gap >= span || int64_t(gap) >= int64_t(span) - 1 - prev)
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
