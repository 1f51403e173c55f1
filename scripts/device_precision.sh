#!/usr/bin/env bash
# Issue 13 (mixed precision + LM loss) on one GPU (H100 80GB or H200): about 5 minutes.
# Usage (device machine, repo root):
#   . .devbundle/setup.sh && export PYTHONPATH=$PWD:$PYTHONPATH && bash scripts/device_precision.sh [steps]
# steps: any of tests,step,loss (default: all); logs and JSON go to $OUT.
#   tests  tests/gpu/test_precision_gpu.py: lm_loss (chunked, liger) against the full logits on CUDA,
#          the fused AdamW over fp32 masters against torch's AdamW, exact bf16 resume on one GPU
#   step   bench precision --sections step: the real shape (d_model 4096, 2 layers, E=64, K=8,
#          I=1536, 32768 tokens, bf16, W=1) through Engine.train_step: old (bf16 AdamW, for-loop) |
#          new (fp32 masters, fused) | new_foreach; forward/backward/optimizer ms and % of the step
#   loss   bench precision --sections loss: lm_loss at N=32768, V=151936, H=4096 bf16: full fp32
#          logits | chunked | liger; forward+backward ms, peak memory above the inputs
# Liger-Kernel is used where it imports. The GPU machine has no network: put its wheel in
# .devbundle/ (`pip download liger-kernel --no-deps -d .devbundle`); this script installs it.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-tests,step,loss}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpus.txt"
if ! python3 -c "import liger_kernel" 2>/dev/null; then
  for w in .devbundle/liger_kernel-*.whl; do
    [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w"
  done
fi
python3 -c "
import torch, triton
from ray_moe.model.loss import liger_available
print(f'torch {torch.__version__}, triton {triton.__version__}, liger_kernel: {liger_available()}')
" | tee "$OUT/versions.txt"
if has tests; then
  timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider --noconftest -rs tests/gpu/test_precision_gpu.py 2>&1 \
    | tee "$OUT/gpu_precision_tests.log" | tail -8
fi
if has step; then
  timeout ${T_STEP:-330} python3 -m ray_moe.cli bench precision --sections step --json "$OUT/bench_precision_step.json" \
    2>&1 | tee "$OUT/bench_precision_step.log" | tail -12
fi
if has loss; then
  timeout ${T_LOSS:-150} python3 -m ray_moe.cli bench precision --sections loss --json "$OUT/bench_precision_loss.json" \
    2>&1 | tee "$OUT/bench_precision_loss.log" | tail -10
fi
exit 0
