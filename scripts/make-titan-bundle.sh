#!/usr/bin/env bash
# Build .titanbundle/ in the current repo: torchtitan 0.2.2 (works with torch 2.11) and the pure-Python
# packages it imports that the GPU machine lacks, plus liger-kernel (~2 MB in all), so `ray-moe bench train` can run
# torchtitan's Qwen3 MoE beside ray_moe's on the same config and GPU. No Ray needed.
# Usage (repo root):  bash scripts/make-titan-bundle.sh            (idempotent)
# Each device run:    carry [".titanbundle"], and start the command with  . .titanbundle/setup.sh &&
set -euo pipefail
OUTDIR="${1:-.titanbundle}"
mkdir -p "$OUTDIR"
EXC="$(git rev-parse --git-common-dir)/info/exclude"; mkdir -p "$(dirname "$EXC")"
grep -qxF "/$OUTDIR/" "$EXC" 2>/dev/null || echo "/$OUTDIR/" >> "$EXC"
PIP="${PIP:-python3 -m pip}"
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform any)
$PIP download -q "${PLAT[@]}" -d "$OUTDIR" "torchtitan==0.2.2" "torchdata" "tyro" "datasets" \
  "docstring_parser" "typeguard" "dill" "multiprocess" "liger-kernel>=0.6.2"
cat > "$OUTDIR/setup.sh" <<'SETUP'
# Source first in a device command:  . .titanbundle/setup.sh
B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -f /tmp/site/.titan-done ]; then
  mkdir -p /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/*.whl || return 1
  touch /tmp/site/.titan-done
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site PYTHONUNBUFFERED=1
SETUP
du -sh "$OUTDIR"; ls "$OUTDIR"
