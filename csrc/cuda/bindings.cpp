// pybind11 surface of `syncd._cuda_native`: thin launchers over raw device pointers (ints) and a stream
// handle; no libtorch. The Python side (syncd/ops/_cuda.py) owns every allocation.
#include <pybind11/pybind11.h>

#include "kernels.cuh"
#include "nvfp4.cuh"

namespace py = pybind11;
using namespace syncd_cuda;

PYBIND11_MODULE(_cuda_native, m) {
  m.doc() = "syncd CUDA kernels: checksum, change scan/compaction, in-place scatter apply";
  m.attr("SCAN_TILE") = kScanTile;
  m.def("checksum_raw", [](uintptr_t data, size_t nbytes, uintptr_t out, uintptr_t stream) {
    checksum_raw(reinterpret_cast<const void*>(data), nbytes, reinterpret_cast<uint64_t*>(out), stream);
  });
  m.def("count_changes", [](uintptr_t a, uintptr_t b, size_t n, int bits, uintptr_t counts, uintptr_t stream) {
    count_changes(reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b), n, bits,
                  reinterpret_cast<int64_t*>(counts), stream);
  });
  m.def("compact_changes", [](uintptr_t a, uintptr_t b, size_t n, int bits, bool is_float, uintptr_t offsets,
                              uintptr_t pos, uintptr_t v, uintptr_t stream) {
    compact_changes(reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b), n, bits, is_float,
                    reinterpret_cast<const int64_t*>(offsets), reinterpret_cast<int64_t*>(pos),
                    reinterpret_cast<uint64_t*>(v), stream);
  });
  m.def("scatter_apply", [](uintptr_t t, uintptr_t pos, uintptr_t v, size_t mm, int bits, bool is_float, bool forward,
                            uintptr_t stream) {
    scatter_apply(reinterpret_cast<void*>(t), reinterpret_cast<const int64_t*>(pos),
                  reinterpret_cast<const uint64_t*>(v), mm, bits, is_float, forward, stream);
  });
  register_nvfp4(m);
}
