// AVX2 versions of the 16-bit format-2 kernels (v2_kernels.h): each 16-lane row is two 8-lane halves, lanes
// 0..7 first (the order their renormalisation words are read in); expand and compress are permutes from
// lookup tables; the value rows' node probabilities are gathers. Bit for bit the scalar kernels' results; the
// block samples (e_top, class counts) use the scalar code. Called only when simd_level() says the CPU has AVX2.
#include "v2_kernels.h"

#include <algorithm>
#include <cstring>

#include "checksum.h"
#include "codec_core.h"
#include "entropy.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define SYNCD_256 __attribute__((target("avx2,bmi,bmi2,popcnt")))
#define SYNCD_INLINE __attribute__((always_inline)) inline

namespace syncd {
namespace avx2_16 {

namespace {

// expand[m][l]: for lane l of mask m, the index of its word among the m-lanes (lanes outside m: 0);
// top[m][l]: the lane whose word goes to slot l when the m-lanes are packed into the top popcount(m) slots.
struct Tables {
  alignas(32) int32_t expand[256][8];
  alignas(32) int32_t top[256][8];
  alignas(32) int32_t pack[256][8];  // the m-lanes in order, then lane 0: left-packing permute
  // byte shuffles of 8 16-bit lanes for mask m (-1: a zero byte): pack16 left-packs the m-lanes, expand16
  // puts the k-th of 8 packed values in the k-th m-lane, pack8 left-packs the m-lanes' low bytes
  alignas(16) int8_t pack16[256][16], expand16[256][16], pack8[256][16];
  Tables() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int l = 0; l < 8; ++l) expand[m][l] = (m >> l & 1) ? k++ : 0;
      const int cnt = __builtin_popcount(unsigned(m));
      for (int l = 0; l < 8; ++l) top[m][l] = 0;
      k = 8 - cnt;
      for (int l = 0; l < 8; ++l)
        if (m >> l & 1) top[m][k++] = l;
      k = 0;
      for (int l = 0; l < 8; ++l) pack[m][l] = 0;
      for (int l = 0; l < 8; ++l)
        if (m >> l & 1) pack[m][k++] = l;
      for (int b = 0; b < 16; ++b) pack16[m][b] = expand16[m][b] = pack8[m][b] = -1;
      k = 0;
      for (int l = 0; l < 8; ++l)
        if (m >> l & 1) {
          pack16[m][2 * k] = int8_t(2 * l), pack16[m][2 * k + 1] = int8_t(2 * l + 1);
          expand16[m][2 * l] = int8_t(2 * k), expand16[m][2 * l + 1] = int8_t(2 * k + 1);
          pack8[m][k++] = int8_t(2 * l);
        }
    }
  }
};
const Tables kTab;

[[noreturn]] __attribute__((noinline, cold)) void fail(const std::string& what, const char* msg) {
  throw DeltaError(what + msg);
}

// The classes (16-bit lanes) and probabilities (two 8-lane halves) of the 16 elements at `old`.
struct Row16 {
  __m256i cls, p_lo, p_hi;
};

struct Consts {
  __m256i emask, etop, fifteen, zero, tlo, thi, hibit;
  __m128i shift;
  SYNCD_256 explicit Consts(const Classes16& c)
      : emask(_mm256_set1_epi16(int16_t(c.emask))),
        etop(_mm256_set1_epi16(int16_t(c.e_top))),
        fifteen(_mm256_set1_epi16(15)),
        zero(_mm256_setzero_si256()),
        hibit(_mm256_set1_epi16(int16_t(0x8000))),
        shift(_mm_cvtsi32_si128(c.shift)) {
    alignas(16) uint8_t lo[16], hi[16];
    for (int l = 0; l < 16; ++l) {
      lo[l] = uint8_t(c.p1 ? c.p1[l] : 0);
      hi[l] = uint8_t(c.p1 ? c.p1[l] >> 8 : 0);
    }
    tlo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(lo)));
    thi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(hi)));
  }
  SYNCD_256 SYNCD_INLINE __m256i classes(__m256i w) const {
    const __m256i e = _mm256_and_si256(_mm256_srl_epi16(w, shift), emask);
    return _mm256_min_epi16(_mm256_max_epi16(_mm256_sub_epi16(etop, e), zero), fifteen);
  }
  SYNCD_256 SYNCD_INLINE Row16 row(const uint16_t* old) const {
    const __m256i cls = classes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(old)));
    const __m256i idx = _mm256_or_si256(cls, hibit);  // the high byte of each index zeroes its byte
    const __m256i p = _mm256_or_si256(_mm256_shuffle_epi8(tlo, idx), _mm256_slli_epi16(_mm256_shuffle_epi8(thi, idx), 8));
    return {cls, _mm256_cvtepu16_epi32(_mm256_castsi256_si128(p)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(p, 1))};
  }
};

inline uint32_t live_mask(uint64_t span, uint64_t t) {
  const uint64_t left = span - t * kLanes;
  return left >= kLanes ? 0xFFFFu : (1u << left) - 1;
}

SYNCD_256 SYNCD_INLINE __m256i lane_mask(uint32_t m8) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(m8)), bits), bits);
}

SYNCD_256 SYNCD_INLINE uint32_t mask8(__m256i v) { return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(v))); }

SYNCD_256 SYNCD_INLINE __m128i shuffle_by(__m128i x, const int8_t (&table)[256][16], uint32_t m8) {
  return _mm_shuffle_epi8(x, _mm_load_si128(reinterpret_cast<const __m128i*>(table[m8])));
}

// Appends the low bytes of the m-lanes (bit l of m: 16-bit lane l of x) at out; writes 16 bytes past them at
// most. Returns popcount(m).
SYNCD_256 SYNCD_INLINE uint32_t pack_low_bytes(__m256i x, uint32_t m, uint8_t* out) {
  const uint32_t c0 = uint32_t(__builtin_popcount(m & 0xFF));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), shuffle_by(_mm256_castsi256_si128(x), kTab.pack8, m & 0xFF));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out + c0), shuffle_by(_mm256_extracti128_si256(x, 1), kTab.pack8, m >> 8));
  return c0 + uint32_t(__builtin_popcount(m >> 8));
}

// One decoder step of 8 lanes (coded8: the lanes coded); returns their bits.
SYNCD_256 SYNCD_INLINE uint32_t dec8(__m256i& x, uint32_t coded8, __m256i p1, const uint8_t*& p, const uint8_t* end,
                                     const std::string& what) {
  if (!coded8) return 0;
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF), one16 = _mm256_set1_epi32(1 << 16), zero = _mm256_setzero_si256();
  const __m256i cm = lane_mask(coded8);
  const __m256i slot = _mm256_and_si256(x, lo16);
  const __m256i bitv = _mm256_and_si256(_mm256_cmpgt_epi32(p1, slot), cm);
  const __m256i f = _mm256_blendv_epi8(_mm256_sub_epi32(one16, p1), p1, bitv);
  const __m256i sc = _mm256_sub_epi32(slot, _mm256_andnot_si256(bitv, p1));
  x = _mm256_blendv_epi8(x, _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(x, 16)), sc), cm);
  const __m256i renv = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_srli_epi32(x, 16), zero), cm);
  const uint32_t ren = mask8(renv);
  const unsigned cnt = unsigned(__builtin_popcount(ren));
  __m128i w8;
  if (__builtin_expect(end - p >= 16, 1)) {  // the next 8 words, whether or not this step takes them
    w8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    if (size_t(end - p) < 2 * size_t(cnt)) fail(what, ": binary stream truncated");
    alignas(16) uint8_t tmp[16] = {};
    std::memcpy(tmp, p, 2 * cnt);
    w8 = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
  }
  const __m256i w = _mm256_permutevar8x32_epi32(_mm256_cvtepu16_epi32(w8),
                                                _mm256_load_si256(reinterpret_cast<const __m256i*>(kTab.expand[ren])));
  x = _mm256_blendv_epi8(x, _mm256_or_si256(_mm256_slli_epi32(x, 16), w), renv);
  p += 2 * cnt;
  return mask8(bitv);
}

// One encoder step of 8 lanes, rows going backwards: words are written below w.
SYNCD_256 SYNCD_INLINE void enc8(__m256i& x, uint32_t coded8, uint32_t bits8, __m256i p1, uint8_t*& w) {
  if (!coded8) return;
  const __m256i one16 = _mm256_set1_epi32(1 << 16), zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
  const __m256i sign = _mm256_set1_epi32(int32_t(0x80000000u));
  const __m256i cm = lane_mask(coded8), bitv = lane_mask(bits8 & coded8);
  const __m256i f = _mm256_blendv_epi8(_mm256_sub_epi32(one16, p1), p1, bitv);
  const __m256i cc = _mm256_andnot_si256(bitv, p1);
  // x >= f << 16, unsigned
  const __m256i lt = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_slli_epi32(f, 16), sign), _mm256_xor_si256(x, sign));
  const __m256i emitv = _mm256_andnot_si256(lt, cm);
  const uint32_t emit = mask8(emitv);
  {  // the emitting lanes' low halves, packed into the top slots, stored to end at w
    const __m256i packed = _mm256_permutevar8x32_epi32(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(kTab.top[emit])));
    const __m256i lo = _mm256_shuffle_epi8(packed, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                   0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m128i words = _mm_unpacklo_epi64(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w - 16), words);  // below w is free space (and the states' room)
    w -= 2 * __builtin_popcount(emit);
  }
  const __m256i xs = _mm256_blendv_epi8(x, _mm256_srli_epi32(x, 16), emitv);
  // q = xs / f from a float estimate (xs may pass 2^31: converted halved), exact after one correction each way
  const __m256 xf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(xs, 1)), _mm256_set1_ps(2.0f));
  const __m256i fm = _mm256_blendv_epi8(one, f, cm);
  __m256i q = _mm256_cvttps_epi32(_mm256_div_ps(xf, _mm256_cvtepi32_ps(fm)));
  __m256i r = _mm256_sub_epi32(xs, _mm256_mullo_epi32(q, fm));
  const __m256i neg = _mm256_cmpgt_epi32(zero, r);
  q = _mm256_add_epi32(q, neg);
  r = _mm256_add_epi32(r, _mm256_and_si256(neg, fm));
  const __m256i big = _mm256_cmpgt_epi32(r, _mm256_sub_epi32(fm, one));
  q = _mm256_sub_epi32(q, big);
  r = _mm256_sub_epi32(r, _mm256_and_si256(big, fm));
  x = _mm256_blendv_epi8(x, _mm256_add_epi32(_mm256_slli_epi32(q, 16), _mm256_add_epi32(r, cc)), cm);
}

struct State {
  __m256i lo, hi;
};

// The 16 elements of vector t (fewer in the last, zero-padded).
SYNCD_256 SYNCD_INLINE Row16 row_at(const Consts& k, const Classes16& c, uint64_t t, uint32_t live) {
  if (live == 0xFFFF) return k.row(c.old + t * kLanes);
  alignas(32) uint16_t tmp[16] = {};
  std::memcpy(tmp, c.old + t * kLanes, size_t(__builtin_popcount(live)) * 2);
  return k.row(tmp);
}

SYNCD_256 SYNCD_INLINE uint32_t coded_lanes(const Consts& k, const Row16& r, uint32_t live) {
  return live & ~(mask8(_mm256_cmpeq_epi32(r.p_lo, k.zero)) | mask8(_mm256_cmpeq_epi32(r.p_hi, k.zero)) << 8);
}

struct DecRow {
  const Consts& k;
  const Classes16& c;
  uint16_t* bitmap;
  uint8_t* cls_ch;
  size_t n_max, found;
  const std::string& what;
  SYNCD_256 SYNCD_INLINE void row(uint64_t t, uint32_t live, State& s, const uint8_t*& p, const uint8_t* e) {
    const Row16 r = row_at(k, c, t, live);
    const uint32_t coded = coded_lanes(k, r, live);
    const uint32_t lo = dec8(s.lo, coded & 0xFF, r.p_lo, p, e, what);
    const uint32_t b = lo | dec8(s.hi, coded >> 8, r.p_hi, p, e, what) << 8;
    bitmap[t] = uint16_t(b);
    if (!b) return;
    if (size_t(__builtin_popcount(b)) > n_max - found) fail(what, ": more changes than the block table says");
    found += pack_low_bytes(r.cls, b, cls_ch + found);  // cls_ch has n_max + 64 bytes
  }
};

template <int GP>
SYNCD_256 size_t decode_gp(const Classes16& c, BinGroupDecoder* dec, uint16_t* bitmap, uint8_t* cls_ch, size_t n_max,
                           const std::string& what) {
  const Consts k(c);
  DecRow row{k, c, bitmap, cls_ch, n_max, 0, what};
  State x[GP];
  const uint8_t* p[GP];
  const uint8_t* e[GP];
  for (int g = 0; g < GP; ++g) {
    x[g] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dec[g].x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dec[g].x + 8))};
    p[g] = dec[g].p;
    e[g] = dec[g].end;
  }
  const uint64_t vectors = (c.span + kLanes - 1) / kLanes, full = c.span / kLanes / GP * GP;
  uint64_t t = 0;
  for (; t < full; t += GP)
    for (int g = 0; g < GP; ++g) row.row(t + g, 0xFFFF, x[g], p[g], e[g]);
  for (int g = 0; g < GP; ++g) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dec[g].x), x[g].lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dec[g].x + 8), x[g].hi);
    dec[g].p = p[g];
  }
  for (; t < vectors; ++t) {
    BinGroupDecoder& d = dec[t % GP];
    State s{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d.x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d.x + 8))};
    row.row(t, live_mask(c.span, t), s, d.p, d.end);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d.x), s.lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d.x + 8), s.hi);
  }
  return row.found;
}

struct EncRow {
  const Consts& k;
  const Classes16& c;
  const uint16_t* bitmap;
  SYNCD_256 SYNCD_INLINE void row(uint64_t t, uint32_t live, State& s, uint8_t*& w) {
    const Row16 r = row_at(k, c, t, live);
    const uint32_t coded = coded_lanes(k, r, live), bits = bitmap[t] & coded;
    enc8(s.hi, coded >> 8, bits >> 8, r.p_hi, w);  // backwards: the upper half's words first
    enc8(s.lo, coded & 0xFF, bits & 0xFF, r.p_lo, w);
  }
};

template <int GP>
SYNCD_256 void encode_gp(const Classes16& c, const uint16_t* bitmap, BinGroupEncoder* enc) {
  const Consts k(c);
  EncRow row{k, c, bitmap};
  const uint64_t vectors = (c.span + kLanes - 1) / kLanes, full = c.span / kLanes / GP * GP;
  for (uint64_t t = vectors; t > full; --t) {
    BinGroupEncoder& e = enc[(t - 1) % GP];
    State s{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.x + 8))};
    row.row(t - 1, live_mask(c.span, t - 1), s, e.w);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(e.x), s.lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(e.x + 8), s.hi);
  }
  State x[GP];
  uint8_t* w[GP];
  for (int g = 0; g < GP; ++g) {
    x[g] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(enc[g].x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(enc[g].x + 8))};
    w[g] = enc[g].w;
  }
  for (uint64_t t = full; t > 0; t -= GP)
    for (int g = GP - 1; g >= 0; --g) row.row(t - GP + g, 0xFFFF, x[g], w[g]);
  for (int g = 0; g < GP; ++g) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(enc[g].x), x[g].lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(enc[g].x + 8), x[g].hi);
    enc[g].w = w[g];
  }
}

struct Keys16 {
  __m256i sign, one, ones;
  SYNCD_256 Keys16() : sign(_mm256_set1_epi16(int16_t(0x8000))), one(_mm256_set1_epi16(1)), ones(_mm256_set1_epi16(-1)) {}
  SYNCD_256 SYNCD_INLINE __m256i key(__m256i a) const {
    return _mm256_xor_si256(a, _mm256_or_si256(_mm256_srai_epi16(a, 15), sign));
  }
  SYNCD_256 SYNCD_INLINE __m256i unkey(__m256i k) const {
    return _mm256_xor_si256(k, _mm256_or_si256(_mm256_andnot_si256(_mm256_srai_epi16(k, 15), ones), sign));
  }
};

}  // namespace

SYNCD_256 size_t decode_positions(const Classes16& c, BinGroupDecoder* dec, int gp, uint16_t* bitmap, uint8_t* cls_ch,
                                  size_t n_max, const std::string& what, uint64_t first_word, uint64_t* old_sum) {
  *old_sum = scalar16::checksum(c.old, c.span, first_word, 0);
  switch (gp) {
    case 1: return decode_gp<1>(c, dec, bitmap, cls_ch, n_max, what);
    case 2: return decode_gp<2>(c, dec, bitmap, cls_ch, n_max, what);
    case 3: return decode_gp<3>(c, dec, bitmap, cls_ch, n_max, what);
    case 4: return decode_gp<4>(c, dec, bitmap, cls_ch, n_max, what);
    default: return scalar16::decode_positions(c, dec, gp, bitmap, cls_ch, n_max, what);
  }
}

SYNCD_256 void encode_positions(const Classes16& c, const uint16_t* bitmap, BinGroupEncoder* enc, int gp) {
  switch (gp) {
    case 1: return encode_gp<1>(c, bitmap, enc);
    case 2: return encode_gp<2>(c, bitmap, enc);
    case 3: return encode_gp<3>(c, bitmap, enc);
    case 4: return encode_gp<4>(c, bitmap, enc);
    default: return scalar16::encode_positions(c, bitmap, enc, gp);
  }
}

SYNCD_256 uint64_t scan(const Classes16& c, const uint16_t* nw, uint64_t first_word, bool is_float, uint16_t* bitmap,
                        uint16_t* v16, uint8_t* cls_ch, uint64_t* sum_old, uint64_t* adj) {
  const Keys16 kk;
  const Consts k(c);
  const uint64_t vecs = c.span / 16;
  uint64_t so = 0, ad = 0, kch = 0;
  for (uint64_t j = 0; j < vecs; ++j) {
    const uint8_t* op = reinterpret_cast<const uint8_t*>(c.old + 16 * j);
    const uint8_t* np = reinterpret_cast<const uint8_t*>(nw + 16 * j);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(op));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(np));
    for (int q = 0; q < 4; ++q) so += checksum_term(load_le64(op + 8 * q), first_word + 4 * j + q);
    const uint32_t eq = uint32_t(_mm256_movemask_epi8(_mm256_cmpeq_epi16(a, b)));
    const uint32_t ne = _pext_u32(~eq, 0x55555555u);
    bitmap[j] = uint16_t(ne);
    if (!ne) continue;
    for (int q = 0; q < 4; ++q) {
      if (!((ne >> (4 * q)) & 0xF)) continue;
      const uint64_t wa = load_le64(op + 8 * q), wb = load_le64(np + 8 * q);
      ad += checksum_term(wb, first_word + 4 * j + q) - checksum_term(wa, first_word + 4 * j + q);
    }
    const __m256i ka = is_float ? kk.key(a) : a, kb = is_float ? kk.key(b) : b;
    const __m256i d = _mm256_sub_epi16(kb, ka);
    const __m256i v = _mm256_sub_epi16(_mm256_xor_si256(_mm256_slli_epi16(d, 1), _mm256_srai_epi16(d, 15)), kk.one);
    const uint32_t c0 = uint32_t(__builtin_popcount(ne & 0xFF));  // left-packed: 16 entries past kch written
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v16 + kch), shuffle_by(_mm256_castsi256_si128(v), kTab.pack16, ne & 0xFF));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v16 + kch + c0),
                     shuffle_by(_mm256_extracti128_si256(v, 1), kTab.pack16, ne >> 8));
    kch += pack_low_bytes(k.classes(a), ne, cls_ch + kch);
  }
  *sum_old = so;
  *adj = ad;
  return scalar16::scan(c, nw, first_word, is_float, bitmap, v16, cls_ch, sum_old, adj, vecs * 16, kch);
}

SYNCD_256 uint64_t apply(uint16_t* target, uint64_t span, uint64_t first_word, const uint16_t* bitmap,
                         const uint16_t* v16, bool is_float, bool forward, const uint64_t*) {
  const Keys16 kk;
  const uint64_t vecs = span / 16;
  uint64_t ad = 0, k = 0;
  for (uint64_t j = 0; j < vecs; ++j) {
    const uint32_t bits = bitmap[j];
    if (!bits) continue;
    uint8_t* tp = reinterpret_cast<uint8_t*>(target + 16 * j);
    const __m128i v_lo = shuffle_by(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v16 + k)), kTab.expand16, bits & 0xFF);
    k += uint64_t(__builtin_popcount(bits & 0xFF));
    const __m128i v_hi = shuffle_by(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v16 + k)), kTab.expand16, bits >> 8);
    k += uint64_t(__builtin_popcount(bits >> 8));
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tp));
    const __m256i u = _mm256_add_epi16(_mm256_set_m128i(v_hi, v_lo), kk.one);
    const __m256i d = _mm256_xor_si256(_mm256_srli_epi16(u, 1), _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_and_si256(u, kk.one)));
    const __m256i ka = is_float ? kk.key(a) : a;
    const __m256i kb = forward ? _mm256_add_epi16(ka, d) : _mm256_sub_epi16(ka, d);
    const __m256i lanes = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                            int16_t(0x8000));
    const __m256i sel = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(int16_t(bits)), lanes), lanes);
    const __m256i b = _mm256_blendv_epi8(a, is_float ? kk.unkey(kb) : kb, sel);
    uint64_t before[4];
    std::memcpy(before, tp, 32);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tp), b);
    for (int q = 0; q < 4; ++q) {
      if (!((bits >> (4 * q)) & 0xF)) continue;
      ad += checksum_term(load_le64(tp + 8 * q), first_word + 4 * j + q) - checksum_term(before[q], first_word + 4 * j + q);
    }
  }
  return ad + scalar16::apply(target, span, first_word, bitmap, v16, is_float, forward, vecs * 16, k);
}

// ---- values: the rows of 16 J entries as two 8-lane halves. A half's classes, depths and leaves are vectors;
// a row's node probabilities are one masked gather from lv.node.

namespace {

thread_local std::vector<uint32_t> t_jidx;
thread_local std::vector<uint8_t> t_cls_j;
thread_local std::vector<uint16_t> t_m_j;

template <class T>
T* sized(std::vector<T>& b, size_t n) {
  if (b.size() < n) b.resize(n);
  return b.data();
}

struct DepthTables {
  __m256i lo, hi;
  SYNCD_256 explicit DepthTables(const ValueTrees& lv)
      : lo(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv.depth))),
        hi(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lv.depth + 8))) {}
  SYNCD_256 SYNCD_INLINE __m256i of(__m256i cl) const {  // classes (32-bit lanes, < 16) -> their trees' depths
    const __m256i a = _mm256_permutevar8x32_epi32(lo, cl), b = _mm256_permutevar8x32_epi32(hi, cl);
    const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(cl, 28));  // bit 3 of the class picks hi
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), high));
  }
};

// The J entries (changes of classes with a value tree), 8 at a time by a left-packing permute: their indices
// (jidx, room for n + 8), classes and (with v) m = v >> 1 (cls_j, m_j: room for n + 16), the last two padded
// with 16 zero entries.
SYNCD_256 size_t select_j(const uint8_t* cls, const uint16_t* v, size_t n, const DepthTables& dt, uint32_t* jidx,
                          uint8_t* cls_j, uint16_t* m_j) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), zero = _mm256_setzero_si256();
  size_t nj = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i cl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cls + i)));
    const uint32_t jm = mask8(_mm256_cmpgt_epi32(dt.of(cl), zero));
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
  alignas(32) int32_t dtab[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(dtab), dt.lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(dtab + 8), dt.hi);
  for (; i < n; ++i) {
    jidx[nj] = uint32_t(i);
    cls_j[nj] = cls[i];
    if (v) m_j[nj] = uint16_t(v[i] >> 1);
    nj += dtab[cls[i]] != 0;
  }
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

// The mantissa bits of one group's lanes (J entries lo .. lo + width), in J order: one read per 4 lanes
// (<= 4 * 14 bits); nb[l] is lane l's bit length (0 past width).
SYNCD_256 SYNCD_INLINE void read_mantissa(const uint32_t* nb, int width, const uint32_t* jidx, BitReader& mant,
                                          uint16_t* v, const std::string& what) {
  for (int l = 0; l < width; l += 4) {
    uint32_t len[4], total = 0;
    for (int q = 0; q < 4; ++q) total += len[q] = nb[l + q] ? nb[l + q] - 1 : 0;
    uint64_t bits = mant.read(total);
    for (int q = 0; q < 4 && l + q < width; ++q) {
      const uint32_t m = (nb[l + q] ? 1u << len[q] : 0) | uint32_t(bits & ((uint64_t(1) << len[q]) - 1));
      bits >>= len[q];
      const uint32_t xv = (m << 1) | v[jidx[l + q]];
      if (xv > 0xFFFE) fail(what, ": value change 65535 too wide for the dtype");
      v[jidx[l + q]] = uint16_t(xv);
    }
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
    alignas(32) uint32_t nb[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(nb), _mm256_sub_epi32(u0[g], _mm256_sllv_epi32(one, h0[g].d)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(nb + 8), _mm256_sub_epi32(u1[g], _mm256_sllv_epi32(one, h1[g].d)));
    read_mantissa(nb, gs[g].width, jidx + gs[g].lo, mant, v, what);
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
  uint32_t* jidx = sized(t_jidx, n + 8);
  uint8_t* cls_j = sized(t_cls_j, n + kLanes);
  const DepthTables dt(lv);
  const size_t nj = select_j(cls, nullptr, n, dt, jidx, cls_j, nullptr);
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
  uint32_t* jidx = sized(t_jidx, n + 8);
  uint8_t* cls_j = sized(t_cls_j, n + kLanes);
  uint16_t* m_j = sized(t_m_j, n + kLanes);
  const DepthTables dt(lv);
  const size_t nj = select_j(cls, v, n, dt, jidx, cls_j, m_j);
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
