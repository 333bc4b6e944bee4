// pybind11 surface of the native kept-set kernels (replay.h), registered into `syncd._native` by bindings.cpp.
// Pointer entry points: syncd.ops.replay passes data_ptr() of contiguous CPU tensors it keeps alive for the call
// and has validated (shapes, id ranges, offsets). Every entry point releases the GIL.
#include <pybind11/pybind11.h>

#include "replay.h"

namespace py = pybind11;

namespace syncd {

void register_replay(py::module_& m) {
  namespace rp = syncd::replay;
  m.def("kept_forward", [](uintptr_t logits, int dtype_code, int64_t rows, int64_t row_stride, uintptr_t ids,
                           uintptr_t offsets, uintptr_t targets, float temperature, uintptr_t logprob, uintptr_t lse,
                           uintptr_t zk, int threads) {
    py::gil_scoped_release nogil;
    return rp::kept_forward(reinterpret_cast<const void*>(logits), dtype_code, rows, row_stride,
                            reinterpret_cast<const int64_t*>(ids), reinterpret_cast<const int64_t*>(offsets),
                            reinterpret_cast<const int64_t*>(targets), temperature, reinterpret_cast<float*>(logprob),
                            reinterpret_cast<float*>(lse), reinterpret_cast<float*>(zk), threads);
  }, py::arg("logits_ptr"), py::arg("dtype_code"), py::arg("rows"), py::arg("row_stride"), py::arg("ids_ptr"),
     py::arg("offsets_ptr"), py::arg("targets_ptr"), py::arg("temperature"), py::arg("logprob_ptr"),
     py::arg("lse_ptr"), py::arg("zk_ptr"), py::arg("threads") = 1,
     "Kept-set log-probabilities of `rows` rows; returns the first row whose target is outside its kept set, or -1.");

  m.def("kept_backward", [](uintptr_t grad, uintptr_t zk, int64_t rows, int64_t vocab, uintptr_t ids,
                            uintptr_t offsets, uintptr_t targets, uintptr_t lse, float temperature,
                            uintptr_t grad_logits, int dtype_code, int threads) {
    py::gil_scoped_release nogil;
    rp::kept_backward(reinterpret_cast<const float*>(grad), reinterpret_cast<const float*>(zk), rows, vocab,
                      reinterpret_cast<const int64_t*>(ids), reinterpret_cast<const int64_t*>(offsets),
                      reinterpret_cast<const int64_t*>(targets), reinterpret_cast<const float*>(lse), temperature,
                      reinterpret_cast<void*>(grad_logits), dtype_code, threads);
  }, py::arg("grad_ptr"), py::arg("zk_ptr"), py::arg("rows"), py::arg("vocab"), py::arg("ids_ptr"),
     py::arg("offsets_ptr"), py::arg("targets_ptr"), py::arg("lse_ptr"), py::arg("temperature"),
     py::arg("grad_logits_ptr"), py::arg("dtype_code"), py::arg("threads") = 1,
     "Gradient of the kept-set log-probabilities: zeroes each row of grad_logits and writes its kept entries.");
}

}  // namespace syncd
