#!/usr/bin/env bash
# Set up .venv with ray_moe and its test extras (idempotent). Used by the README and by CI.
# torch: TORCH_SPEC (default torch==2.13.0, a CPU build on the project's CI machines; on a GPU
# machine install your CUDA build of torch first, or set TORCH_SPEC).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
