#!/usr/bin/env bash
# Build .aobundle/ in the current repo: torchao's wheel for the GPU machine's Python 3.12 (~3 MB),
# for model.dense_precision=fp8 and the torchao rows of bench layer fp8. The GPU machine cannot
# install from a registry, so the wheel travels with the working tree.
# Usage (repo root):  bash scripts/make-ao-bundle.sh        (idempotent)
# Each device run:    carry [".aobundle"], and start the command with  . .aobundle/setup.sh &&
set -euo pipefail
OUTDIR="${1:-.aobundle}"
AO_SPEC="${AO_SPEC:-torchao==0.18.0}"
mkdir -p "$OUTDIR"
EXC="$(git rev-parse --git-common-dir)/info/exclude"; mkdir -p "$(dirname "$EXC")"
grep -qxF "/$OUTDIR/" "$EXC" 2>/dev/null || echo "/$OUTDIR/" >> "$EXC"
ls "$OUTDIR"/torchao-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$OUTDIR" "$AO_SPEC"
cat > "$OUTDIR/setup.sh" <<'SETUP'
# Source first in a device command:  . .aobundle/setup.sh   (torchao into /tmp/aosite once per machine)
B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -f /tmp/aosite/.done ]; then
  mkdir -p /tmp/aosite
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aosite "$B"/torchao-*.whl || return 1
  touch /tmp/aosite/.done
fi
export PYTHONPATH=/tmp/aosite${PYTHONPATH:+:$PYTHONPATH}
SETUP
du -sh "$OUTDIR"
