#!/usr/bin/env bash
# Build .sonickernels/sonic_kernels.tgz here, without a GPU: every quack GEMM config SonicMoE's
# autotuner times on sm_90a, compiled (`ray-moe bench layer --sonic-precompile`), so the GPU
# machine's first SonicMoE step only loads and times them instead of compiling for longer than a
# 10-minute step (docs/log/2026-11-23.md). Needs .sonicbundle/ (bash ../shared/device/make-sonic-bundle.sh);
# downloads torch 2.11 for Python 3.12 (the GPU machine's) into a venv under /tmp (~3 GB, pip works
# here). ~5 min for 89 configs on 2 cores; the tarball is ~2 MB.
# Usage (repo root):  bash scripts/make-sonic-kernels.sh        (idempotent)
# GPU machine: carry [".sonicbundle", ".sonickernels"]; `bash scripts/device_step.sh sonic` unpacks it.
set -euo pipefail
OUTDIR="${1:-.sonickernels}"
# the first Python 3.12 that runs (a pyenv shim is found by `command -v` yet may refuse to run)
if [ -z "${PY312:-}" ]; then
  for c in python3.12 /root/.pyenv/versions/3.12.1/bin/python; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$c; break; fi
  done
fi
[ -n "${PY312:-}" ] || { echo "make-sonic-kernels: no Python 3.12 found (set PY312)"; exit 2; }
VENV=/tmp/sonicenv SITE=/tmp/sonicsite CACHE=/tmp/sonic-qcache
EXC="$(git rev-parse --git-common-dir)/info/exclude"; mkdir -p "$(dirname "$EXC")"
grep -qxF "/$OUTDIR/" "$EXC" 2>/dev/null || echo "/$OUTDIR/" >> "$EXC"
[ -d .sonicbundle ] || { echo "make-sonic-kernels: .sonicbundle/ is missing (bash ../shared/device/make-sonic-bundle.sh)"; exit 2; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.11.0" "triton==3.6.0" numpy pyyaml tabulate
fi
if [ ! -f "$SITE/.done" ]; then
  mkdir -p "$SITE"
  "$VENV/bin/pip" install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .sonicbundle/*.whl
  tar -xJf .sonicbundle/cutlass_dsl_libs_base-*.tar.xz -C "$SITE"
  touch "$SITE/.done"
fi
rm -rf "$CACHE"; mkdir -p "$CACHE" "$OUTDIR"
PYTHONPATH="$PWD:$SITE:$SITE/nvidia_cutlass_dsl/python_packages" \
  "$VENV/bin/python" -m ray_moe.bench.layer --E 128 --sonic-precompile "$CACHE"
(cd "$CACHE" && tar czf - --exclude '*.lock' .) > "$OUTDIR/sonic_kernels.tgz.partial"
mv "$OUTDIR/sonic_kernels.tgz.partial" "$OUTDIR/sonic_kernels.tgz"
du -sh "$OUTDIR/sonic_kernels.tgz"
