// CUDA NVFP4 quantize / dequantize. Torch-free launchers over raw device pointers and a cudaStream_t (as an
// integer); the arithmetic is csrc/cpu/nvfp4.h's, the same bits as the CPU kernels and the reference
// (syncd/ops/reference/nvfp4.py). One thread per block of 16 elements, 16-byte loads: the caller passes
// 16-byte aligned pointers (torch allocations are).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pybind11 {
class module_;
}

namespace syncd_cuda {

// Quantizes n_blocks blocks of 16 elements of dtype_code (1 bf16, 2 f16, 3 f32) with the per-tensor scale
// at *pts (a device float): 8 bytes per block at qdata, one scale byte per block at scales. Sets *bad (a
// device int, zeroed by the caller) to 1 if some element is NaN or infinite.
void nvfp4_quantize(const void* x, size_t n_blocks, int dtype_code, const float* pts, uint8_t* qdata,
                    uint8_t* scales, int* bad, uintptr_t stream);

// Dequantizes n_blocks blocks into 16 * n_blocks elements of out_dtype_code at out.
void nvfp4_dequantize(const uint8_t* qdata, const uint8_t* scales, size_t n_blocks, const float* pts, void* out,
                      int out_dtype_code, uintptr_t stream);

// Adds nvfp4_quantize_raw / nvfp4_dequantize_raw to the module (called by bindings.cpp).
void register_nvfp4(pybind11::module_& m);

}  // namespace syncd_cuda
