#!/usr/bin/env bash
# Loss curves on one GPU, FP8 against bf16 from one seed, on real text made on the machine itself
# (no network there): the Python standard library's sources (tests and site-packages left out) →
# a byte-level BPE trained here (ray-moe tokenizer train) → token shards (ray-moe prepare, Ray
# Data) → ray-moe bench curve: Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of 768,
# top-8) at CURVE_LAYERS layers, both variants resident on the GPU and stepped in turn.
# Usage (GPU machine, repo root; .devbundle for Ray Data, .aobundle where a variant sets
# model.dense_precision=fp8):
#   . .devbundle/setup.sh && bash scripts/device_curve.sh
#   . .devbundle/setup.sh && . .aobundle/setup.sh && \
#     CURVE_VARIANTS="bf16=;fp8=moe.expert_precision=fp8;fp8all=moe.expert_precision=fp8,model.dense_precision=fp8" \
#     bash scripts/device_curve.sh
# Variables (defaults): CURVE_LAYERS (2), CURVE_STEPS (1000), CURVE_TOKENS per step (16384),
# CURVE_SEQ (2048), CURVE_VOCAB (8192), CURVE_LR (6e-4), CURVE_SEED (0), CURVE_VARIANTS
# ("bf16=;fp8=moe.expert_precision=fp8"), CURVE_ARGS (more bench curve options),
# CURVE_LIMIT_S (330: every variant stops at one step once this many seconds of steps have
# passed, so the curves, the summary and the plot come back whatever the speed), T_DATA (150 a
# data step), T_CURVE (420: the bench's own timeout; with the data, 9 minutes at most),
# CURVE_WORK (/tmp/curve: tokenizer and dataset, kept across commands on a warm machine: a
# rerun skips both).
# Budget on one H100 (2 layers, 16384 tokens a step), estimated from docs/RESULTS.md's step rows
# (28.7 ms a layer with full recompute, FP8 experts 0.78x bf16's speed), not yet measured: data
# 1-2 min, steps of ~60 ms (bf16) and ~80 ms (FP8) with compiled blocks, 2 x 1000 steps ~2.5 min
# after ~1 min of compilation. Memory (python -m ray_moe.arch's model): ~25 / 28 GiB at the peak
# for bf16 / FP8 experts at 2 layers, ~48 / 53 GiB at 4, so two resident variants fit an H100 at
# 2 layers only: CURVE_LAYERS=4 on an H200, or with CURVE_ARGS="--experts 64".
# Results in $OUT: curve.csv, curve.json, curve.png, curve.log, data.log, gpus.txt.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${CURVE_WORK:-/tmp/curve}; mkdir -p "$WORK"
VOCAB=${CURVE_VOCAB:-8192}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')" | tee -a "$OUT/gpus.txt"
t0=$SECONDS
if [ ! -f "$WORK/data/meta.json" ]; then
  STD=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  find "$STD" -name '*.py' -not -path '*/test/*' -not -path '*/tests/*' -not -path '*/site-packages/*' \
    -not -path '*/dist-packages/*' -not -path '*/__pycache__/*' | sort > "$WORK/files.txt"
  echo "corpus: $(wc -l < "$WORK/files.txt") files of $STD, $(cat "$WORK/files.txt" | xargs cat | wc -c) bytes" \
    | tee "$OUT/data.log"
  mapfile -t FILES < "$WORK/files.txt"
  if [ ! -f "$WORK/tok/tokenizer.json" ]; then
    timeout "${T_DATA:-150}" python3 -m ray_moe.cli tokenizer train --vocab-size "$VOCAB" --input "${FILES[@]}" --out "$WORK/tok" \
      2>&1 | tee -a "$OUT/data.log" | tail -3
  fi
  [ -f "$WORK/tok/tokenizer.json" ] || { echo "no tokenizer: see $OUT/data.log"; exit 1; }
  timeout "${T_DATA:-150}" python3 -m ray_moe.cli prepare --input "${FILES[@]}" --tokenizer "$WORK/tok" --out "$WORK/data" \
    --val-fraction 0.02 --no-progress 2>&1 | grep -v "^(" | tee -a "$OUT/data.log" | tail -5
  [ -f "$WORK/data/meta.json" ] || { echo "prepare did not finish: see $OUT/data.log"; exit 1; }
fi
echo "data ready in $((SECONDS - t0)) s" | tee -a "$OUT/data.log"
set -o pipefail
timeout "${T_CURVE:-420}" python3 -m ray_moe.cli bench curve --preset qwen3-30b-a3b --layers "${CURVE_LAYERS:-2}" \
  --steps "${CURVE_STEPS:-1000}" --tokens "${CURVE_TOKENS:-16384}" --seq-len "${CURVE_SEQ:-2048}" \
  --lr "${CURVE_LR:-6e-4}" --seed "${CURVE_SEED:-0}" --dataset "$WORK/data" --tokenizer "$WORK/tok" \
  --variants "${CURVE_VARIANTS:-bf16=;fp8=moe.expert_precision=fp8}" --time-limit-s "${CURVE_LIMIT_S:-330}" \
  --out "$OUT" ${CURVE_ARGS:-} 2>&1 | tee "$OUT/curve.log"
