#!/usr/bin/env bash
# One run on a GPU machine: build the native modules (CUDA on), run every GPU test, time every GPU path.
# Usage: bash bench/gpu_check.sh   (results and logs under ${OUT:-bench/results})
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
echo "== GPU tests + op tests on the GPU machine"
"$py" -m pytest -q -p no:cacheprovider tests/ops -k "not asan" 2>&1 | tee "$out/gpu_tests.log" | tail -25
rc=${PIPESTATUS[0]}
echo "== publisher on CUDA weights (encode on the GPU, materialize onto the GPU)"
"$py" -m pytest -q -p no:cacheprovider tests/publish/test_publisher.py -m gpu 2>&1 | tee "$out/gpu_publisher.log" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== engine weight updates on CUDA parameters (pinned staging, on-device scatter, rollback)"
"$py" -m pytest -q -p no:cacheprovider tests/engine/test_gpu_engine.py tests/engine/test_nvfp4_engine.py tests/bench/test_engine_update_bench.py -m gpu 2>&1 | tee "$out/gpu_engine.log" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== GPU codec timings"
"$py" -m bench.gpu_codec --gib 1 --density 0.01 --refcheck --out "$out/gpu_codec.json" || rc=1
"$py" -m bench.gpu_codec --gib 1 --density 0.1 --repeats 5 --out "$out/gpu_codec_d10.json" || rc=1
echo "== NVFP4: QAT + publisher on CUDA weights (tests/ops/test_nvfp4_gpu.py ran with the op tests above), timings"
"$py" -m pytest -q -p no:cacheprovider tests/trainer/test_qat.py -m gpu 2>&1 | tee "$out/gpu_nvfp4_qat.log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
"$py" -m bench.gpu_nvfp4 --gib 1 --out "$out/gpu_nvfp4.json" || rc=1
echo "== replay: kept_logprobs (Triton) vs the naive masked log-softmax and the lm_head, rebuilding kept sets; routing replay on CUDA"
"$py" -m bench.gpu_replay --rows 8192 --refcheck --out "$out/gpu_replay.json" || rc=1
"$py" -m pytest -q -p no:cacheprovider tests/trainer/test_routing_replay.py -m gpu 2>&1 | tee "$out/gpu_routing_replay.log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== thin trainer: the policy-gradient loss and an AdamW/Muon step on CUDA (against the CPU, repeated bit for bit)"
"$py" -m pytest -q -p no:cacheprovider tests/trainer/test_objective_optim.py -m gpu 2>&1 | tee "$out/gpu_trainer.log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== engine update on the GPU (pause vs full reload from host memory)"
"$py" -m bench.engine_update --device cuda --updates 5 --window 10 --interval 1 --out "$out/engine_update_gpu.json" || rc=1
exit $rc
