// AVX2 versions of the format-2 value kernels (v2_kernels.h): the rows of 16 J entries as two 8-lane halves,
// a half's classes, depths and leaves as vectors, a row's node probabilities one masked gather from lv.node,
// a step's groups interleaved. Bit for bit the scalar kernels' results. Called only when simd_level() says the
// CPU has AVX2.
#include "v2_kernels.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "block_coder.h"
#include "checksum.h"
#include "codec_core.h"
#include "entropy.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "v2_avx2.h"

namespace syncd {
namespace avx2_16 {

using namespace detail;

namespace {

thread_local PodBuffer<uint32_t> t_jidx;
thread_local PodBuffer<uint8_t> t_cls_j;
thread_local PodBuffer<uint16_t> t_m_j;

// A 16-entry table of 32-bit values per class (the trees' depths, or J's buckets) as two vectors.
struct DepthTables {
  __m256i lo, hi;
  SYNCD_256 explicit DepthTables(const int* per_class)
      : lo(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(per_class))),
        hi(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(per_class + 8))) {}
  SYNCD_256 explicit DepthTables(const ValueTrees& lv) : DepthTables(lv.depth) {}
  SYNCD_256 SYNCD_INLINE __m256i of(__m256i cl) const {  // classes (32-bit lanes, < 16) -> their entries
    const __m256i a = _mm256_permutevar8x32_epi32(lo, cl), b = _mm256_permutevar8x32_epi32(hi, cl);
    const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(cl, 28));  // bit 3 of the class picks hi
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), high));
  }
};

// Appends bucket k's entries (position order) to J, which holds nj of them; returns the new count.
SYNCD_256 size_t select_bucket(const uint8_t* cls, const uint16_t* v, size_t n, const DepthTables& bt, int k,
                               const int* bucket, uint32_t* jidx, uint8_t* cls_j, uint16_t* m_j, size_t nj) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), kk = _mm256_set1_epi32(k);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i cl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cls + i)));
    const uint32_t jm = mask8(_mm256_cmpeq_epi32(bt.of(cl), kk));
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kTab.pack[jm]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(jidx + nj),
                        _mm256_permutevar8x32_epi32(_mm256_add_epi32(_mm256_set1_epi32(int(i)), iota), perm));
    const __m256i pc = _mm256_permutevar8x32_epi32(cl, perm);
    const __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(pc), _mm256_extracti128_si256(pc, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(cls_j + nj), _mm_packus_epi16(c16, c16));
    if (v) {
      const __m256i m = _mm256_srli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i))), 1);
      const __m256i pm = _mm256_permutevar8x32_epi32(m, perm);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(m_j + nj),
                       _mm_packus_epi32(_mm256_castsi256_si128(pm), _mm256_extracti128_si256(pm, 1)));
    }
    nj += size_t(__builtin_popcount(jm));
  }
  for (; i < n; ++i) {
    jidx[nj] = uint32_t(i);
    cls_j[nj] = cls[i];
    if (v) m_j[nj] = uint16_t(v[i] >> 1);
    nj += bucket[cls[i]] == k;
  }
  return nj;
}

// The J entries (changes of classes with a value tree) in J's order, bucket by bucket, 8 at a time by a
// left-packing permute: their indices (jidx, room for n + 8), classes and (with v) m = v >> 1 (cls_j, m_j:
// room for n + 16), the last two padded with 16 zero entries.
SYNCD_256 size_t select_j(const uint8_t* cls, const uint16_t* v, size_t n, const ValueTrees& lv, uint32_t* jidx,
                          uint8_t* cls_j, uint16_t* m_j) {
  const JBuckets jb(lv);
  int bucket[16];
  for (int c = 0; c < 16; ++c) bucket[c] = jb.of_class[c];
  const DepthTables bt(bucket);
  size_t nj = 0;
  for (int k = 1; k <= jb.count; ++k) nj = select_bucket(cls, v, n, bt, k, bucket, jidx, cls_j, m_j, nj);
  std::memset(cls_j + nj, 0, kLanes);
  if (v) std::memset(m_j + nj, 0, kLanes * sizeof(uint16_t));
  return nj;
}

// Classes and tree depths of 8 J entries; lanes at or past `width` get depth 0 (never coded).
struct Half {
  __m256i cl, d;
};

SYNCD_256 SYNCD_INLINE Half half_at(const uint8_t* cls_j, size_t at, int width, const DepthTables& dt) {
  const __m256i cl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cls_j + at)));
  const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(width), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return {cl, _mm256_and_si256(dt.of(cl), live)};
}

// The probabilities of node u (per lane) of each lane's class where `on`, else 0.
SYNCD_256 SYNCD_INLINE __m256i node_p(const ValueTrees& lv, __m256i cl, __m256i u, __m256i on) {
  const __m256i idx = _mm256_add_epi32(_mm256_slli_epi32(cl, 7), _mm256_and_si256(u, _mm256_set1_epi32(127)));
  return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(&lv.node[0][0]), idx, on, 4);
}

// 2^depth + nb per lane of 8 J entries, nb the bit length of m (< 2^15; from its float exponent, 0 for m = 0).
SYNCD_256 SYNCD_INLINE __m256i leaf_of(const uint16_t* m8, __m256i d) {
  const __m256i m = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m8)));
  const __m256i e = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(m)), 23);
  const __m256i nb = _mm256_max_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(126)), _mm256_setzero_si256());
  return _mm256_or_si256(_mm256_sllv_epi32(_mm256_set1_epi32(1), d), nb);
}

}  // namespace

SYNCD_256 void value_stats(const uint8_t* cls, const uint16_t* v, size_t n, uint64_t changed[16], uint64_t hist[16][65]) {
  // one bin per (class, bit length of m < 2^15): key 16c + nb, counted in 4 interleaved tables so that runs of
  // one key do not wait on their own increments; 32-bit counts, flushed before they could overflow
  alignas(32) uint32_t t[4][256] = {};
  alignas(32) uint32_t key[8];
  const __m256i zero = _mm256_setzero_si256(), bias = _mm256_set1_epi32(126);
  size_t i = 0, since_flush = 0;
  auto flush = [&] {
    for (int c = 0; c < 16; ++c)
      for (int b = 0; b < 16; ++b) {
        const uint64_t x = uint64_t(t[0][16 * c + b]) + t[1][16 * c + b] + t[2][16 * c + b] + t[3][16 * c + b];
        changed[c] += x;
        hist[c][b] += x;
      }
    std::memset(t, 0, sizeof t);
    since_flush = 0;
  };
  for (; i + 8 <= n; i += 8) {
    const __m256i cl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cls + i)));
    const __m256i m = _mm256_srli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i))), 1);
    const __m256i e = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(m)), 23);
    const __m256i nb = _mm256_max_epi32(_mm256_sub_epi32(e, bias), zero);  // 0 for m = 0
    _mm256_store_si256(reinterpret_cast<__m256i*>(key),
                       _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(cl, _mm256_set1_epi32(15)), 4), nb));
    for (int l = 0; l < 8; l += 4) {
      t[0][key[l]]++;
      t[1][key[l + 1]]++;
      t[2][key[l + 2]]++;
      t[3][key[l + 3]]++;
    }
    if ((since_flush += 8) >= (size_t(1) << 31)) flush();
  }
  flush();
  for (; i < n; ++i) {
    const uint32_t m = v[i] >> 1u;
    changed[cls[i]]++;
    hist[cls[i]][m ? 32 - __builtin_clz(m) : 0]++;
  }
}

namespace {

// The mantissa bits of 8 lanes of a group (J entries jidx[0 .. width), bit lengths nb, 0 past width), in J
// order: one read per 4 lanes (<= 4 * 14 bits), split among them by their lengths' prefix sums in the vector.
SYNCD_256 SYNCD_INLINE void read_mantissa8(__m256i nb, int width, const uint32_t* jidx, BitReader& mant, uint16_t* v,
                                           const std::string& what) {
  const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
  const __m256i len = _mm256_max_epi32(_mm256_sub_epi32(nb, one), zero);
  __m256i incl = _mm256_add_epi32(len, _mm256_slli_si256(len, 4));  // prefix sums within each 4 lanes
  incl = _mm256_add_epi32(incl, _mm256_slli_si256(incl, 8));
  const __m256i excl = _mm256_sub_epi32(incl, len);
  const uint32_t total0 = uint32_t(_mm256_extract_epi32(incl, 3)), total1 = uint32_t(_mm256_extract_epi32(incl, 7));
  const uint64_t b0 = mant.read(total0);
  const uint64_t b1 = mant.read(total1);
  const __m256i s0 = _mm256_srlv_epi64(_mm256_set1_epi64x(int64_t(b0)), _mm256_cvtepu32_epi64(_mm256_castsi256_si128(excl)));
  const __m256i s1 = _mm256_srlv_epi64(_mm256_set1_epi64x(int64_t(b1)), _mm256_cvtepu32_epi64(_mm256_extracti128_si256(excl, 1)));
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);  // the low halves of the 64-bit lanes
  const __m256i bits = _mm256_permute2x128_si256(_mm256_permutevar8x32_epi32(s0, even),
                                                 _mm256_permutevar8x32_epi32(s1, even), 0x20);
  const __m256i lead = _mm256_sllv_epi32(one, len);
  const __m256i m = _mm256_or_si256(_mm256_and_si256(bits, _mm256_sub_epi32(lead, one)),
                                    _mm256_and_si256(lead, _mm256_cmpgt_epi32(nb, zero)));
  alignas(32) uint32_t mm[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(mm), m);
  for (int l = 0; l < width; ++l) {
    const uint32_t xv = (mm[l] << 1) | v[jidx[l]];
    if (xv > 0xFFFE) fail(what, ": value change 65535 too wide for the dtype");
    v[jidx[l]] = uint16_t(xv);
  }
}

// The J entries of group g of the step at s0: their first index and number (0: none, loads from 0).
struct GroupSpan {
  size_t lo;
  int width;
};
inline GroupSpan group_span(size_t s0, int g, size_t nj) {
  const size_t lo = s0 + size_t(g) * kLanes;
  return lo < nj ? GroupSpan{lo, int(std::min<size_t>(kLanes, nj - lo))} : GroupSpan{0, 0};
}

// One step of the value streams, its GV groups' rows interleaved (each group's own stream stays in order).
template <int GV>
SYNCD_256 SYNCD_INLINE void decode_step(size_t s0, size_t nj, const uint8_t* cls_j, const uint32_t* jidx,
                                        const DepthTables& dt, const ValueTrees& lv, BinGroupDecoder* vdec,
                                        BitReader& mant, uint16_t* v, const std::string& what) {
  const __m256i one = _mm256_set1_epi32(1);
  GroupSpan gs[GV];
  Half h0[GV], h1[GV];
  __m256i u0[GV], u1[GV];
  State x[GV];
  for (int g = 0; g < GV; ++g) {
    gs[g] = group_span(s0, g, nj);
    h0[g] = half_at(cls_j, gs[g].lo, gs[g].width, dt);
    h1[g] = half_at(cls_j, gs[g].lo + 8, gs[g].width - 8, dt);
    u0[g] = u1[g] = one;
    x[g] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vdec[g].x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vdec[g].x + 8))};
  }
  for (int r = 0;; ++r) {  // until no lane's tree has more levels
    const __m256i rr = _mm256_set1_epi32(r);
    __m256i on0[GV], on1[GV];
    uint32_t any = 0;
    for (int g = 0; g < GV; ++g) {
      on0[g] = _mm256_cmpgt_epi32(h0[g].d, rr);
      on1[g] = _mm256_cmpgt_epi32(h1[g].d, rr);
      any |= mask8(_mm256_or_si256(on0[g], on1[g]));
    }
    if (!any) break;
    for (int g = 0; g < GV; ++g) {
      BinGroupDecoder& d = vdec[g];
      const uint32_t b0 = dec8(x[g].lo, mask8(on0[g]), node_p(lv, h0[g].cl, u0[g], on0[g]), d.p, d.end, d.what);
      const uint32_t b1 = dec8(x[g].hi, mask8(on1[g]), node_p(lv, h1[g].cl, u1[g], on1[g]), d.p, d.end, d.what);
      u0[g] = _mm256_blendv_epi8(u0[g], _mm256_sub_epi32(_mm256_add_epi32(u0[g], u0[g]), lane_mask(b0)), on0[g]);
      u1[g] = _mm256_blendv_epi8(u1[g], _mm256_sub_epi32(_mm256_add_epi32(u1[g], u1[g]), lane_mask(b1)), on1[g]);
    }
  }
  for (int g = 0; g < GV; ++g) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(vdec[g].x), x[g].lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(vdec[g].x + 8), x[g].hi);
  }
  for (int g = 0; g < GV; ++g) {  // u = 2^depth + nb
    if (!gs[g].width) continue;
    read_mantissa8(_mm256_sub_epi32(u0[g], _mm256_sllv_epi32(one, h0[g].d)), std::min(gs[g].width, 8),
                   jidx + gs[g].lo, mant, v, what);
    if (gs[g].width > 8)
      read_mantissa8(_mm256_sub_epi32(u1[g], _mm256_sllv_epi32(one, h1[g].d)), gs[g].width - 8,
                     jidx + gs[g].lo + 8, mant, v, what);
  }
}

// One step of the value streams backwards (rows bottom up), its GV groups' rows interleaved.
template <int GV>
SYNCD_256 SYNCD_INLINE void encode_step(size_t s0, size_t nj, const uint8_t* cls_j, const uint16_t* m_j,
                                        const DepthTables& dt, const ValueTrees& lv, BinGroupEncoder* venc) {
  const __m256i one = _mm256_set1_epi32(1);
  Half h0[GV], h1[GV];
  __m256i leaf0[GV], leaf1[GV], dmax = _mm256_setzero_si256();
  State x[GV];
  for (int g = 0; g < GV; ++g) {
    const GroupSpan gs = group_span(s0, g, nj);
    h0[g] = half_at(cls_j, gs.lo, gs.width, dt);
    h1[g] = half_at(cls_j, gs.lo + 8, gs.width - 8, dt);
    leaf0[g] = leaf_of(m_j + gs.lo, h0[g].d);
    leaf1[g] = leaf_of(m_j + gs.lo + 8, h1[g].d);
    dmax = _mm256_max_epu32(dmax, _mm256_max_epu32(h0[g].d, h1[g].d));
    x[g] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(venc[g].x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(venc[g].x + 8))};
  }
  alignas(32) uint32_t dd[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(dd), dmax);
  int top = 0;
  for (int l = 0; l < 8; ++l) top = std::max(top, int(dd[l]));
  for (int r = top - 1; r >= 0; --r) {
    const __m256i rr = _mm256_set1_epi32(r);
    for (int g = GV - 1; g >= 0; --g) {
      const __m256i on0 = _mm256_cmpgt_epi32(h0[g].d, rr), on1 = _mm256_cmpgt_epi32(h1[g].d, rr);
      const __m256i sh0 = _mm256_sub_epi32(h0[g].d, rr), sh1 = _mm256_sub_epi32(h1[g].d, rr);  // node: leaf >> sh
      const __m256i p0 = node_p(lv, h0[g].cl, _mm256_srlv_epi32(leaf0[g], sh0), on0);
      const __m256i p1 = node_p(lv, h1[g].cl, _mm256_srlv_epi32(leaf1[g], sh1), on1);
      const uint32_t b0 = mask8(_mm256_slli_epi32(_mm256_srlv_epi32(leaf0[g], _mm256_sub_epi32(sh0, one)), 31));
      const uint32_t b1 = mask8(_mm256_slli_epi32(_mm256_srlv_epi32(leaf1[g], _mm256_sub_epi32(sh1, one)), 31));
      enc8(x[g].hi, mask8(on1), b1, p1, venc[g].w);
      enc8(x[g].lo, mask8(on0), b0, p0, venc[g].w);
    }
  }
  for (int g = 0; g < GV; ++g) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(venc[g].x), x[g].lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(venc[g].x + 8), x[g].hi);
  }
}

}  // namespace

SYNCD_256 void decode_values(const uint8_t* cls, size_t n, const uint8_t* signs, const ValueTrees& lv,
                             BinGroupDecoder* vdec, int gv, const uint8_t* mant_p, size_t mant_len, uint16_t* v,
                             const std::string& what) {
  uint32_t* jidx = t_jidx.scratch(n + 8);
  uint8_t* cls_j = t_cls_j.scratch(n + kLanes);
  const DepthTables dt(lv);
  const size_t nj = select_j(cls, nullptr, n, lv, jidx, cls_j, nullptr);
  check_value_groups(gv, nj, what);
  const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                        int16_t(0x8000));
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {  // the sign bits as the values' low bits, 16 at a time
    const __m256i b = _mm256_set1_epi16(int16_t(signs[i >> 3] | signs[(i >> 3) + 1] << 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i),
                        _mm256_srli_epi16(_mm256_cmpeq_epi16(_mm256_and_si256(b, bit), bit), 15));
  }
  for (; i < n; ++i) v[i] = uint16_t(signs[i >> 3] >> (i & 7) & 1);
  ByteReader owner(mant_p, mant_len, what);
  BitReader mant(mant_p, mant_len, owner);
  const size_t step = size_t(kLanes) * std::max(gv, 1);
  for (size_t s0 = 0; s0 < nj && gv; s0 += step) {
    switch (gv) {
      case 1: decode_step<1>(s0, nj, cls_j, jidx, dt, lv, vdec, mant, v, what); break;
      case 2: decode_step<2>(s0, nj, cls_j, jidx, dt, lv, vdec, mant, v, what); break;
      case 3: decode_step<3>(s0, nj, cls_j, jidx, dt, lv, vdec, mant, v, what); break;
      case 4: decode_step<4>(s0, nj, cls_j, jidx, dt, lv, vdec, mant, v, what); break;
      default:  // more groups than our encoders write: one at a time (same order within each stream)
        for (int g = 0; g < gv; ++g) decode_step<1>(s0 + size_t(g) * kLanes, nj, cls_j, jidx, dt, lv, vdec + g, mant, v, what);
    }
  }
  mant.finish();
}

SYNCD_256 void encode_values(const uint8_t* cls, const uint16_t* v, size_t n, const ValueTrees& lv,
                             BinGroupEncoder* venc, int gv, std::vector<uint8_t>& mant, uint8_t* signs) {
  uint32_t* jidx = t_jidx.scratch(n + 8);
  uint8_t* cls_j = t_cls_j.scratch(n + kLanes);
  uint16_t* m_j = t_m_j.scratch(n + kLanes);
  const DepthTables dt(lv);
  const size_t nj = select_j(cls, v, n, lv, jidx, cls_j, m_j);
  const size_t step = size_t(kLanes) * std::max(gv, 1);
  for (size_t s0 = gv ? (nj + step - 1) / step * step : 0; s0 > 0;) {  // steps back to front
    s0 -= step;
    switch (gv) {
      case 1: encode_step<1>(s0, nj, cls_j, m_j, dt, lv, venc); break;
      case 2: encode_step<2>(s0, nj, cls_j, m_j, dt, lv, venc); break;
      case 3: encode_step<3>(s0, nj, cls_j, m_j, dt, lv, venc); break;
      case 4: encode_step<4>(s0, nj, cls_j, m_j, dt, lv, venc); break;
      default:
        for (int g = gv - 1; g >= 0; --g) encode_step<1>(s0 + size_t(g) * kLanes, nj, cls_j, m_j, dt, lv, venc + g);
    }
  }
  append_mantissa16(nj, [m_j](size_t t) { return uint32_t(m_j[t]); }, mant);  // in J order
  std::memset(signs, 0, (n + 7) / 8);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {  // the values' low bits, 16 at a time: bit 15 of each lane, then its high byte's top
    const __m256i lowbit = _mm256_slli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)), 15);
    const uint32_t bits = _pext_u32(uint32_t(_mm256_movemask_epi8(lowbit)), 0xAAAAAAAAu);
    signs[i >> 3] = uint8_t(bits);
    signs[(i >> 3) + 1] = uint8_t(bits >> 8);
  }
  for (; i < n; ++i) signs[i >> 3] |= uint8_t((v[i] & 1) << (i & 7));
}

}  // namespace avx2_16
}  // namespace syncd

#endif
