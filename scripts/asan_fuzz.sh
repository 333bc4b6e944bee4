#!/usr/bin/env bash
# Build the native CPU module with AddressSanitizer + UBSan and run the hostile-blob fuzz tests against it.
# Usage: scripts/asan_fuzz.sh [BUILD_DIR]   (env SYNCD_FUZZ_EXAMPLES sets the hypothesis examples per test)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build/asan}
py=${PYTHON:-python}
mkdir -p "$build"
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DSYNCD_ASAN=ON -DSYNCD_CUDA=off \
  -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v "$py")" >/dev/null
cmake --build "$build" --target _native >/dev/null
asan=$(${CXX:-g++} -print-file-name=libasan.so)
ubsan=$(${CXX:-g++} -print-file-name=libubsan.so)
cd "$here"
# --capture=sys: a sanitizer writes its report to fd 2 and aborts; pytest's default fd capture would keep the
# report in a temporary file that nobody prints
SYNCD_NATIVE_DIR="$build" LD_PRELOAD="$asan:$ubsan" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  SYNCD_FUZZ_EXAMPLES=${SYNCD_FUZZ_EXAMPLES:-300} \
  "$py" -m pytest -q -p no:cacheprovider --capture=sys tests/ops/test_delta_hostile.py tests/ops/test_delta.py tests/ops/test_delta_v2.py tests/ops/test_scatter.py tests/ops/test_replay_kept.py tests/ops/test_checksum.py tests/ops/test_delta_changes.py -k "not triton" "${@:2}"
# format 2's decoder has a kernel per SIMD level (the run above takes the CPU's best): fuzz the others too
for level in avx2 scalar; do
  SYNCD_SIMD=$level SYNCD_NATIVE_DIR="$build" LD_PRELOAD="$asan:$ubsan" \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    SYNCD_FUZZ_EXAMPLES=$(( ${SYNCD_FUZZ_EXAMPLES:-300} / 3 )) \
    "$py" -m pytest -q -p no:cacheprovider --capture=sys tests/ops/test_delta_hostile.py -k "format_2" "${@:2}"
done
