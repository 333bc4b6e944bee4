// AVX2 versions of the 16-bit format-2 kernels (v2_kernels.h) for positions, scan and apply (the values:
// v2_values_avx2.cpp): expand and compress are permutes and shuffles from lookup tables. Bit for bit the scalar
// kernels' results; the block samples (e_top, class counts) use the scalar code. Called only when simd_level()
// says the CPU has AVX2.
#include "v2_kernels.h"

#include <algorithm>
#include <cstring>

#include "checksum.h"
#include "codec_core.h"
#include "entropy.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "v2_avx2.h"
#include "v2_rows_avx2.h"

namespace syncd {
namespace avx2_16 {

using namespace detail;

namespace {

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
  // a whole row of the main loop: every lane stepped, the classes packed without a branch on the bits
  SYNCD_256 SYNCD_INLINE void full_row(uint64_t t, State& s, const uint8_t*& p, const uint8_t* e) {
    const Row16 r = k.row(c.old + t * kLanes);
    const uint32_t lo = dec8<true>(s.lo, 0xFF, r.p_lo, p, e, what);
    const uint32_t b = lo | dec8<true>(s.hi, 0xFF, r.p_hi, p, e, what) << 8;
    bitmap[t] = uint16_t(b);
    found += pack_low_bytes(r.cls, b, cls_ch + found);  // writes 16 bytes past found <= n_max at most
    if (__builtin_expect(found > n_max, 0)) fail(what, ": more changes than the block table says");
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
  for (; t < full; t += GP) {
    prefetch_ahead(c.old + t * kLanes, GP * kLanes * 2);
    for (int g = 0; g < GP; ++g) row.full_row(t + g, x[g], p[g], e[g]);
  }
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
  // a whole row of the main loop: every lane stepped (a changed element's class is always coded)
  SYNCD_256 SYNCD_INLINE void full_row(uint64_t t, State& s, uint8_t*& w) {
    const Row16 r = k.row(c.old + t * kLanes);
    const uint32_t bits = bitmap[t];
    enc8<true>(s.hi, 0xFF, bits >> 8, r.p_hi, w);
    enc8<true>(s.lo, 0xFF, bits & 0xFF, r.p_lo, w);
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
  for (uint64_t t = full; t > 0; t -= GP) {
    prefetch_behind(c.old + (t - GP) * kLanes, GP * kLanes * 2);
    for (int g = GP - 1; g >= 0; --g) row.full_row(t - GP + g, x[g], w[g]);
  }
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
    if (j % 2 == 0) {
      prefetch_ahead(op, 64);
      prefetch_ahead(np, 64);
    }
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

namespace {

// Applies the changes of vector j (16 elements, bits: which changed; their values from v16 + *k, *k advanced) and
// returns the checksum terms of its 4 new words, minus those of the 4 old ones with kMinusOld.
template <bool kFloat, bool kForward, bool kMinusOld>
SYNCD_256 SYNCD_INLINE uint64_t apply_vector(uint16_t* target, uint64_t j, uint32_t bits, const uint16_t* v16,
                                             uint64_t* k, uint64_t first_word) {
  const Keys16 kk;
  uint8_t* tp = reinterpret_cast<uint8_t*>(target + 16 * j);
  const __m128i v_lo = shuffle_by(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v16 + *k)), kTab.expand16, bits & 0xFF);
  *k += uint64_t(__builtin_popcount(bits & 0xFF));
  const __m128i v_hi = shuffle_by(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v16 + *k)), kTab.expand16, bits >> 8);
  *k += uint64_t(__builtin_popcount(bits >> 8));
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tp));
  const __m256i u = _mm256_add_epi16(_mm256_set_m128i(v_hi, v_lo), kk.one);
  const __m256i d = _mm256_xor_si256(_mm256_srli_epi16(u, 1), _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_and_si256(u, kk.one)));
  const __m256i ka = kFloat ? kk.key(a) : a;
  const __m256i kb = kForward ? _mm256_add_epi16(ka, d) : _mm256_sub_epi16(ka, d);
  const __m256i lanes = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          int16_t(0x8000));
  const __m256i sel = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(int16_t(bits)), lanes), lanes);
  const __m256i b = _mm256_blendv_epi8(a, kFloat ? kk.unkey(kb) : kb, sel);
  alignas(32) uint64_t before[4], after[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(before), a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(after), b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tp), b);
  uint64_t sum = 0;
  for (int q = 0; q < 4; ++q) {  // an unchanged word adds 0: cheaper than a branch on which words changed
    sum += checksum_term(after[q], first_word + 4 * j + q);
    if (kMinusOld) sum -= checksum_term(before[q], first_word + 4 * j + q);
  }
  return sum;
}

// With every_word (old_sum given: most words change), the terms of every new word, unchanged ones included (no
// branch on which words of a vector changed); else new minus old terms of the vectors with a change only, found
// 16 bitmap entries at a time (a loop over the set bits of a mask, not a branch per vector: whether a vector
// changed is not predictable at a few percent). Returns the sum and sets *k to the changes applied.
template <bool kFloat, bool kForward>
SYNCD_256 uint64_t apply_vectors(uint16_t* target, uint64_t vecs, uint64_t first_word, const uint16_t* bitmap,
                                 const uint16_t* v16, bool every_word, uint64_t* k_out) {
  uint64_t ad = 0, k = 0;
  if (every_word) {
    for (uint64_t j = 0; j < vecs; ++j) {
      const uint32_t bits = bitmap[j];
      if (j % 2 == 0) prefetch_ahead(target + 16 * j, 64);
      if (bits) {
        ad += apply_vector<kFloat, kForward, false>(target, j, bits, v16, &k, first_word);
      } else {
        const uint8_t* tp = reinterpret_cast<const uint8_t*>(target + 16 * j);
        for (int q = 0; q < 4; ++q) ad += checksum_term(load_le64(tp + 8 * q), first_word + 4 * j + q);
      }
    }
  } else {
    const __m256i zero = _mm256_setzero_si256();
    for (uint64_t j0 = 0; j0 < vecs; j0 += 16) {
      uint32_t m;  // bit 2i + 1: entry j0 + i is not zero
      if (vecs - j0 >= 16) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bitmap + j0));
        m = ~uint32_t(_mm256_movemask_epi8(_mm256_cmpeq_epi16(b, zero))) & 0xAAAAAAAAu;
      } else {
        m = 0;
        for (uint64_t i = 0; j0 + i < vecs; ++i) m |= uint32_t(bitmap[j0 + i] != 0) << (2 * i + 1);
      }
      for (; m; m &= m - 1) {
        const uint64_t j = j0 + unsigned(__builtin_ctz(m)) / 2;
        ad += apply_vector<kFloat, kForward, true>(target, j, bitmap[j], v16, &k, first_word);
      }
    }
  }
  *k_out = k;
  return ad;
}

}  // namespace

SYNCD_256 uint64_t apply(uint16_t* target, uint64_t span, uint64_t first_word, const uint16_t* bitmap,
                         const uint16_t* v16, bool is_float, bool forward, const uint64_t* old_sum) {
  const uint64_t vecs = span / 16;
  const bool every_word = old_sum != nullptr;
  uint64_t k = 0;
  const uint64_t ad =
      is_float ? (forward ? apply_vectors<true, true> : apply_vectors<true, false>)(target, vecs, first_word, bitmap, v16, every_word, &k)
               : (forward ? apply_vectors<false, true> : apply_vectors<false, false>)(target, vecs, first_word, bitmap, v16, every_word, &k);
  const uint64_t tail = scalar16::apply(target, span, first_word, bitmap, v16, is_float, forward, vecs * 16, k);
  if (every_word) return ad + scalar16::checksum(target, span, first_word, vecs * 16) - *old_sum;
  return ad + tail;
}

SYNCD_256 void row_contexts(const Classes16& c, uint8_t* ctx) { rows::contexts(c, ctx); }

SYNCD_256 void encode_rows(const Classes16& c, const uint16_t* bitmap, const uint8_t* ctx, const uint32_t* pa,
                           BinGroupEncoder* enc, int gp) {
  rows::encode(c, bitmap, ctx, pa, enc, gp);
}

SYNCD_256 size_t decode_rows(const Classes16& c, const uint32_t* pa, BinGroupDecoder* dec, int gp, uint16_t* bitmap,
                             uint8_t* cls_ch, size_t n_max, const std::string& what, uint64_t first_word,
                             uint64_t* old_sum, uint32_t* flagged, size_t* nflagged) {
  *old_sum = scalar16::checksum(c.old, c.span, first_word, 0);
  return rows::decode(c, pa, dec, gp, bitmap, cls_ch, n_max, what, flagged, nflagged);
}

}  // namespace avx2_16
}  // namespace syncd

#endif
