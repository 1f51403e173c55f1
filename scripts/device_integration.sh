#!/usr/bin/env bash
# One device call for the integration work (issues 4-7 on nvidia-h200-x2): GPU training/parity
# tests, the EP layer benchmark, re-cloning under skewed routing, the smoke test on two Ray nodes.
# Usage (device machine, repo root):  . .devbundle/setup.sh && bash scripts/device_integration.sh [steps]
# steps: any of kernels,tests,layer,balance,smoke (default: all but kernels); logs go to $OUT.
# kernels: the expert-kernel GPU tests on GPU 1 while `bench layer` (expert, ffn) runs on GPU 0.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-tests,layer,balance,smoke}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
# The carried Ray has no console scripts: a `ray` launcher for local_cluster.py.
mkdir -p /tmp/site/bin
printf '#!/usr/bin/env python3\nimport sys\nfrom ray.scripts.scripts import main\nsys.argv[0] = "ray"\nsys.exit(main())\n' > /tmp/site/bin/ray
chmod +x /tmp/site/bin/ray
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
if has kernels; then
  CUDA_VISIBLE_DEVICES=1 timeout ${T_KTESTS:-240} python3 -m pytest -q -p no:cacheprovider --noconftest \
    tests/gpu/test_kernels_gpu.py > "$OUT/gpu_kernel_tests.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout ${T_KBENCH:-240} python3 -m ray_moe.cli bench layer --sections expert,ffn \
    --warmup-ms 25 --rep-ms 150 --json "$OUT/bench_layer_1gpu.json" 2>&1 | tee "$OUT/bench_layer_1gpu.log" | tail -30
  wait
  tail -5 "$OUT/gpu_kernel_tests.log"
fi
if has tests; then
  timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_training_gpu.py 2>&1 \
    | tee "$OUT/gpu_training_tests.log" | grep -v "^(" | tail -25
fi
if has layer; then
  timeout ${T_LAYER:-150} python3 -m ray_moe.cli bench layer --sections ep --world-size 2 --T 32768 \
    --H 4096 --I 1536 --E 64 --K 8 --transport nvshmem --ep-iters 8 --json "$OUT/bench_layer_ep.json" 2>&1 \
    | tee "$OUT/bench_layer_ep.log" | grep -v "^(" | tail -8
fi
if has balance; then
  timeout ${T_BAL:-120} python3 -m ray_moe.cli bench balance --mode train --world-size 2 --experts 16 \
    --top-k 4 --tokens-per-rank 8192 --d-model 4096 --expert-hidden 1536 --clone-slots 2 --zipf 0 1.2 \
    --iters 6 --device cuda --transport nvshmem --json "$OUT/bench_balance_train.json" 2>&1 \
    | tee "$OUT/bench_balance_train.log" | grep -v "^(" | tail -6
fi
if has smoke; then
  timeout 90 python3 cluster/local_cluster.py start --nodes 2 --gpus-per-node 1 --cpus-per-node 8 --no-auth \
    --state /tmp/lc.json > "$OUT/local_cluster.log" 2>&1
  ADDR=$(python3 -c 'import json; print(json.load(open("/tmp/lc.json"))["address"])')
  timeout ${T_SMOKE:-150} python3 -m ray_moe.cli smoke --address "$ADDR" --device cuda --transport nvshmem \
    --json "$OUT/smoke_gpu.json" 2>&1 | tee "$OUT/smoke_gpu.log" | grep -v "^(" | tail -30
  python3 cluster/local_cluster.py stop --state /tmp/lc.json >/dev/null 2>&1
fi
