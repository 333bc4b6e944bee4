// NVFP4 quantize / dequantize: the scalar arithmetic of the recipe (shared with the CUDA kernels, which
// include this header) and the native CPU entry points. The executable specification is
// syncd/ops/reference/nvfp4.py; docs/nvfp4.md states the format and the edge cases.
//
// Every step is an IEEE float32 operation rounded to nearest even, written with mul_rn / div_rn / add_rn so
// that no compiler contracts two of them into a fused multiply-add (the CPU file is also built with
// -ffp-contract=off). Inputs here are finite: the Python layer validates them (or the kernels report
// non-finite values, which the Python layer turns into ValueError).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SYNCD_NVFP4_HD __host__ __device__ __forceinline__
#else
#define SYNCD_NVFP4_HD inline
#endif

namespace syncd {
namespace nvfp4 {

constexpr int kBlock = 16;           // elements per block scale
constexpr float kE4M3Max = 448.0f;   // largest finite float8_e4m3fn
constexpr float kSixth = 1.0f / 6.0f;  // fp32(1/6), the recipe's reciprocal of the E2M1 maximum

// dtype codes, the same as the delta codec's (syncd/ops/_format.py)
constexpr int kBF16 = 1;
constexpr int kF16 = 2;
constexpr int kF32 = 3;

SYNCD_NVFP4_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

SYNCD_NVFP4_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

SYNCD_NVFP4_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

SYNCD_NVFP4_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

SYNCD_NVFP4_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// float8_e4m3fn bits of a non-negative, non-NaN float: nearest even, saturating at 448 (+inf gives 448).
SYNCD_NVFP4_HD uint8_t e4m3_code(float v) {
  v = v < kE4M3Max ? v : kE4M3Max;
  uint32_t b = f2u(v);
  if (b < (121u << 23)) {
    // below 2^-6, the smallest normal: a subnormal in units of 2^-9. Adding 2^14 (whose ulp is 2^-9)
    // rounds v to that grid, nearest even; the low bits are the count of units (8 means 2^-6 = code 8).
    return static_cast<uint8_t>(f2u(add_rn(v, 16384.0f)) - f2u(16384.0f));
  }
  // keep 3 of 23 mantissa bits, nearest even; a carry moves into the exponent, as it should
  return static_cast<uint8_t>(((b + 0x7FFFFu + ((b >> 20) & 1u)) >> 20) - (120u << 3));
}

// value of a non-negative finite float8_e4m3fn code (0..126, what quantize writes; other bytes are undefined)
SYNCD_NVFP4_HD float e4m3_value(uint32_t c) {
  if (c < 8) return mul_rn(static_cast<float>(c), 0.001953125f);  // c * 2^-9, exact
  return u2f((((c >> 3) + 120u) << 23) | ((c & 7u) << 20));
}

// 4-bit code of a float32: nearest even among {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating, sign in bit 3.
SYNCD_NVFP4_HD uint8_t e2m1_code(float s) {
  uint32_t b = f2u(s);
  float a = u2f(b & 0x7FFFFFFFu);
  uint32_t m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(m | ((b >> 28) & 8u));
}

SYNCD_NVFP4_HD float e2m1_value(uint32_t c) {
  float m = (c & 7u) < 4u ? mul_rn(static_cast<float>(c & 7u), 0.5f)
                          : ((c & 7u) == 7u ? 6.0f : static_cast<float>((c & 7u) - 2u));
  return (c & 8u) ? -m : m;
}

struct GlobalScales {
  float gs;   // 1 / pts: the recipe's global (encode) scale
  float rgs;  // 1 / gs
};

SYNCD_NVFP4_HD GlobalScales global_scales(float pts) {
  float gs = div_rn(1.0f, pts);
  return {gs, div_rn(1.0f, gs)};
}

// block scale code from the block's largest magnitude
SYNCD_NVFP4_HD uint8_t block_scale_code(float vmax, float gs) { return e4m3_code(mul_rn(gs, mul_rn(vmax, kSixth))); }

// what the block's elements are multiplied by before E2M1 rounding
SYNCD_NVFP4_HD float output_scale(float sf, float rgs) { return sf != 0.0f ? div_rn(1.0f, mul_rn(sf, rgs)) : 0.0f; }

// bfloat16 bits of a finite float: nearest even
SYNCD_NVFP4_HD uint16_t bf16_bits(float f) {
  uint32_t b = f2u(f);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// float16 bits of a finite float: nearest even, overflow to infinity
SYNCD_NVFP4_HD uint16_t f16_bits(float f) {
  uint32_t b = f2u(f);
  uint32_t sign = (b >> 16) & 0x8000u;
  uint32_t a = b & 0x7FFFFFFFu;
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to infinity
  if (a >= 0x38800000u) {                                               // normal: >= 2^-14
    uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r - (112u << 23)) >> 13));
  }
  // subnormal in units of 2^-24: adding 0.5 (whose ulp is 2^-24) rounds to that grid, nearest even
  return static_cast<uint16_t>(sign | (f2u(add_rn(u2f(a), 0.5f)) - f2u(0.5f)));
}

SYNCD_NVFP4_HD float bf16_value(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

SYNCD_NVFP4_HD float f16_value(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact
    float v = mul_rn(static_cast<float>(m), 5.9604644775390625e-08f);
    return u2f(f2u(v) | sign);
  }
  if (e == 31) return u2f(sign | 0x7F800000u | (m << 13));
  return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

// ---- native CPU entry points (csrc/cpu/nvfp4.cpp). Pointers are to contiguous buffers the caller owns.

struct AmaxResult {
  float amax;
  bool nonfinite;  // some element was NaN or +-inf (amax is then meaningless)
};

// Largest magnitude of n elements of dtype_code (kBF16, kF16, kF32), on up to `threads` threads.
AmaxResult amax(const void* x, size_t n, int dtype_code, int threads, bool simd = true);

// Quantizes n_blocks blocks of 16 elements: writes 8 * n_blocks bytes at qdata and n_blocks scale bytes.
// Returns true if some element was NaN or infinite (the outputs are then unspecified).
bool quantize(const void* x, size_t n_blocks, int dtype_code, float pts, uint8_t* qdata, uint8_t* scales,
              int threads, bool simd = true);

// Dequantizes n_blocks blocks into 16 * n_blocks elements of out_dtype_code at out.
void dequantize(const uint8_t* qdata, const uint8_t* scales, size_t n_blocks, float pts, void* out,
                int out_dtype_code, int threads, bool simd = true);

// True when this build runs the AVX-512 kernels on this CPU (simd = false forces the portable path).
bool simd_enabled();

}  // namespace nvfp4
}  // namespace syncd
