#!/usr/bin/env bash
# Issue 13 (models) on one GPU (nvidia-h100-x1 or nvidia-h200): the HF families on the device.
# Usage (device machine, repo root):  . .devbundle/setup.sh && bash scripts/device_models.sh
#   1. bf16 equality with transformers on the GPU, each family, native placement and clones
#   2. a short training run of each family's tiny job with the Trainer (loss falls; a sample)
#   3. activation memory per token of a Qwen3-30B-A3B-shaped layer: none / moe / full
# Logs and JSON go to $OUT; about 3-4 minutes.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee "$OUT/versions.txt"
timeout ${T_MODELS:-420} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_models_gpu.py 2>&1 \
  | tee "$OUT/gpu_models_tests.log" | grep -v "^(" | grep -E "^\{|passed|failed|Error|assert" | tail -40
