// CUDA NVFP4 kernels (see nvfp4.cuh). Each thread owns whole blocks of 16 elements: two (bf16/f16) or four
// (f32) 16-byte loads, one 8-byte store of codes and one scale byte, in a grid-stride loop. The scalar
// arithmetic is shared with the CPU (../cpu/nvfp4.h) and uses __fmul_rn/__fdiv_rn/__fadd_rn, so nvcc
// never contracts it into fused multiply-adds.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "../cpu/nvfp4.h"
#include "kernels.cuh"
#include "nvfp4.cuh"

namespace syncd_cuda {

namespace {

namespace nv = syncd::nvfp4;

constexpr int kThreads = 256;

template <int DT>
__device__ __forceinline__ void load_block(const uint8_t* __restrict__ x, size_t b, float (&v)[16]) {
  if constexpr (DT == nv::kF32) {
    const float4* p = reinterpret_cast<const float4*>(x) + 4 * b;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float4 f = __ldg(p + k);
      v[4 * k] = f.x;
      v[4 * k + 1] = f.y;
      v[4 * k + 2] = f.z;
      v[4 * k + 3] = f.w;
    }
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(x) + 2 * b;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      uint4 w = __ldg(p + k);
      uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint16_t lo = uint16_t(words[i] & 0xFFFFu), hi = uint16_t(words[i] >> 16);
        v[8 * k + 2 * i] = DT == nv::kBF16 ? nv::bf16_value(lo) : nv::f16_value(lo);
        v[8 * k + 2 * i + 1] = DT == nv::kBF16 ? nv::bf16_value(hi) : nv::f16_value(hi);
      }
    }
  }
}

template <int DT>
__global__ void quantize_kernel(const uint8_t* __restrict__ x, size_t n_blocks, const float* __restrict__ pts,
                                uint8_t* __restrict__ q, uint8_t* __restrict__ s, int* __restrict__ bad) {
  const nv::GlobalScales g = nv::global_scales(*pts);
  uint32_t nonfinite = 0;
  for (size_t b = blockIdx.x * size_t(blockDim.x) + threadIdx.x; b < n_blocks; b += size_t(gridDim.x) * blockDim.x) {
    float v[16];
    load_block<DT>(x, b, v);
    uint32_t amax = 0;  // magnitudes compared as integers (same order for non-negative finite floats)
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      uint32_t a = nv::f2u(v[i]) & 0x7FFFFFFFu;
      nonfinite |= a >= 0x7F800000u;
      amax = a > amax ? a : amax;
    }
    uint8_t sc = nv::block_scale_code(nv::u2f(amax), g.gs);
    float os = nv::output_scale(nv::e4m3_value(sc), g.rgs);
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t byte = nv::e2m1_code(nv::mul_rn(v[2 * j], os)) | (uint32_t(nv::e2m1_code(nv::mul_rn(v[2 * j + 1], os))) << 4);
      packed[j >> 2] |= byte << (8 * (j & 3));
    }
    reinterpret_cast<uint2*>(q)[b] = make_uint2(packed[0], packed[1]);
    s[b] = sc;
  }
  if (nonfinite) atomicOr(bad, 1);
}

template <int DT>
__global__ void dequantize_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s, size_t n_blocks,
                                  const float* __restrict__ pts, uint8_t* __restrict__ out) {
  const float p = *pts;
  for (size_t b = blockIdx.x * size_t(blockDim.x) + threadIdx.x; b < n_blocks; b += size_t(gridDim.x) * blockDim.x) {
    uint2 w = __ldg(reinterpret_cast<const uint2*>(q) + b);
    float scale = nv::mul_rn(nv::e4m3_value(__ldg(s + b)), p);
    float y[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      uint32_t word = i < 8 ? w.x : w.y;
      uint32_t code = (word >> (4 * (i & 7))) & 0xFu;
      y[i] = nv::mul_rn(nv::e2m1_value(code), scale);
    }
    if constexpr (DT == nv::kF32) {
      float4* o = reinterpret_cast<float4*>(out) + 4 * b;
#pragma unroll
      for (int k = 0; k < 4; ++k) o[k] = make_float4(y[4 * k], y[4 * k + 1], y[4 * k + 2], y[4 * k + 3]);
    } else {
      uint32_t h[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        uint32_t lo = DT == nv::kBF16 ? nv::bf16_bits(y[2 * i]) : nv::f16_bits(y[2 * i]);
        uint32_t hi = DT == nv::kBF16 ? nv::bf16_bits(y[2 * i + 1]) : nv::f16_bits(y[2 * i + 1]);
        h[i] = lo | (hi << 16);
      }
      uint4* o = reinterpret_cast<uint4*>(out) + 2 * b;
      o[0] = make_uint4(h[0], h[1], h[2], h[3]);
      o[1] = make_uint4(h[4], h[5], h[6], h[7]);
    }
  }
}

unsigned grid_for(size_t n_blocks) {
  size_t g = (n_blocks + kThreads - 1) / kThreads;
  return unsigned(g < (size_t(1) << 20) ? g : (size_t(1) << 20));
}

template <class F>
void by_dtype(int dtype_code, F&& f) {
  switch (dtype_code) {
    case nv::kBF16: f(std::integral_constant<int, nv::kBF16>{}); break;
    case nv::kF16: f(std::integral_constant<int, nv::kF16>{}); break;
    case nv::kF32: f(std::integral_constant<int, nv::kF32>{}); break;
    default: throw std::invalid_argument("NVFP4: unsupported dtype code " + std::to_string(dtype_code));
  }
}

void check_aligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16) throw std::invalid_argument(std::string("NVFP4: ") + what + " must be 16-byte aligned");
}

}  // namespace

void nvfp4_quantize(const void* x, size_t n_blocks, int dtype_code, const float* pts, uint8_t* qdata,
                    uint8_t* scales, int* bad, uintptr_t stream) {
  if (!n_blocks) return;
  check_aligned(x, "input");
  check_aligned(qdata, "qdata");
  by_dtype(dtype_code, [&](auto tag) {
    quantize_kernel<decltype(tag)::value><<<grid_for(n_blocks), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        static_cast<const uint8_t*>(x), n_blocks, pts, qdata, scales, bad);
  });
  check_last("nvfp4 quantize kernel");
}

void nvfp4_dequantize(const uint8_t* qdata, const uint8_t* scales, size_t n_blocks, const float* pts, void* out,
                      int out_dtype_code, uintptr_t stream) {
  if (!n_blocks) return;
  check_aligned(qdata, "qdata");
  check_aligned(out, "output");
  by_dtype(out_dtype_code, [&](auto tag) {
    dequantize_kernel<decltype(tag)::value><<<grid_for(n_blocks), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        qdata, scales, n_blocks, pts, static_cast<uint8_t*>(out));
  });
  check_last("nvfp4 dequantize kernel");
}

void register_nvfp4(pybind11::module_& m) {
  m.def("nvfp4_quantize_raw", [](uintptr_t x, size_t n_blocks, int dtype_code, uintptr_t pts, uintptr_t qdata,
                                 uintptr_t scales, uintptr_t bad, uintptr_t stream) {
    nvfp4_quantize(reinterpret_cast<const void*>(x), n_blocks, dtype_code, reinterpret_cast<const float*>(pts),
                   reinterpret_cast<uint8_t*>(qdata), reinterpret_cast<uint8_t*>(scales), reinterpret_cast<int*>(bad),
                   stream);
  });
  m.def("nvfp4_dequantize_raw", [](uintptr_t qdata, uintptr_t scales, size_t n_blocks, uintptr_t pts, uintptr_t out,
                                   int out_dtype_code, uintptr_t stream) {
    nvfp4_dequantize(reinterpret_cast<const uint8_t*>(qdata), reinterpret_cast<const uint8_t*>(scales), n_blocks,
                     reinterpret_cast<const float*>(pts), reinterpret_cast<void*>(out), out_dtype_code, stream);
  });
}

}  // namespace syncd_cuda
