#include "block_v2.h"

#include <algorithm>
#include <cstring>

#include "binary_rans_simd.h"
#include "checksum.h"
#include "codec_core.h"
#include "word_dispatch.h"

namespace syncd {

namespace {

inline uint64_t element_at(const uint8_t* p, int bytes, uint64_t i) {
  switch (bytes) {
    case 1: return p[i];
    case 2: return load_le16(p + 2 * i);
    case 4: return load_le32(p + 4 * i);
    default: return load_le64(p + 8 * i);
  }
}

inline int class_of(uint64_t bits, const DTypeInfo& dt, int e_top) {
  if (!dt.exp_bits) return 0;
  const int e = int((bits >> dt.exp_shift) & ((uint64_t(1) << dt.exp_bits) - 1));
  return std::min(kClasses - 1, std::max(0, e_top - e));
}

inline uint32_t bit_length(uint64_t m) { return m ? 64 - uint32_t(__builtin_clzll(m)) : 0; }

// round(num / den) for num, den < 2^127 and den > 0, clamped to 1..65535
uint32_t rounded_probability(unsigned __int128 num, unsigned __int128 den) {
  unsigned __int128 q = (2 * num + den) / (2 * den);
  return uint32_t(std::min<unsigned __int128>(kBinOne - 1, std::max<unsigned __int128>(1, q)));
}

inline void put_u16(std::vector<uint8_t>& o, uint32_t v) {
  o.push_back(uint8_t(v));
  o.push_back(uint8_t(v >> 8));
}

uint64_t groups_for(uint64_t count) {
  return std::min<uint64_t>(kEncoderMaxGroups, std::max<uint64_t>(1, count / kChangesPerGroup));
}

// LSB-first bit writer into a growable byte vector.
struct BitSink {
  std::vector<uint8_t>& out;
  uint64_t acc = 0;
  uint32_t fill = 0;
  void put(uint64_t v, uint32_t n) {  // n <= 62
    if (n > 32) {
      put(v & 0xFFFFFFFFull, 32);
      v >>= 32;
      n -= 32;
    }
    acc |= v << fill;
    fill += n;
    while (fill >= 8) {
      out.push_back(uint8_t(acc));
      acc >>= 8;
      fill -= 8;
    }
  }
  void flush() {
    if (fill) out.push_back(uint8_t(acc));
    acc = 0;
    fill = 0;
  }
};

}  // namespace

void block_classes(const ClassSource& cs, const DTypeInfo& dt, int e_top, uint64_t lo, size_t n, uint8_t* out) {
  if (!dt.exp_bits) {
    std::memset(out, 0, n);
    return;
  }
  if (cs.old) {
    const int bytes = dt.bits / 8;
    for (size_t i = 0; i < n; ++i) out[i] = uint8_t(class_of(element_at(cs.old, bytes, lo + i), dt, e_top));
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const uint64_t k = cs.first + lo + i;
    out[i] = uint8_t(cs.nibbles[k >> 1] >> (4 * (k & 1)) & 0xF);
  }
}

int choose_e_top(const uint8_t* old, uint64_t span, const DTypeInfo& dt) {
  if (!dt.exp_bits) return 0;
  const int bytes = dt.bits / 8;
  const uint64_t ones = (uint64_t(1) << dt.exp_bits) - 1;
  int best = -1;
  for (uint64_t s = 0; s < span; s += kSamplePeriod) {
    const uint64_t e = std::min(span, s + kSampleRun);
    for (uint64_t i = s; i < e; ++i) {
      const uint64_t x = (element_at(old, bytes, i) >> dt.exp_shift) & ones;
      if (x != ones && int(x) > best) best = int(x);
    }
  }
  return best < 0 ? 0 : best;
}

// ---------------------------------------------------------------------------------------------- encoder

V2BlockEncoder& thread_v2_encoder() {
  thread_local V2BlockEncoder e;
  return e;
}

void V2BlockEncoder::reset() { n_ = 0; }

void V2BlockEncoder::add(const uint32_t* pos, const uint64_t* v, size_t n) {
  if (!n) return;
  pos_.reserve(n_ + n, n_);
  v_.reserve(n_ + n, n_);
  std::memcpy(pos_.data() + n_, pos, n * sizeof(uint32_t));
  std::memcpy(v_.data() + n_, v, n * sizeof(uint64_t));
  n_ += n;
}

void V2BlockEncoder::finish(std::vector<uint8_t>& out, uint64_t span, const DTypeInfo& dt, const ClassSource& cs,
                            int e_top) {
  if (use_context(n_, span)) {
    finish_context(out, span, dt, cs, e_top);
    return;
  }
  out.push_back(kModeOrder0);
  BlockEncoder& e = thread_block_encoder();
  e.reset();
  e.add(pos_.data(), v_.data(), size_t(n_));
  e.finish(out);
}

void V2BlockEncoder::finish_context(std::vector<uint8_t>& out, uint64_t span, const DTypeInfo& dt,
                                    const ClassSource& cs, int e_top) {
  const size_t n = size_t(n_);
  const uint32_t* pos = pos_.data();
  const uint64_t* v = v_.data();
  if (cs.old) e_top = choose_e_top(cs.old, span, dt);
  // classes of every element, the sample's class counts, and the changes' classes and bit lengths
  cls_.reserve(span + kLanes);
  uint8_t* cls = cls_.data();
  block_classes(cs, dt, e_top, 0, size_t(span), cls);
  std::memset(cls + span, 0, kLanes);
  uint64_t sampled[kClasses] = {}, sample_size = 0;
  for (uint64_t s = 0; s < span; s += kSamplePeriod)
    for (uint64_t i = s, e = std::min(span, s + kSampleRun); i < e; ++i) sampled[cls[i]]++;
  for (uint64_t x : sampled) sample_size += x;
  cls_ch_.reserve(n);
  nb_.reserve(n);
  uint8_t* cch = cls_ch_.data();
  uint8_t* nb = nb_.data();
  uint64_t changed[kClasses] = {};
  uint64_t hist[kClasses][65] = {};
  for (size_t i = 0; i < n; ++i) {
    cch[i] = cls[pos[i]];
    nb[i] = uint8_t(bit_length(v[i] >> 1));
    changed[cch[i]]++;
    hist[cch[i]][nb[i]]++;
  }
  uint32_t p1[kClasses] = {};
  for (int c = 0; c < kClasses; ++c)
    if (changed[c])
      p1[c] = rounded_probability((unsigned __int128)changed[c] * kBinOne * sample_size,
                                  (unsigned __int128)std::max<uint64_t>(sampled[c], 1) * span);
  int depth[kClasses] = {};
  uint32_t levels[kClasses][64] = {};
  for (int c = 0; c < kClasses; ++c) {
    for (int k = 64; k > 0; --k)
      if (hist[c][k]) {
        depth[c] = k;
        break;
      }
    uint64_t reached = changed[c];
    for (int k = 0; k < depth[c]; ++k) {
      const uint64_t more = reached - hist[c][k];
      levels[c][k] = rounded_probability((unsigned __int128)more << 16, reached);
      reached = more;
    }
  }
  const int gp = int(groups_for(n));
  jidx_.reserve(n);
  uint32_t* jidx = jidx_.data();
  size_t nj = 0;
  uint64_t decisions = 0;
  for (size_t i = 0; i < n; ++i)
    if (depth[cch[i]]) {
      jidx[nj++] = uint32_t(i);
      decisions += std::min<uint64_t>(uint64_t(nb[i]) + 1, uint64_t(depth[cch[i]]));
    }
  const int gv = nj ? int(groups_for(nj)) : 0;

  // the change bitmap, then the position groups, backwards
  const size_t nwords = size_t((span + 63) / 64) + 1;
  bitmap_.reserve(nwords);
  uint64_t* bm = bitmap_.data();
  std::memset(bm, 0, nwords * 8);
  for (size_t i = 0; i < n; ++i) bm[pos[i] >> 6] |= uint64_t(1) << (pos[i] & 63);
  const uint64_t vectors = (span + kLanes - 1) / kLanes;
  const size_t pos_region = size_t(2 * (vectors / gp + 1) * kLanes + 4 * kLanes);
  const size_t val_region = gv ? size_t(2 * decisions + 4 * kLanes) : 0;
  words_.reserve(gp * pos_region + gv * val_region);
  uint8_t* wbase = words_.data();
  BinGroupEncoder enc[kMaxGroups];
  for (int g = 0; g < gp; ++g) enc[g] = BinGroupEncoder(wbase + (g + 1) * pos_region);
  encode_position_rows(cls, span, p1, bm, enc, gp);
  const uint8_t* pstart[kMaxGroups];
  for (int g = 0; g < gp; ++g) pstart[g] = enc[g].finish();

  // value groups: rows in reverse decode order (steps back to front, levels top down)
  uint8_t* vbase = wbase + gp * pos_region;
  BinGroupEncoder venc[kMaxGroups];
  for (int g = 0; g < gv; ++g) venc[g] = BinGroupEncoder(vbase + (g + 1) * val_region);
  if (gv) {
    const size_t step = size_t(kLanes) * gv;
    for (size_t s0 = (nj - 1) / step * step + step; s0 > 0;) {
      s0 -= step;
      for (int g = gv - 1; g >= 0; --g) {
        const size_t lo = s0 + size_t(g) * kLanes;
        if (lo >= nj) continue;
        const size_t hi = std::min(nj, lo + kLanes);
        int top = 0;
        for (size_t t = lo; t < hi; ++t) top = std::max(top, depth[cch[jidx[t]]]);
        for (int k = top - 1; k >= 0; --k) {
          uint32_t coded = 0, bits = 0, pl[kLanes] = {};
          for (size_t t = lo; t < hi; ++t) {
            const size_t i = jidx[t];
            const int c = cch[i], l = int(t - lo);
            if (depth[c] > k && nb[i] >= k) {
              coded |= 1u << l;
              bits |= uint32_t(nb[i] > k) << l;
              pl[l] = levels[c][k];
            }
          }
          if (coded) venc[g].put_row(coded, pl, bits);
        }
      }
    }
  }
  const uint8_t* vstart[kMaxGroups];
  for (int g = 0; g < gv; ++g) vstart[g] = venc[g].finish();

  // parameters, stream lengths, streams, mantissa bits, sign bits
  out.push_back(kModeContext);
  put_u16(out, uint32_t(e_top));
  out.push_back(uint8_t(gp));
  out.push_back(uint8_t(gv));
  uint32_t mask_p = 0, mask_v = 0;
  for (int c = 0; c < kClasses; ++c) {
    mask_p |= uint32_t(p1[c] != 0) << c;
    mask_v |= uint32_t(depth[c] != 0) << c;
  }
  put_u16(out, mask_p);
  for (int c = 0; c < kClasses; ++c)
    if (p1[c]) put_u16(out, p1[c]);
  put_u16(out, mask_v);
  for (int c = 0; c < kClasses; ++c)
    if (depth[c]) {
      out.push_back(uint8_t(depth[c]));
      for (int k = 0; k < depth[c]; ++k) put_u16(out, levels[c][k]);
    }
  std::vector<uint8_t> mant;
  BitSink ms{mant};
  for (size_t i = 0; i < n; ++i)
    if (nb[i] >= 2) ms.put((v[i] >> 1) - (uint64_t(1) << (nb[i] - 1)), nb[i] - 1u);
  ms.flush();
  for (int g = 0; g < gp; ++g) write_varint(out, uint64_t(wbase + (g + 1) * pos_region - pstart[g]));
  for (int g = 0; g < gv; ++g) write_varint(out, uint64_t(vbase + (g + 1) * val_region - vstart[g]));
  write_varint(out, mant.size());
  for (int g = 0; g < gp; ++g) out.insert(out.end(), pstart[g], static_cast<const uint8_t*>(wbase + (g + 1) * pos_region));
  for (int g = 0; g < gv; ++g) out.insert(out.end(), vstart[g], static_cast<const uint8_t*>(vbase + (g + 1) * val_region));
  out.insert(out.end(), mant.begin(), mant.end());
  const size_t sat = out.size();
  out.resize(sat + (n + 7) / 8, 0);
  for (size_t i = 0; i < n; ++i) out[sat + (i >> 3)] |= uint8_t((v[i] & 1) << (i & 7));
}

// ---------------------------------------------------------------------------------------------- decoder

void V2BlockDecoder::parse(const uint8_t* payload, size_t len, uint32_t n, uint64_t span, const DTypeInfo& dt,
                           size_t block) {
  what_ = "block " + std::to_string(block);
  payload_ = payload;
  len_ = len;
  n_ = n;
  span_ = span;
  dt_ = dt;
  block_ = block;
  ByteReader r(payload, len, what_);
  mode_ = r.u8();
  if (mode_ == kModeOrder0) return;
  if (mode_ != kModeContext) r.fail("unknown block mode " + std::to_string(mode_));
  const uint8_t* f = r.take(4);
  e_top_ = load_le16(f);
  gp_ = f[2];
  gv_ = f[3];
  if (dt.exp_bits ? e_top_ >= (1 << dt.exp_bits) : e_top_ != 0)
    r.fail("class origin " + std::to_string(e_top_) + " outside the dtype's exponent range");
  if (gp_ < 1 || gp_ > kMaxGroups || gv_ > kMaxGroups)
    r.fail(std::to_string(gp_) + " position and " + std::to_string(gv_) + " value groups (1..8 and 0..8)");
  const uint32_t mask_p = load_le16(r.take(2));
  if (!dt.exp_bits && (mask_p & ~1u)) r.fail("classes other than 0 for a dtype without an exponent");
  for (int c = 0; c < kClasses; ++c) {
    p1_[c] = (mask_p >> c & 1) ? load_le16(r.take(2)) : 0;
    if ((mask_p >> c & 1) && !p1_[c]) r.fail("class " + std::to_string(c) + " listed with a zero change probability");
  }
  const uint32_t mask_v = load_le16(r.take(2));
  if (mask_v & ~mask_p) r.fail("value levels for a class that never changes");
  for (int c = 0; c < kClasses; ++c) {
    depth_[c] = 0;
    if (!(mask_v >> c & 1)) continue;
    depth_[c] = r.u8();
    if (depth_[c] < 1 || depth_[c] > dt.bits - 1)
      r.fail("class " + std::to_string(c) + " has " + std::to_string(depth_[c]) + " value levels");
    const uint8_t* lv = r.take(2 * size_t(depth_[c]));
    for (int k = 0; k < depth_[c]; ++k) {
      levels_[c][k] = load_le16(lv + 2 * k);
      if (!levels_[c][k]) r.fail("class " + std::to_string(c) + " has a zero level probability");
    }
  }
  uint64_t lens[2 * kMaxGroups + 1];
  for (int i = 0; i < gp_ + gv_ + 1; ++i) lens[i] = r.varint();
  for (int i = 0; i < gp_ + gv_; ++i) {
    stream_len_[i] = size_t(lens[i]);
    streams_[i] = r.take(size_t(lens[i]));
  }
  mant_len_ = size_t(lens[gp_ + gv_]);
  mant_ = r.take(mant_len_);
  signs_ = r.take((size_t(n) + 7) / 8);
  if (r.pos() != len) r.fail(std::to_string(len - r.pos()) + " bytes after the sign bits");
}

void V2BlockDecoder::decode(const ClassSource& cs, uint32_t* pos, uint64_t* v) {
  if (mode_ == kModeContext) {
    decode_context(cs, pos, v);
    return;
  }
  BlockDecoder dec(payload_ + 1, len_ - 1, n_, span_, dt_.bits, block_);
  constexpr uint32_t kBatch = 256;
  for (uint32_t i = 0; i < n_; i += kBatch) dec.next_batch(pos + i, v + i, std::min(kBatch, n_ - i));
  dec.finish();
}

void V2BlockDecoder::decode_context(const ClassSource& cs, uint32_t* pos, uint64_t* v) {
  const size_t n = n_;
  BinGroupDecoder dec[kMaxGroups];
  for (int g = 0; g < gp_; ++g) dec[g].init(streams_[g], stream_len_[g], what_ + " position group " + std::to_string(g));
  std::vector<uint8_t> cls_ch(n + kLanes);
  const size_t found = decode_position_rows(cs, dt_, e_top_, span_, p1_, dec, gp_, pos, cls_ch.data(), n, what_);
  for (int g = 0; g < gp_; ++g) dec[g].finish();
  if (found != n)
    throw DeltaError(what_ + ": " + std::to_string(found) + " changes decoded, the block table says " + std::to_string(n));
  // value levels of the changes in classes that have them
  std::vector<uint32_t> jidx;
  for (size_t i = 0; i < n; ++i)
    if (depth_[cls_ch[i]]) jidx.push_back(uint32_t(i));
  if ((gv_ == 0) != jidx.empty())
    throw DeltaError(what_ + ": " + std::to_string(gv_) + " value groups for " + std::to_string(jidx.size()) +
                     " changes with value levels");
  std::vector<uint8_t> nb(n, 0);
  BinGroupDecoder vdec[kMaxGroups];
  for (int g = 0; g < gv_; ++g)
    vdec[g].init(streams_[gp_ + g], stream_len_[gp_ + g], what_ + " value group " + std::to_string(g));
  const size_t nj = jidx.size(), step = size_t(kLanes) * (gv_ ? gv_ : 1);
  for (size_t s0 = 0; s0 < nj; s0 += step)
    for (int g = 0; g < gv_; ++g) {
      const size_t lo = s0 + size_t(g) * kLanes;
      if (lo >= nj) break;
      const size_t hi = std::min(nj, lo + kLanes);
      uint32_t cnt[kLanes] = {};
      for (int k = 0;; ++k) {
        uint32_t coded = 0, pl[kLanes] = {};
        for (size_t t = lo; t < hi; ++t) {
          const int c = cls_ch[jidx[t]], l = int(t - lo);
          if (depth_[c] > k && cnt[l] == uint32_t(k)) {
            coded |= 1u << l;
            pl[l] = levels_[c][k];
          }
        }
        if (!coded) break;
        const uint32_t bits = vdec[g].row(coded, pl);
        for (int l = 0; l < kLanes; ++l) cnt[l] += bits >> l & 1;
      }
      for (size_t t = lo; t < hi; ++t) nb[jidx[t]] = uint8_t(cnt[t - lo]);
    }
  for (int g = 0; g < gv_; ++g) vdec[g].finish();
  ByteReader owner(payload_, len_, what_);
  BitReader mant(mant_, mant_len_, owner);
  const uint64_t vmax = core::max_value(dt_.bits);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t k = nb[i];
    const uint64_t m = k == 0 ? 0 : (uint64_t(1) << (k - 1)) | (k >= 2 ? mant.read(k - 1) : 0);
    const uint64_t x = (m << 1) | (signs_[i >> 3] >> (i & 7) & 1);
    if (x > vmax) throw DeltaError(what_ + ": value change " + std::to_string(x) + " too wide for the dtype");
    v[i] = x;
  }
  mant.finish();
  if ((n & 7) && (signs_[n >> 3] >> (n & 7))) throw DeltaError(what_ + ": sign bits past the last change");
}

}  // namespace syncd
