#!/usr/bin/env bash
# Issue 8 recipe: the scaling runs on 4 or 8 GPUs of one host (nvidia-h200-x4 / -x8).
# Usage (device machine, repo root):  . .devbundle/setup.sh && bash scripts/device_scaling.sh [steps]
# steps: any of comm,layer,twonode,balance,smoke (default: all); logs and JSON go to $OUT.
#   comm     bench comm at W = all GPUs (H=4096, K=8, E=128), T_local 4096 and 16384
#   layer    bench layer --sections ep at W = all GPUs, T = 131072 global, E=128 (SonicMoE's EP shape)
#   twonode  W = all GPUs as two Ray nodes of half the GPUs each, the inter-node (put) path forced:
#            bench comm and the EP layer again
#   balance  bench balance --mode train with Zipf-skewed routing at W = all GPUs
#   smoke    ray-moe smoke on one Ray node holding every GPU
# Every step has its own timeout (T_* variables); a failing step does not stop the next one.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-comm,layer,twonode,balance,smoke}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
mkdir -p /tmp/site/bin  # the carried Ray has no console scripts: a `ray` launcher
printf '#!/usr/bin/env python3\nimport sys\nfrom ray.scripts.scripts import main\nsys.argv[0] = "ray"\nsys.exit(main())\n' > /tmp/site/bin/ray
chmod +x /tmp/site/bin/ray
export PATH=/tmp/site/bin:$PATH
W=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
echo "W=$W"
quiet() { grep -v "^(" | grep -v "socket.cpp"; }
one_node() {  # a Ray head with every GPU; prints its address
  ray stop --force >/dev/null 2>&1
  ray start --head --port=6391 --num-gpus="$W" --num-cpus=$((4 * W)) --include-dashboard=false > "$OUT/ray_$1.log" 2>&1
  echo 127.0.0.1:6391
}
if has comm; then
  ADDR=$(one_node comm)
  timeout ${T_COMM:-240} python3 -m ray_moe.bench.comm --address "$ADDR" --tokens 4096,16384 --experts 128 \
    --variants r8h4096w16,r4h4096w16,r2h4096w16 --json "$OUT/bench_comm_w$W.json" 2>&1 | quiet | tail -12
fi
if has layer; then
  ADDR=$(one_node layer)
  timeout ${T_LAYER:-420} python3 -m ray_moe.cli bench layer --sections ep --world-size "$W" --address "$ADDR" \
    --T 131072 --H 4096 --I 1536 --E 128 --K 8 --transport nvshmem --ep-iters 6 \
    --json "$OUT/bench_layer_ep_w$W.json" 2>&1 | quiet | tail -8
fi
if has twonode; then
  ray stop --force >/dev/null 2>&1
  timeout 120 python3 cluster/local_cluster.py start --nodes 2 --gpus-per-node $((W / 2)) \
    --cpus-per-node $((2 * W)) --no-auth --state /tmp/lc.json > "$OUT/local_cluster.log" 2>&1
  ADDR=$(python3 -c 'import json; print(json.load(open("/tmp/lc.json"))["address"])')
  timeout ${T_TWO_COMM:-240} python3 -m ray_moe.bench.comm --address "$ADDR" --tokens 16384 --experts 128 \
    --variants r8h4096w16 --force-remote --json "$OUT/bench_comm_w${W}_two_nodes_remote.json" 2>&1 | quiet | tail -6
  timeout ${T_TWO_LAYER:-420} python3 -m ray_moe.cli bench layer --sections ep --world-size "$W" --address "$ADDR" \
    --T 131072 --H 4096 --I 1536 --E 128 --K 8 --transport nvshmem --force-remote-path --ep-iters 6 \
    --json "$OUT/bench_layer_ep_w${W}_two_nodes_remote.json" 2>&1 | quiet | tail -8
  python3 cluster/local_cluster.py stop --state /tmp/lc.json > /dev/null 2>&1
fi
if has balance; then
  ADDR=$(one_node balance)
  timeout ${T_BAL:-240} python3 -m ray_moe.cli bench balance --mode train --world-size "$W" --address "$ADDR" \
    --experts $((8 * W)) --top-k 4 --tokens-per-rank 8192 --d-model 4096 --expert-hidden 1536 --clone-slots 2 \
    --zipf 0 1.2 --iters 12 --device cuda --transport nvshmem --json "$OUT/bench_balance_w$W.json" 2>&1 | quiet | tail -6
fi
if has smoke; then
  ADDR=$(one_node smoke)
  timeout ${T_SMOKE:-240} python3 -m ray_moe.cli smoke --address "$ADDR" --device cuda --transport nvshmem \
    --world-size "$W" --bandwidth-mib 64 --json "$OUT/smoke_w$W.json" 2>&1 | quiet | tail -12
fi
ray stop --force >/dev/null 2>&1
exit 0
