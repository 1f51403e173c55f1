#!/usr/bin/env bash
# The NVSHMEM transport on a GPU machine with two GPUs: its GPU tests, the inter-node test on two Ray
# nodes of one host (one GPU each: RAY_MOE_TWO_NODE_ADDRESS), one EP group per node of a rank mesh
# (twomesh), the comm benchmark, and the same over the inter-node put path forced on one host (--force-remote).
# Usage (GPU machine, repo root):  . .devbundle/setup.sh && bash scripts/nvshmem_device.sh [steps]
# steps: any of tests,twonode,twomesh,bench,benchremote (default: all but twomesh); logs go to $OUT.
# twomesh runs on one GPU as well (both Ray nodes on GPU 0 under MPS); twonode needs two.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-tests,twonode,bench,benchremote}
TOK=${TOKENS:-128,4096,16384}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
if has tests; then
  timeout ${T_TESTS:-420} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_nvshmem_gpu.py ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if has twonode; then
  ray() { python3 -c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; main()' "$@"; }
  ray stop --force >/dev/null 2>&1
  CUDA_VISIBLE_DEVICES=0 ray start --head --port=6390 --num-gpus=1 --num-cpus=8 --include-dashboard=false >"$OUT/ray_head.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 ray start --address=127.0.0.1:6390 --num-gpus=1 --num-cpus=8 >"$OUT/ray_worker.log" 2>&1
  tail -n 3 "$OUT/ray_head.log" "$OUT/ray_worker.log"
  RAY_MOE_TWO_NODE_ADDRESS=127.0.0.1:6390 timeout ${T_TWO:-240} python3 -m pytest -x -q -p no:cacheprovider \
    tests/gpu/test_nvshmem_gpu.py -k two_ray_nodes 2>&1 | tee "$OUT/two_nodes.log" | tail -20
  ray stop --force >/dev/null 2>&1
fi
if has twomesh; then  # the rank mesh: two Ray nodes, two PEs per GPU (MPS), one EP group per node
  # The second node takes GPU 1, or GPU 0 beside the first where the machine has one GPU (TWOMESH_GPU
  # overrides): then four PEs share GPU 0, and the nodes still split the ranks two and two.
  ray() { python3 -c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; main()' "$@"; }
  ray stop --force >/dev/null 2>&1
  SECOND_GPU=${TWOMESH_GPU:-$( [ "$(nvidia-smi -L | grep -c '^GPU')" -ge 2 ] && echo 1 || echo 0 )}
  echo "twomesh: node 0 on GPU 0, node 1 on GPU $SECOND_GPU" | tee "$OUT/two_nodes_mesh_gpus.txt"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  PATH=$PATH:/usr/local/nvidia/bin nvidia-cuda-mps-control -d || echo "MPS did not start"
  CUDA_VISIBLE_DEVICES=0 ray start --head --port=6390 --num-gpus=1 --num-cpus=8 --include-dashboard=false >"$OUT/ray_head.log" 2>&1
  CUDA_VISIBLE_DEVICES=$SECOND_GPU ray start --address=127.0.0.1:6390 --num-gpus=1 --num-cpus=8 >"$OUT/ray_worker.log" 2>&1
  RAY_MOE_TWO_NODE_GPUS=$( [ "$SECOND_GPU" = 0 ] && echo 1 || echo 2 ) \
  RAY_MOE_TWO_NODE_ADDRESS=127.0.0.1:6390 RAY_MOE_TEST_GPUS=2 RAY_MOE_PES_PER_GPU=2 timeout ${T_TWO:-240} \
    python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_mesh_gpu.py -k two_ray_nodes 2>&1 | tee "$OUT/two_nodes_mesh.log" | tail -20
  ray stop --force >/dev/null 2>&1
  echo quit | PATH=$PATH:/usr/local/nvidia/bin nvidia-cuda-mps-control >/dev/null 2>&1
fi
if has bench; then
  timeout ${T_BENCH:-400} python3 -m ray_moe.bench.comm --tokens "$TOK" --variants "${VARIANTS:-all}" \
    --json "$OUT/bench_comm.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^(" | tail -30
fi
if has benchremote; then
  timeout ${T_BREM:-100} python3 -m ray_moe.bench.comm --tokens 4096,16384 --variants r2h4096w16,r4h4096w16 --force-remote \
    --json "$OUT/bench_comm_remote.json" 2>&1 | tee "$OUT/bench_remote.log" | grep -v "^(" | tail -12
fi
