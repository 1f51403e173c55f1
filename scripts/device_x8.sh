#!/usr/bin/env bash
# Eight GPUs of one host (H100 or H200), one step per run of at most 10 minutes.
# Usage (GPU machine, repo root):  . .devbundle/setup.sh && bash scripts/device_x8.sh STEP
# steps:
#   whole   Qwen3-30B-A3B, all 48 layers, at W=8 from jobs/qwen3_30b_a3b.yaml through the CLI as a user
#           runs it (random init, 16,384 tokens a rank, full recompute, ZeRO-2, compiled blocks), WHOLE_STEPS
#           (30) steps without and then with re-cloning (balance.clone_slots=4): metrics.jsonl's
#           tokens_per_s and peak memory per rank; TFLOP/s/GPU = 6 * active params * tokens/s/GPU
#           (attention FLOPs left out, as NeMo's count is quoted beside it in docs/RESULTS.md)
#   scale   bench overlap at W=4 and W=8 (2 and 4 layers, one rank as the baseline, 2 ABBA rounds) and
#           bench layer --sections ep at W=8 (against one GPU, same tokens per rank)
#   comm    bench comm at W=8 (dispatch and combine against the copy ceiling)
#   mesh    the rank mesh: bench overlap --ep 4 (EP4 x DP2) and --ep 8 (whole-world EP) at W=8, and
#           bench grad_reduce --ep 2 at W=4 (the replicas' expert-gradient reduction exposed)
# Logs and JSON go to $OUT; every step has its own timeout (T_STEP, default 560 s).
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEP=${1:?usage: device_x8.sh whole|scale|comm|mesh}
T=${T_STEP:-560}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
GPUS=$(nvidia-smi -L | wc -l)
[ "$GPUS" -ge 8 ] || { echo "device_x8.sh: needs 8 GPUs, found $GPUS"; exit 2; }
case "$STEP" in
  whole)
    for clones in 0 4; do
      timeout $((T / 2)) python3 -m ray_moe.cli train --config jobs/qwen3_30b_a3b.yaml \
        train.steps="${WHOLE_STEPS:-30}" train.eval_interval=0 train.checkpoint_interval=0 train.plots=false \
        train.run_dir="$OUT/whole_c$clones" train.overwrite=true balance.enabled=$([ $clones = 0 ] && echo false || echo true) \
        balance.clone_slots=$clones balance.interval=10 2>&1 | tail -30 | tee "$OUT/whole_c$clones.log"
    done ;;
  scale)
    for W in 4 8; do
      timeout $((T / 3)) python3 -m ray_moe.cli bench overlap --world-size $W --layers 2,4 --rounds 2 \
        --variants sequential,rebalance+bf16_reduce --json "$OUT/overlap_w$W.json" 2>&1 | tail -12 | tee "$OUT/overlap_w$W.log"
    done
    timeout $((T / 3)) python3 -m ray_moe.cli bench layer --sections ep --world-size 8 --T $((16384 * 8)) \
      --H 4096 --I 1536 --E 64 --K 8 --transport nvshmem --ep-rounds 2 --json "$OUT/layer_ep_w8.json" 2>&1 | tail -20 ;;
  comm)
    timeout "$T" python3 -m ray_moe.bench.comm --world-size 8 --tokens 128,4096,16384 --variants all \
      --programs 32 --json "$OUT/comm_w8.json" 2>&1 | tail -30 ;;
  mesh)
    for ep in 4 8; do
      timeout $((T / 3)) python3 -m ray_moe.cli bench overlap --world-size 8 --ep $ep --layers 2 --rounds 2 \
        --variants sequential --json "$OUT/overlap_w8_ep$ep.json" 2>&1 | tail -12 | tee "$OUT/overlap_w8_ep$ep.log"
    done
    timeout $((T / 3)) python3 -m ray_moe.cli bench grad_reduce --world-size 4 --ep 2 --stages 0,1,2 \
      --device cuda --transport nccl --json "$OUT/grad_reduce_ep2dp2.json" 2>&1 | tail -12 ;;
  *) echo "device_x8.sh: unknown step $STEP (whole, scale, comm, mesh)"; exit 2 ;;
esac
