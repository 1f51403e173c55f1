#!/usr/bin/env bash
# Issue 17 on ONE GPU (the multi-GPU targets need nvidia-h200-x2 or larger): the pipelined layer
# (moe.pipeline_chunks) and the exchange's host cost, about 4 minutes in all.
# Usage (device machine, repo root):
#   . .devbundle/setup.sh && export PYTHONPATH=$PWD:$PYTHONPATH && bash scripts/device_overlap.sh [steps]
# steps (default: all, in this order; each under its own timeout, T_* seconds; a failing step does
# not stop the next one); logs and JSON go to $OUT:
#   local    tests/gpu/test_pipeline_gpu.py: the pipelined layer over the local transport (side
#            stream, Triton experts): bf16 parity with the oracle, equal to the sequential layer,
#            CUDA-graph replay of forward+backward equal to eager               (no Ray)
#   nvshmem  tests/gpu/test_nvshmem_gpu.py at W=1 (one PE): bootstrap, the kernels' layout, the
#            pipelined layer's bf16 parity over NVSHMEM (per-chunk capacity), CUDA-graph replay of
#            the sequential and the pipelined layer                   (skipped without nvshmem4py)
#   host     bench comm --host-cost at T_local=128, W=1: eager dispatch+combine through Triton's JIT
#            (the launch path before this change) and through the launch cache, host issue time per
#            call, and the CUDA-graph replay                           (skipped without nvshmem4py)
#   ep       bench layer --sections ep at W=1, T=16384, H=4096, I=1536, E=64, K=8: the sequential
#            and the pipelined layer (4 chunks; with NVSHMEM also the exchange on 66 SMs) beside the
#            single-GPU layer (at W=1 "exposed communication" is the transport's own cost)
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-local,nvshmem,host,ep}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
quiet() { grep -v "^(" | grep -v "socket.cpp"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$OUT/versions.txt"
if python3 -c "import nvshmem.core" 2>/dev/null; then NV=1; TR=nvshmem; PROGS=0,66; else NV=0; TR=auto; PROGS=0; fi
echo "nvshmem4py: $NV (transport $TR)" | tee -a "$OUT/versions.txt"

if has local; then
  timeout ${T_LOCAL:-45} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pipeline_gpu.py 2>&1 \
    | tee "$OUT/gpu_pipeline_local.log" | tail -15
fi

# One Ray head holding the GPU for the remaining steps (they attach through RAY_ADDRESS).
if has nvshmem || has host || has ep; then
  mkdir -p /tmp/site/bin  # the carried Ray has no console scripts: a `ray` launcher
  printf '#!/usr/bin/env python3\nimport sys\nfrom ray.scripts.scripts import main\nsys.argv[0] = "ray"\nsys.exit(main())\n' > /tmp/site/bin/ray
  chmod +x /tmp/site/bin/ray
  export PATH=/tmp/site/bin:$PATH
  ray stop --force >/dev/null 2>&1
  timeout 60 ray start --head --port=6392 --num-gpus=1 --num-cpus=8 --include-dashboard=false > "$OUT/ray_head.log" 2>&1
  export RAY_ADDRESS=127.0.0.1:6392
fi

if has nvshmem && [ "$NV" = 1 ]; then
  timeout ${T_NV:-95} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_nvshmem_gpu.py \
    -k "bootstrap or kernel_layout or pipelined or cuda_graph_replay" 2>&1 | tee "$OUT/gpu_nvshmem_w1.log" | quiet | tail -20
fi

if has host && [ "$NV" = 1 ]; then
  timeout ${T_HOST:-30} python3 -m ray_moe.bench.comm --host-cost --world-size 1 --tokens 128 --iters 40 \
    --json "$OUT/bench_host_cost.json" 2>&1 | tee "$OUT/bench_host_cost.log" | quiet | tail -8
fi

if has ep; then
  timeout ${T_EP:-65} python3 -m ray_moe.cli bench layer --sections ep --world-size 1 --T 16384 --H 4096 \
    --I 1536 --E 64 --K 8 --transport "$TR" --ep-chunks 1,4 --ep-programs "$PROGS" --ep-iters 5 \
    --json "$OUT/bench_layer_ep_w1.json" 2>&1 | tee "$OUT/bench_layer_ep_w1.log" | quiet | tail -12
fi

ray stop --force >/dev/null 2>&1 || true
