#!/usr/bin/env bash
# One run on a GPU machine: build the native modules (CUDA on), then run the GPU test list bench/gpu_checks.txt
# with the benchmark driver (every GPU test, every GPU timing; exit status 1 if any check failed).
# Usage: bash bench/gpu_check.sh   (results and logs under ${OUT:-bench/results}; PYTHON picks the interpreter)
# On a GPU it also writes docs/results/gpu_check.json (the GPU, the date, the exit status, every JSON of the results
# folder without per-round arrays: python -m bench.guards --gpu-results), which the README's GPU figures cite.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# wheels carried in .whl (e.g. obstore, which the GPU image lacks) go to a private site dir
if ls .whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
echo "== build (SYNCD_CUDA=on)"
t0=$(date +%s)
SYNCD_CUDA=on "$py" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -20 || exit 1
echo "build took $(( $(date +%s) - t0 ))s"
"$py" -c "import syncd._native, syncd._cuda_native; print('modules load')" || exit 1
"$py" -m bench --tests bench/gpu_checks.txt --results "$out"
rc=$?
# on a GPU, the results also go to docs/results/gpu_check.json (the file the README's GPU figures cite)
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
if [ -n "$gpu" ]; then
  GPU="$gpu" RC=$rc "$py" -m bench.guards --gpu-results "$out" || echo "could not write docs/results/gpu_check.json"
fi
exit $rc
