// Native CPU NVFP4 kernels: amax, quantize and dequantize over blocks of 16 elements, on all cores, with an
// AVX-512 path (one block is one 512-bit vector of floats) and a portable scalar path that computes the same
// bits. Built with -ffp-contract=off (CMakeLists.txt): the arithmetic must stay the reference's.
#include "nvfp4.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SYNCD_NO_MULTIVERSION)
#define SYNCD_NVFP4_AVX512 1
#include <immintrin.h>
// GCC 12 warns about the unused merge operands of the AVX-512 intrinsics (_mm512_undefined_*): a false positive
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace syncd {
namespace nvfp4 {

namespace {

constexpr size_t kChunkBlocks = 1 << 14;  // blocks per work item (256 Ki elements)

size_t itemsize(int dtype_code) {
  switch (dtype_code) {
    case kBF16:
    case kF16:
      return 2;
    case kF32:
      return 4;
    default:
      throw std::invalid_argument("NVFP4: unsupported dtype code " + std::to_string(dtype_code) +
                                  " (bfloat16, float16 or float32)");
  }
}

inline float load_scalar(const uint8_t* p, size_t i, int dtype_code) {
  if (dtype_code == kF32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return dtype_code == kBF16 ? bf16_value(h) : f16_value(h);
}

inline void store_scalar(uint8_t* p, size_t i, int dtype_code, float v) {
  if (dtype_code == kF32) {
    std::memcpy(p + 4 * i, &v, 4);
    return;
  }
  uint16_t h = dtype_code == kBF16 ? bf16_bits(v) : f16_bits(v);
  std::memcpy(p + 2 * i, &h, 2);
}

// ---- scalar kernels (the portable path; also the tail of nothing: blocks are whole)

AmaxResult amax_scalar(const uint8_t* x, size_t begin, size_t end, int dt) {
  float m = 0.0f;
  bool bad = false;
  for (size_t i = begin; i < end; ++i) {
    uint32_t a = f2u(load_scalar(x, i, dt)) & 0x7FFFFFFFu;
    bad |= a >= 0x7F800000u;
    float v = u2f(a);
    m = v > m ? v : m;
  }
  return {m, bad};
}

bool quantize_scalar(const uint8_t* x, size_t b0, size_t b1, int dt, GlobalScales g, uint8_t* q, uint8_t* s) {
  bool bad = false;
  float v[kBlock];
  for (size_t b = b0; b < b1; ++b) {
    float vmax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      v[i] = load_scalar(x, b * kBlock + i, dt);
      uint32_t a = f2u(v[i]) & 0x7FFFFFFFu;
      bad |= a >= 0x7F800000u;
      vmax = u2f(a) > vmax ? u2f(a) : vmax;
    }
    uint8_t sc = block_scale_code(vmax, g.gs);
    float os = output_scale(e4m3_value(sc), g.rgs);
    s[b] = sc;
    for (int j = 0; j < kBlock / 2; ++j)
      q[b * 8 + j] = static_cast<uint8_t>(e2m1_code(mul_rn(v[2 * j], os)) | (e2m1_code(mul_rn(v[2 * j + 1], os)) << 4));
  }
  return bad;
}

void dequantize_scalar(const uint8_t* q, const uint8_t* s, size_t b0, size_t b1, float pts, uint8_t* out, int dt) {
  for (size_t b = b0; b < b1; ++b) {
    float scale = mul_rn(e4m3_value(s[b]), pts);
    for (int j = 0; j < kBlock / 2; ++j) {
      uint8_t byte = q[b * 8 + j];
      store_scalar(out, b * kBlock + 2 * j, dt, mul_rn(e2m1_value(byte & 0xFu), scale));
      store_scalar(out, b * kBlock + 2 * j + 1, dt, mul_rn(e2m1_value(byte >> 4), scale));
    }
  }
}

// ---- AVX-512 kernels

#ifdef SYNCD_NVFP4_AVX512
#define SYNCD_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

SYNCD_AVX512 inline __m512 load16(const uint8_t* p, int dt) {
  if (dt == kF32) return _mm512_loadu_ps(p);
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (dt == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
  return _mm512_cvtph_ps(h);
}

// Largest magnitude, comparing magnitudes as unsigned integers of the element's own width (for non-negative
// floats the order is the same; NaN and infinity have the largest patterns, so the maximum also tells
// whether one is present). 16-bit types stay 16-bit: 32 elements per instruction.
SYNCD_AVX512 AmaxResult amax_avx512(const uint8_t* x, size_t begin, size_t end, int dt) {
  size_t i = begin;
  uint32_t m = 0;  // magnitude bits of the element type
  if (dt == kF32) {
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
    for (; i + 32 <= end; i += 32) {
      m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(x + 4 * i), absmask));
      m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(x + 4 * (i + 16)), absmask));
    }
    m = _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
  } else {
    const __m512i absmask = _mm512_set1_epi16(0x7FFF);
    __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
    for (; i + 64 <= end; i += 64) {
      m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_loadu_si512(x + 2 * i), absmask));
      m1 = _mm512_max_epu16(m1, _mm512_and_si512(_mm512_loadu_si512(x + 2 * (i + 32)), absmask));
    }
    __m512i mm = _mm512_max_epu16(m0, m1);  // widen the 32 halves to 32-bit lanes and reduce
    m = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(mm)),
                                                 _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(mm, 1))));
  }
  float mf;
  bool bad;
  if (dt == kF32) {
    mf = u2f(m);
    bad = m >= 0x7F800000u;
  } else if (dt == kBF16) {
    mf = bf16_value(static_cast<uint16_t>(m));
    bad = m >= 0x7F80u;
  } else {
    mf = f16_value(static_cast<uint16_t>(m));
    bad = m >= 0x7C00u;
  }
  AmaxResult tail = amax_scalar(x, i, end, dt);
  return {tail.amax > mf ? tail.amax : mf, bad || tail.nonfinite};
}

// Lane l of the result = max over the 16 lanes of a[l] (as unsigned integers): a 16x16 transpose-reduce.
SYNCD_AVX512 inline __m512i max16(const __m512i (&a)[16]) {
  __m512i m[8], n[4];
  for (int k = 0; k < 8; ++k)  // 256-bit halves: m[k] = [a[2k] (8 partials), a[2k+1] (8 partials)]
    m[k] = _mm512_max_epu32(_mm512_shuffle_i32x4(a[2 * k], a[2 * k + 1], 0x44),
                            _mm512_shuffle_i32x4(a[2 * k], a[2 * k + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // 128-bit lanes: n[j] = [a[4j], a[4j+1], a[4j+2], a[4j+3]] (4 partials each)
    n[j] = _mm512_max_epu32(_mm512_shuffle_i32x4(m[2 * j], m[2 * j + 1], 0x88),
                            _mm512_shuffle_i32x4(m[2 * j], m[2 * j + 1], 0xDD));
  // within each 128-bit lane k: a 4x4 transpose of (n0, n1, n2, n3) and a max
  __m512i w0 = _mm512_max_epu32(_mm512_unpacklo_epi32(n[0], n[1]), _mm512_unpackhi_epi32(n[0], n[1]));
  __m512i w1 = _mm512_max_epu32(_mm512_unpacklo_epi32(n[2], n[3]), _mm512_unpackhi_epi32(n[2], n[3]));
  __m512i r = _mm512_max_epu32(_mm512_unpacklo_epi64(w0, w1), _mm512_unpackhi_epi64(w0, w1));
  // lane 4k + t holds a[4t + k]: put it at lane 4t + k
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// e4m3_code / e4m3_value / output_scale of nvfp4.h on 16 lanes (the same operations)
SYNCD_AVX512 inline __m512i e4m3_code16(__m512 v) {
  v = _mm512_min_ps(v, _mm512_set1_ps(kE4M3Max));
  __m512i b = _mm512_castps_si512(v);
  __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(v, _mm512_set1_ps(16384.0f))),
                                 _mm512_set1_epi32(0x46800000));
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 20), _mm512_set1_epi32(1));
  __m512i nrm = _mm512_sub_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFFF)), odd), 20),
      _mm512_set1_epi32(960));
  return _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(b, _mm512_set1_epi32(121 << 23)), nrm, sub);
}

SYNCD_AVX512 inline __m512 e4m3_value16(__m512i c) {
  __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(0.001953125f));
  __m512i nrm = _mm512_or_si512(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_srli_epi32(c, 3), _mm512_set1_epi32(120)), 23),
      _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(7)), 20));
  return _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(c, _mm512_set1_epi32(8)), _mm512_castsi512_ps(nrm), sub);
}

// the 8 packed code bytes of one block: v * os rounded to E2M1 (the same codes as e2m1_code), element 2j in
// the low nibble. With a = min(|v * os|, 6): below 2 the grid step is 0.5, below 4 it is 1, then 2, so the
// magnitude index is RNE(2a), 2 + RNE(a) or 4 + RNE(a / 2) -- power-of-two products are exact and the
// integer conversion rounds to nearest even. (Constants are rebuilt per call; inlined, they are hoisted.)
SYNCD_AVX512 inline void codes16(__m512 v, __m512 os, uint8_t* q) {
  __m512i si = _mm512_castps_si512(_mm512_mul_ps(v, os));
  __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(si, _mm512_set1_epi32(0x7FFFFFFF))),
                           _mm512_set1_ps(6.0f));
  __mmask16 lt4 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_LT_OQ);
  __mmask16 lt2 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_LT_OQ);
  __m512 m = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_set1_ps(0.5f), lt4, _mm512_set1_ps(1.0f)), lt2,
                                _mm512_set1_ps(2.0f));
  __m512i off = _mm512_mask_mov_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(4), lt4, _mm512_set1_epi32(2)), lt2,
                                      _mm512_setzero_si512());
  __m512i mag = _mm512_add_epi32(_mm512_cvt_roundps_epi32(_mm512_mul_ps(a, m), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), off);
  // code = mag | (sign bit >> 28 & 8)   (ternary logic 0xF8: A | (B & C))
  __m512i code = _mm512_ternarylogic_epi32(mag, _mm512_srli_epi32(si, 28), _mm512_set1_epi32(8), 0xF8);
  // lanes (2j, 2j+1) are the low and high halves of 64-bit lane j: the low byte of (w | w >> 28) is lo | hi << 4
  __m512i packed = _mm512_or_si512(code, _mm512_srli_epi64(code, 28));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm512_cvtepi64_epi8(packed));
}

// Magnitude bits of one block's 16 elements, zero-extended to 32-bit lanes: for float32 the float's own bits,
// for 16-bit types the 16-bit pattern (integer order = magnitude order either way; see mag_to_float16).
template <int DT>
SYNCD_AVX512 inline __m512i magnitudes16(const uint8_t* p) {
  if constexpr (DT == kF32) return _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(0x7FFFFFFF));
  __m256i h = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi16(0x7FFF));
  return _mm512_maskz_cvtepu16_epi32(0xFFFF, h);
}

// float values of 16 lanes of magnitudes16 patterns, and whether one is NaN or infinite
template <int DT>
SYNCD_AVX512 inline __m512 mag_to_float16(__m512i m, __mmask16& bad) {
  if constexpr (DT == kF32) {
    bad |= _mm512_cmpge_epu32_mask(m, _mm512_set1_epi32(0x7F800000));
    return _mm512_castsi512_ps(m);
  } else if constexpr (DT == kBF16) {
    bad |= _mm512_cmpge_epu32_mask(m, _mm512_set1_epi32(0x7F80));
    return _mm512_castsi512_ps(_mm512_slli_epi32(m, 16));
  } else {
    bad |= _mm512_cmpge_epu32_mask(m, _mm512_set1_epi32(0x7C00));
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(m));
  }
}

template <int DT>
SYNCD_AVX512 inline __m512 load16t(const uint8_t* p) {
  if constexpr (DT == kF32) return _mm512_loadu_ps(p);
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (DT == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
  return _mm512_cvtph_ps(h);
}

template <int DT>
SYNCD_AVX512 bool quantize_avx512_t(const uint8_t* x, size_t b0, size_t b1, GlobalScales g, uint8_t* q, uint8_t* s) {
  constexpr size_t stride = kBlock * (DT == kF32 ? 4 : 2);
  const __m512 gs = _mm512_set1_ps(g.gs), rgs = _mm512_set1_ps(g.rgs), sixth = _mm512_set1_ps(kSixth),
               onef = _mm512_set1_ps(1.0f);
  __mmask16 bad = 0;
  size_t b = b0;
  // 16 blocks at a time: the block maxima and the scale arithmetic run as one vector of 16 blocks; then the
  // blocks are read again (from L1) to round their elements
  for (; b + 16 <= b1; b += 16) {
    const uint8_t* p = x + b * stride;
    // four groups ahead (a prefetch never faults, also past the end): +15% on one thread in bench/nvfp4.py
    for (size_t l = 0; l < 16 * stride; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + 4 * 16 * stride + l), _MM_HINT_T0);
    __m512i a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) a[i] = magnitudes16<DT>(p + i * stride);
    __m512 vmax = mag_to_float16<DT>(max16(a), bad);
    __m512i code = e4m3_code16(_mm512_mul_ps(gs, _mm512_mul_ps(vmax, sixth)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s + b), _mm512_cvtepi32_epi8(code));
    __m512 sf = e4m3_value16(code);
    alignas(64) float os[16];
    _mm512_store_ps(os, _mm512_maskz_div_ps(_mm512_cmpneq_ps_mask(sf, _mm512_setzero_ps()), onef, _mm512_mul_ps(sf, rgs)));
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) codes16(load16t<DT>(p + i * stride), _mm512_set1_ps(os[i]), q + (b + i) * 8);
  }
  for (; b < b1; ++b) {
    __m512 v = load16t<DT>(x + b * stride);
    __m512i a = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
    bad |= _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
    uint8_t sc = block_scale_code(u2f(_mm512_reduce_max_epu32(a)), g.gs);
    s[b] = sc;
    codes16(v, _mm512_set1_ps(output_scale(e4m3_value(sc), g.rgs)), q + b * 8);
  }
  return bad != 0;
}

bool quantize_avx512(const uint8_t* x, size_t b0, size_t b1, int dt, GlobalScales g, uint8_t* q, uint8_t* s) {
  if (dt == kBF16) return quantize_avx512_t<kBF16>(x, b0, b1, g, q, s);
  if (dt == kF16) return quantize_avx512_t<kF16>(x, b0, b1, g, q, s);
  return quantize_avx512_t<kF32>(x, b0, b1, g, q, s);
}

SYNCD_AVX512 inline void store16(uint8_t* out, size_t b, int dt, __m512 y) {
  if (dt == kF32) {
    _mm512_storeu_ps(out + b * 64, y);
  } else if (dt == kBF16) {
    __m512i yb = _mm512_castps_si512(y);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(yb, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(yb, _mm512_set1_epi32(0x7FFF)), odd);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * 32),
                        _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

SYNCD_AVX512 inline void dequant_block(const uint8_t* q, size_t b, __m512 scale, uint8_t* out, int dt) {
  const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                    -2.0f, -3.0f, -4.0f, -6.0f);
  const __m512i nib = _mm512_set1_epi64(0xF);
  uint64_t bytes;
  std::memcpy(&bytes, q + b * 8, 8);
  __m512i w = _mm512_cvtepu8_epi64(_mm_cvtsi64_si128(static_cast<long long>(bytes)));
  // 64-bit lane j = byte j; its low nibble becomes 32-bit lane 2j, its high nibble lane 2j + 1
  __m512i idx = _mm512_or_si512(_mm512_and_si512(w, nib), _mm512_slli_epi64(_mm512_srli_epi64(w, 4), 32));
  store16(out, b, dt, _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), scale));
}

SYNCD_AVX512 void dequantize_avx512(const uint8_t* q, const uint8_t* s, size_t b0, size_t b1, float pts,
                                    uint8_t* out, int dt) {
  size_t b = b0;
  for (; b + 16 <= b1; b += 16) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b)));
    alignas(64) float scale[16];
    _mm512_store_ps(scale, _mm512_mul_ps(e4m3_value16(c), _mm512_set1_ps(pts)));
    for (int i = 0; i < 16; ++i) dequant_block(q, b + i, _mm512_set1_ps(scale[i]), out, dt);
  }
  for (; b < b1; ++b) dequant_block(q, b, _mm512_set1_ps(mul_rn(e4m3_value(s[b]), pts)), out, dt);
}

bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return ok;
}
#else
bool cpu_has_avx512() { return false; }
#endif

size_t chunks_of(size_t n_blocks) { return (n_blocks + kChunkBlocks - 1) / kChunkBlocks; }

}  // namespace

bool simd_enabled() { return cpu_has_avx512(); }

AmaxResult amax(const void* x, size_t n, int dtype_code, int threads, bool simd) {
  (void)simd;  // unused in builds without the AVX-512 path
  itemsize(dtype_code);  // validates the code
  const auto* p = static_cast<const uint8_t*>(x);
  const size_t chunk = kChunkBlocks * kBlock, n_chunks = (n + chunk - 1) / chunk;
  std::vector<AmaxResult> parts(n_chunks, AmaxResult{0.0f, false});
  parallel_for(n_chunks, threads, [&](size_t c) {
    size_t begin = c * chunk, end = std::min(n, begin + chunk);
#ifdef SYNCD_NVFP4_AVX512
    if (simd && cpu_has_avx512()) {
      parts[c] = amax_avx512(p, begin, end, dtype_code);
      return;
    }
#endif
    parts[c] = amax_scalar(p, begin, end, dtype_code);
  });
  AmaxResult r{0.0f, false};
  for (const auto& a : parts) {
    r.amax = a.amax > r.amax ? a.amax : r.amax;
    r.nonfinite |= a.nonfinite;
  }
  return r;
}

bool quantize(const void* x, size_t n_blocks, int dtype_code, float pts, uint8_t* qdata, uint8_t* scales,
              int threads, bool simd) {
  (void)simd;
  itemsize(dtype_code);  // validates the code
  const auto* p = static_cast<const uint8_t*>(x);
  const GlobalScales g = global_scales(pts);
  std::atomic<bool> bad{false};
  parallel_for(chunks_of(n_blocks), threads, [&](size_t c) {
    size_t b0 = c * kChunkBlocks, b1 = std::min(n_blocks, b0 + kChunkBlocks);
    bool r;
#ifdef SYNCD_NVFP4_AVX512
    if (simd && cpu_has_avx512())
      r = quantize_avx512(p, b0, b1, dtype_code, g, qdata, scales);
    else
#endif
      r = quantize_scalar(p, b0, b1, dtype_code, g, qdata, scales);
    if (r) bad.store(true, std::memory_order_relaxed);
  });
  return bad.load();
}

void dequantize(const uint8_t* qdata, const uint8_t* scales, size_t n_blocks, float pts, void* out,
                int out_dtype_code, int threads, bool simd) {
  (void)simd;
  itemsize(out_dtype_code);  // validates the code
  auto* o = static_cast<uint8_t*>(out);
  parallel_for(chunks_of(n_blocks), threads, [&](size_t c) {
    size_t b0 = c * kChunkBlocks, b1 = std::min(n_blocks, b0 + kChunkBlocks);
#ifdef SYNCD_NVFP4_AVX512
    if (simd && cpu_has_avx512()) {
      dequantize_avx512(qdata, scales, b0, b1, pts, o, out_dtype_code);
      return;
    }
#endif
    dequantize_scalar(qdata, scales, b0, b1, pts, o, out_dtype_code);
  });
}

}  // namespace nvfp4
}  // namespace syncd
