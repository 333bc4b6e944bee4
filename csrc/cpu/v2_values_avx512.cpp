// AVX-512 versions of the 16-bit format-2 value kernels (v2_kernels.h): the bit lengths' tree digits, 16 lanes
// per zmm and up to 4 groups interleaved, node probabilities from permute tables, and the mantissa bits.
// Bit for bit the scalar kernels' results. Called only when simd_level() says the CPU has AVX-512.
#include "v2_kernels.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "v2_avx512.h"

namespace syncd {
namespace avx512_16 {
using namespace detail;

namespace {

thread_local PodBuffer<uint8_t> t_cls_j, t_nb_j;
thread_local PodBuffer<uint16_t> t_m_j;

// Compresses the classes (and, when v is given, the bit lengths and m) of the changes of J in J's order, bucket
// by bucket; start[k] (k = 1..count) is where bucket k begins in J. Returns J's size.
SYNCD_512 size_t select_j(const uint8_t* cls, const uint16_t* v, size_t n, const JBuckets& jb, uint8_t* cls_j,
                          uint8_t* nb_j, uint16_t* m_j, size_t* start) {
  const __m512i btab = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(jb.of_class)));
  size_t nj = 0;
  for (int k = 1; k <= jb.count; ++k) {
    start[k] = nj;
    for (size_t i = 0; i < n; i += 64) {
      const __mmask64 live = n - i >= 64 ? ~__mmask64(0) : (__mmask64(1) << (n - i)) - 1;
      const __m512i cl = _mm512_maskz_loadu_epi8(live, cls + i);
      const __mmask64 jm = _mm512_mask_cmpeq_epi8_mask(live, _mm512_shuffle_epi8(btab, cl), _mm512_set1_epi8(char(k)));
      compress_bytes64(cls_j + nj, jm, cl);
      if (v) {
        for (int h = 0; h < 2; ++h) {
          const __mmask32 lh = __mmask32(live >> (32 * h)), jh = __mmask32(jm >> (32 * h));
          const __m512i m = _mm512_srli_epi16(_mm512_maskz_loadu_epi16(lh, v + i + 32 * h), 1);
          const size_t at = nj + size_t(__builtin_popcountll(jm & ((uint64_t(1) << (32 * h)) - 1)));
          compress_store32x16(m_j + at, jh, m);
          __m512i nb2[2];
          for (int q = 0; q < 2; ++q) {
            const __m512i w = _mm512_cvtepu16_epi32(q ? _mm512_extracti64x4_epi64(m, 1) : _mm512_castsi512_si256(m));
            nb2[q] = _mm512_sub_epi32(_mm512_set1_epi32(32), _mm512_lzcnt_epi32(w));
          }
          const __m256i nb = _mm256_set_m128i(_mm512_cvtepi32_epi8(nb2[1]), _mm512_cvtepi32_epi8(nb2[0]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(nb_j + at), _mm256_maskz_compress_epi8(jh, nb));
        }
      }
      nj += size_t(__builtin_popcountll(jm));
    }
  }
  return nj;
}

}  // namespace

SYNCD_512 void value_stats(const uint8_t* cls, const uint16_t* v, size_t n, uint64_t changed[16], uint64_t hist[16][65]) {
  // class counts by compare and popcount; the changes with m > 0 as one key byte each, 16 * class + bit length
  // (m < 2^15), counted afterwards in 4 interleaved tables so that runs of one key do not wait on themselves
  uint8_t* keys = t_nb_j.scratch(n + 64);
  size_t nk = 0, i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i cl = _mm512_loadu_si512(cls + i);
    for (int c = 0; c < 16; ++c) changed[c] += uint64_t(__builtin_popcountll(_mm512_cmpeq_epi8_mask(cl, _mm512_set1_epi8(char(c)))));
    __m128i nb4[4];
    uint64_t some = 0;
    for (int h = 0; h < 2; ++h) {
      const __m512i m = _mm512_srli_epi16(_mm512_loadu_si512(v + i + 32 * h), 1);
      some |= uint64_t(_mm512_test_epi16_mask(m, m)) << (32 * h);
      for (int q = 0; q < 2; ++q) {
        const __m512i w = _mm512_cvtepu16_epi32(q ? _mm512_extracti64x4_epi64(m, 1) : _mm512_castsi512_si256(m));
        nb4[2 * h + q] = _mm512_cvtepi32_epi8(_mm512_sub_epi32(_mm512_set1_epi32(32), _mm512_lzcnt_epi32(w)));
      }
    }
    const __m512i nb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(nb4[1], nb4[0])),
                                          _mm256_set_m128i(nb4[3], nb4[2]), 1);
    compress_bytes64(keys + nk, some, _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(cl, _mm512_set1_epi8(15)), 4), nb));
    nk += size_t(__builtin_popcountll(some));
  }
  uint32_t t[4][256] = {};
  size_t k = 0;
  for (; k + 4 <= nk; k += 4) {
    t[0][keys[k]]++;
    t[1][keys[k + 1]]++;
    t[2][keys[k + 2]]++;
    t[3][keys[k + 3]]++;
  }
  for (; k < nk; ++k) t[0][keys[k]]++;
  uint64_t nz[16] = {};
  for (int c = 0; c < 16; ++c)
    for (int b = 1; b < 16; ++b) {
      const uint64_t x = uint64_t(t[0][16 * c + b]) + t[1][16 * c + b] + t[2][16 * c + b] + t[3][16 * c + b];
      hist[c][b] += x;
      nz[c] += x;
    }
  for (int c = 0; c < 16; ++c) hist[c][0] += changed[c] - nz[c];
  for (; i < n; ++i) {
    changed[cls[i]]++;
    const uint32_t m = v[i] >> 1;
    hist[cls[i]][m ? 32 - __builtin_clz(m) : 0]++;
  }
}

// The node probabilities of rows 0..3 (the trees of 16-bit dtypes) as permute tables: row r holds, at index
// c * 2^r + j, node 2^r + j of class c; a row's lookup is 1, 1, 2 or 4 two-table permutes instead of a gather.
struct RowTables {
  __m512i t[15];  // row 0: t[0]; row 1: t[1..2]; row 2: t[3..6]; row 3: t[7..14]
  SYNCD_512 explicit RowTables(const ValueTrees& lv) {
    alignas(64) uint32_t flat[240];
    for (int r = 0, at = 0; r < 4; at += 16 << r, ++r)
      for (int c = 0; c < 16; ++c)
        for (int j = 0; j < (1 << r); ++j) flat[at + c * (1 << r) + j] = lv.node[c][(1 << r) + j];
    for (int i = 0; i < 15; ++i) t[i] = _mm512_load_si512(flat + 16 * i);
  }
  // probabilities of the lanes of row r (0..3): class c16, node u (2^r .. 2^(r+1) - 1)
  SYNCD_512 __attribute__((always_inline)) inline __m512i at(int r, __m512i c16, __m512i u) const {
    const __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(c16, r), _mm512_sub_epi32(u, _mm512_set1_epi32(1 << r)));
    switch (r) {
      case 0: return _mm512_permutexvar_epi32(c16, t[0]);
      case 1: return _mm512_permutex2var_epi32(t[1], idx, t[2]);
      case 2: {
        const __m512i a = _mm512_permutex2var_epi32(t[3], idx, t[4]), b = _mm512_permutex2var_epi32(t[5], idx, t[6]);
        return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), a, b);
      }
      default: {
        const __m512i a = _mm512_permutex2var_epi32(t[7], idx, t[8]), b = _mm512_permutex2var_epi32(t[9], idx, t[10]);
        const __m512i c = _mm512_permutex2var_epi32(t[11], idx, t[12]), d = _mm512_permutex2var_epi32(t[13], idx, t[14]);
        const __m512i ab = _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), a, b);
        const __m512i cd = _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), c, d);
        return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(64)), ab, cd);
      }
    }
  }
};

// Appends the mantissa bits of m_j[0..nj) (J order) to `mant`, 16 values at a time: neighbours' bits are
// joined in the vector (16 values of <= 14 bits, 8 of <= 28, 4 of <= 56), then 4 puts.
SYNCD_512 void append_mantissa(const uint16_t* m_j, size_t nj, std::vector<uint8_t>& mant) {
  const size_t at0 = mant.size();
  mant.resize(at0 + 2 * nj + 8);
  RawBits w{mant.data() + at0};
  const __m512i one = _mm512_set1_epi32(1), low32 = _mm512_set1_epi64(0xFFFFFFFF);
  const __m512i odd = _mm512_set_epi64(0, 7, 0, 5, 0, 3, 0, 1);  // lane 2k takes lane 2k + 1
  size_t t = 0;
  for (; t + kLanes <= nj; t += kLanes) {
    const __m512i m = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m_j + t)));
    const __m512i len = _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(_mm512_or_si512(m, one)));
    const __m512i bits = _mm512_and_si512(m, _mm512_sub_epi32(_mm512_sllv_epi32(one, len), one));
    const __m512i len_lo = _mm512_and_si512(len, low32);
    const __m512i b1 = _mm512_or_si512(_mm512_and_si512(bits, low32), _mm512_sllv_epi64(_mm512_srli_epi64(bits, 32), len_lo));
    const __m512i l1 = _mm512_add_epi64(len_lo, _mm512_srli_epi64(len, 32));
    const __m512i b2 = _mm512_or_si512(b1, _mm512_sllv_epi64(_mm512_permutexvar_epi64(odd, b1), l1));
    const __m512i l2 = _mm512_add_epi64(l1, _mm512_permutexvar_epi64(odd, l1));
    alignas(64) uint64_t bb[8], ll[8];
    _mm512_store_si512(bb, b2);
    _mm512_store_si512(ll, l2);
    for (int k = 0; k < 8; k += 2) w.put(bb[k], uint32_t(ll[k]));
  }
  for (; t < nj; ++t) {
    const uint32_t mt = m_j[t], len = mantissa_len16(mt);
    w.put(mt & ((1u << len) - 1), len);
  }
  mant.resize(size_t(w.end() - mant.data()));
}

// One step of the value streams, backwards (rows bottom up), its GV groups interleaved.
template <int GV>
SYNCD_512 inline void encode_step(size_t s0, size_t nj, const uint8_t* cls_j, const uint8_t* nb_j,
                                  const RowTables& rt, __m512i dtab, BinGroupEncoder* venc) {
  const __m512 two = _mm512_set1_ps(2.0f);
  const __m512i one16 = _mm512_set1_epi32(1 << 16), onev = _mm512_set1_epi32(1);
  __m512i c16[GV], nb[GV], depth[GV], path[GV], x[GV];
  __mmask16 live[GV];
  int top = 0;
  for (int g = 0; g < GV; ++g) {
    const size_t lo = s0 + size_t(g) * kLanes;
    live[g] = lo >= nj ? 0 : nj - lo >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (nj - lo)) - 1);
    const size_t at = lo < nj ? lo : 0;
    c16[g] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live[g], cls_j + at));
    nb[g] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live[g], nb_j + at));
    depth[g] = _mm512_maskz_permutexvar_epi32(live[g], c16[g], dtab);
    path[g] = _mm512_or_si512(_mm512_sllv_epi32(onev, depth[g]), nb[g]);  // the leaf: 2^depth + nb
    top = std::max(top, _mm512_reduce_max_epi32(depth[g]));
    x[g] = _mm512_loadu_si512(venc[g].x);
  }
  for (int r = top - 1; r >= 0; --r) {  // rows bottom up
    const __m512i rr = _mm512_set1_epi32(r);
    for (int g = 0; g < GV; ++g) {
      const __mmask16 active = _mm512_cmpgt_epi32_mask(depth[g], rr);
      if (!active) continue;
      const __m512i sh = _mm512_sub_epi32(depth[g], rr);  // node at row r: the leaf's top r + 1 bits
      const __m512i u = _mm512_srlv_epi32(path[g], sh);
      const __mmask16 bit = _mm512_mask_test_epi32_mask(active, _mm512_srlv_epi32(path[g], _mm512_sub_epi32(sh, onev)), onev);
      const __m512i p1 = rt.at(r, c16[g], u);
      const __m512i f = _mm512_mask_blend_epi32(bit, _mm512_sub_epi32(one16, p1), p1);
      // 1 / f: rcp14 and one Newton step (relative error ~2^-23, within what enc_step's correction allows)
      const __m512 ff = _mm512_cvtepu32_ps(_mm512_mask_mov_epi32(onev, active, f));
      const __m512 r14 = _mm512_rcp14_ps(ff);
      const __m512 inv = _mm512_mul_ps(r14, _mm512_fnmadd_ps(ff, r14, two));
      enc_step(x[g], active, bit, p1, inv, venc[g].w);
    }
  }
  for (int g = 0; g < GV; ++g) _mm512_storeu_si512(venc[g].x, x[g]);
}

SYNCD_512 void encode_values(const uint8_t* cls, const uint16_t* v, size_t n, const ValueTrees& lv,
                             BinGroupEncoder* venc, int gv, std::vector<uint8_t>& mant, uint8_t* signs) {
  uint8_t* cls_j = t_cls_j.scratch(n + 64);
  uint8_t* nb_j = t_nb_j.scratch(n + 64);
  uint16_t* m_j = t_m_j.scratch(n + 64);
  size_t start[17];
  const size_t nj = select_j(cls, v, n, JBuckets(lv), cls_j, nb_j, m_j, start);
  const __m512i dtab = _mm512_loadu_si512(lv.depth);
  const RowTables rt(lv);
  const size_t step = size_t(kLanes) * std::max(gv, 1);
  for (size_t s0 = gv ? (nj + step - 1) / step * step : 0; s0 > 0;) {
    s0 -= step;
    switch (gv) {
      case 1: encode_step<1>(s0, nj, cls_j, nb_j, rt, dtab, venc); break;
      case 2: encode_step<2>(s0, nj, cls_j, nb_j, rt, dtab, venc); break;
      case 3: encode_step<3>(s0, nj, cls_j, nb_j, rt, dtab, venc); break;
      case 4: encode_step<4>(s0, nj, cls_j, nb_j, rt, dtab, venc); break;
      default:
        for (int g = gv - 1; g >= 0; --g) encode_step<1>(s0 + size_t(g) * kLanes, nj, cls_j, nb_j, rt, dtab, venc + g);
    }
  }
  append_mantissa(m_j, nj, mant);
  const __m512i one = _mm512_set1_epi16(1);
  for (size_t i = 0; i < n; i += 32) {
    const __mmask32 live = n - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n - i)) - 1;
    const uint32_t low = _mm512_mask_test_epi16_mask(live, _mm512_maskz_loadu_epi16(live, v + i), one);
    std::memcpy(signs + i / 8, &low, std::min<size_t>(4, (n - i + 7) / 8));
  }
}

// The mantissa bits, read 16 lanes at a time (a gather of 4 bytes per lane) where at least 4 bytes are left
// past the last one, else lane by lane; every read is bounds-checked.
struct Mantissa {
  const uint8_t* p;
  size_t len;
  const std::string& what;
  uint64_t bit = 0;  // bits consumed

  // m | the next lens[l] (1..63) bits for each lane l in `more`, in lane order
  SYNCD_512 __attribute__((always_inline)) inline __m512i take(__m512i m, __m512i lens, __mmask16 more) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i l = _mm512_maskz_mov_epi32(more, lens);
    __m512i incl = _mm512_add_epi32(l, _mm512_alignr_epi32(l, zero, 15));
    incl = _mm512_add_epi32(incl, _mm512_alignr_epi32(incl, zero, 14));
    incl = _mm512_add_epi32(incl, _mm512_alignr_epi32(incl, zero, 12));
    incl = _mm512_add_epi32(incl, _mm512_alignr_epi32(incl, zero, 8));
    const uint64_t total = uint32_t(_mm_cvtsi128_si32(_mm512_extracti32x4_epi32(_mm512_alignr_epi32(zero, incl, 15), 0)));
    if (total > 8 * uint64_t(len) - bit) fail(what, ": raw-bits stream truncated");
    const uint64_t byte = bit >> 3;
    if (len - byte >= 64 && total <= 448) {
      // every lane's bits lie in the 64 bytes from `byte`: per lane, its 64-bit word of that window and the next,
      // funnel-shifted down to its first bit (two halves of 8 lanes)
      const __m512i win = _mm512_loadu_si512(p + byte);
      const __m512i off = _mm512_add_epi32(_mm512_set1_epi32(int(bit & 7)), _mm512_sub_epi32(incl, l));
      __m512i out[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i o = _mm512_cvtepu32_epi64(h ? _mm512_extracti64x4_epi64(off, 1) : _mm512_castsi512_si256(off));
        const __m512i q = _mm512_srli_epi64(o, 6);
        const __m512i lo = _mm512_permutexvar_epi64(q, win);
        const __m512i hi = _mm512_permutexvar_epi64(_mm512_add_epi64(q, _mm512_set1_epi64(1)), win);
        out[h] = _mm512_shrdv_epi64(lo, hi, _mm512_and_si512(o, _mm512_set1_epi64(63)));
      }
      const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(out[0])), _mm512_cvtepi64_epi32(out[1]), 1);
      const __m512i mask = _mm512_sub_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(1), l), _mm512_set1_epi32(1));
      m = _mm512_or_si512(m, _mm512_and_si512(bits, mask));
      bit += total;
      return m;
    }
    alignas(64) uint32_t mm[kLanes], nl[kLanes];
    _mm512_store_si512(mm, m);
    _mm512_store_si512(nl, l);
    for (uint32_t b = more; b; b &= b - 1) {
      const int lane = __builtin_ctz(b);
      uint64_t x = 0;
      for (uint32_t i = 0; i < nl[lane]; ++i, ++bit) x |= uint64_t(p[bit >> 3] >> (bit & 7) & 1) << i;
      mm[lane] |= uint32_t(x);
    }
    return _mm512_load_si512(mm);
  }
  void finish() const {
    const uint64_t left = 8 * uint64_t(len) - bit;
    if (left >= 8 || (left && (p[len - 1] >> (8 - left))))
      throw DeltaError(what + ": raw-bits stream has unused bits");
  }
};

// The rows of one step of the value streams, its GV groups interleaved (independent chains): writes m of
// each lane (1 << (nb - 1) | its nb - 1 mantissa bits) to m_j.
template <int GV>
SYNCD_512 inline void decode_step(size_t s0, size_t nj, const uint8_t* cls_j, const RowTables& rt, __m512i dtab,
                                  BinGroupDecoder* vdec, Mantissa& mant, uint16_t* m_j) {
  const __m512i onev = _mm512_set1_epi32(1);
  __m512i c16[GV], depth[GV], u[GV], x[GV];
  __mmask16 live[GV];
  int top = 0;
  for (int g = 0; g < GV; ++g) {
    const size_t lo = s0 + size_t(g) * kLanes;
    live[g] = lo >= nj ? 0 : nj - lo >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (nj - lo)) - 1);
    c16[g] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live[g], cls_j + (lo < nj ? lo : 0)));
    depth[g] = _mm512_maskz_permutexvar_epi32(live[g], c16[g], dtab);
    top = std::max(top, _mm512_reduce_max_epi32(depth[g]));
    u[g] = onev;
    x[g] = _mm512_loadu_si512(vdec[g].x);
  }
  for (int r = 0; r < top; ++r) {
    const __m512i rr = _mm512_set1_epi32(r);
    for (int g = 0; g < GV; ++g) {
      const __mmask16 active = _mm512_cmpgt_epi32_mask(depth[g], rr);
      if (!active) continue;
      const __mmask16 bit = dec_step<true>(x[g], active, rt.at(r, c16[g], u[g]), vdec[g].p, vdec[g].end,
                                           vdec[g].what);
      u[g] = _mm512_mask_mov_epi32(u[g], active, _mm512_mask_or_epi32(_mm512_slli_epi32(u[g], 1), bit,
                                                                     _mm512_slli_epi32(u[g], 1), onev));
    }
  }
  for (int g = 0; g < GV; ++g) {
    _mm512_storeu_si512(vdec[g].x, x[g]);
    if (!live[g]) continue;
    const __m512i nb = _mm512_sub_epi32(u[g], _mm512_sllv_epi32(onev, depth[g]));
    const __mmask16 some = _mm512_test_epi32_mask(nb, nb);
    __m512i m = _mm512_maskz_sllv_epi32(some, onev, _mm512_sub_epi32(nb, onev));
    const __mmask16 more = _mm512_cmpgt_epi32_mask(nb, onev);
    if (more) m = mant.take(m, _mm512_sub_epi32(nb, onev), more);  // J order: group by group, lane by lane
    _mm256_mask_storeu_epi16(m_j + s0 + size_t(g) * kLanes, live[g], _mm512_cvtepi32_epi16(m));
  }
}

SYNCD_512 void decode_values(const uint8_t* cls, size_t n, const uint8_t* signs, const ValueTrees& lv,
                             BinGroupDecoder* vdec, int gv, const uint8_t* mant_p, size_t mant_len, uint16_t* v,
                             const std::string& what) {
  uint8_t* cls_j = t_cls_j.scratch(n + 64);
  uint16_t* m_j = t_m_j.scratch(n + 64);
  const JBuckets jb(lv);
  size_t start[17];
  const size_t nj = select_j(cls, nullptr, n, jb, cls_j, nullptr, nullptr, start);
  check_value_groups(gv, nj, what);
  Mantissa mant{mant_p, mant_len, what};
  const __m512i dtab = _mm512_loadu_si512(lv.depth);
  const RowTables rt(lv);  // 16-bit dtypes: trees of at most 4 levels
  const size_t step = size_t(kLanes) * std::max(gv, 1);
  for (size_t s0 = 0; s0 < nj && gv; s0 += step) {
    switch (gv) {
      case 1: decode_step<1>(s0, nj, cls_j, rt, dtab, vdec, mant, m_j); break;
      case 2: decode_step<2>(s0, nj, cls_j, rt, dtab, vdec, mant, m_j); break;
      case 3: decode_step<3>(s0, nj, cls_j, rt, dtab, vdec, mant, m_j); break;
      case 4: decode_step<4>(s0, nj, cls_j, rt, dtab, vdec, mant, m_j); break;
      default:  // more groups than our encoders write: one at a time (same order within each stream)
        for (int g = 0; g < gv; ++g) decode_step<1>(s0 + size_t(g) * kLanes, nj, cls_j, rt, dtab, vdec + g, mant, m_j);
    }
  }
  // every value: its low bit, plus 2m for the changes in J (expanded into place from each bucket's run of m_j)
  const __m512i one = _mm512_set1_epi16(1), bad = _mm512_set1_epi16(-1);
  const __m256i btab = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(jb.of_class)));
  for (size_t i = 0; i < n; i += 32) {
    const __mmask32 live = n - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n - i)) - 1;
    uint32_t low = 0;
    std::memcpy(&low, signs + i / 8, std::min<size_t>(4, (n - i + 7) / 8));
    const __m256i bucket = _mm256_shuffle_epi8(btab, _mm256_maskz_loadu_epi8(live, cls + i));
    __m512i mx = _mm512_setzero_si512();
    for (int k = 1; k <= jb.count; ++k) {
      const __mmask32 mk = _mm256_mask_cmpeq_epi8_mask(live, bucket, _mm256_set1_epi8(char(k)));
      mx = _mm512_or_si512(mx, expand_load32x16(mk, m_j + start[k]));
      start[k] += unsigned(__builtin_popcount(mk));
    }
    const __m512i x = _mm512_or_si512(_mm512_slli_epi16(mx, 1), _mm512_maskz_mov_epi16(__mmask32(low) & live, one));
    if (_mm512_mask_cmpeq_epi16_mask(live, x, bad))
      throw DeltaError(what + ": value change 65535 too wide for the dtype");
    _mm512_mask_storeu_epi16(v + i, live, x);
  }
  mant.finish();
}

}  // namespace avx512_16
}  // namespace syncd

#endif
