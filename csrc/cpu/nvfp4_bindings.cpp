// pybind11 surface of the native NVFP4 kernels, registered into `syncd._native` by bindings.cpp. Pointer
// entry points: syncd.ops.nvfp4 passes data_ptr() of contiguous CPU tensors it keeps alive for the call and
// has checked the sizes of (bfloat16 has no buffer-protocol format). Every entry point releases the GIL.
#include <pybind11/pybind11.h>

#include "nvfp4.h"

namespace py = pybind11;

namespace syncd {

void register_nvfp4(py::module_& m) {
  namespace nv = syncd::nvfp4;
  m.attr("NVFP4_SIMD") = nv::simd_enabled();

  m.def("nvfp4_amax", [](uintptr_t x, size_t n, int dtype_code, int threads, bool simd) {
    nv::AmaxResult r;
    {
      py::gil_scoped_release nogil;
      r = nv::amax(reinterpret_cast<const void*>(x), n, dtype_code, threads, simd);
    }
    return py::make_tuple(r.amax, r.nonfinite);
  }, py::arg("x_ptr"), py::arg("n"), py::arg("dtype_code"), py::arg("threads") = 1, py::arg("simd") = true,
     "(largest magnitude as a float32 value, whether some element is NaN or infinite) of n elements.");

  m.def("nvfp4_quantize", [](uintptr_t x, size_t n_blocks, int dtype_code, float pts, uintptr_t qdata,
                             uintptr_t scales, int threads, bool simd) {
    py::gil_scoped_release nogil;
    return nv::quantize(reinterpret_cast<const void*>(x), n_blocks, dtype_code, pts,
                        reinterpret_cast<uint8_t*>(qdata), reinterpret_cast<uint8_t*>(scales), threads, simd);
  }, py::arg("x_ptr"), py::arg("n_blocks"), py::arg("dtype_code"), py::arg("pts"), py::arg("qdata_ptr"),
     py::arg("scales_ptr"), py::arg("threads") = 1, py::arg("simd") = true,
     "Quantize n_blocks blocks of 16 elements; returns True if some element was NaN or infinite.");

  m.def("nvfp4_dequantize", [](uintptr_t qdata, uintptr_t scales, size_t n_blocks, float pts, uintptr_t out,
                               int out_dtype_code, int threads, bool simd) {
    py::gil_scoped_release nogil;
    nv::dequantize(reinterpret_cast<const uint8_t*>(qdata), reinterpret_cast<const uint8_t*>(scales), n_blocks,
                   pts, reinterpret_cast<void*>(out), out_dtype_code, threads, simd);
  }, py::arg("qdata_ptr"), py::arg("scales_ptr"), py::arg("n_blocks"), py::arg("pts"), py::arg("out_ptr"),
     py::arg("out_dtype_code"), py::arg("threads") = 1, py::arg("simd") = true);
}

}  // namespace syncd
