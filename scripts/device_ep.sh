#!/usr/bin/env bash
# Expert parallelism on the GPU machine, one command: the multi-PE GPU tests, the GPU tests at one
# rank per GPU, the comm sweep, the EP layer, the step at W ranks and the exposed gradient reduction.
# Runs on one GPU (several NVSHMEM PEs per GPU under CUDA MPS) and on several (W = all GPUs; pes2 on
# two GPUs is W=4). Typical times: tests 260-300 s at W=2 (more than 250 s at W=4), pes2 ~330 s,
# comm 70-140 s, layer 80-140 s, overlap ~110 s per depth, grad ~120 s: split the steps over
# commands that fit a 10-minute limit. GEMM speed drifts several % as a GPU heats, so compare
# variants with EP_ROUNDS / OV_ROUNDS >= 2 (ABBA order, medians).
# Usage (GPU machine, repo root):  . .devbundle/setup.sh && bash scripts/device_ep.sh [steps]
# steps (default: pes2,pes4,tests,comm,layer; a failing step does not stop the next one):
#   pes2, pes4  2 / 4 ranks on each GPU, of two GPUs at most unless RAY_MOE_TEST_GPUS says more
#               (RAY_MOE_PES_PER_GPU, under CUDA MPS): tests/gpu's
#               NVSHMEM transport tests (layout, validators, parity, clones, graph replay, reserve),
#               and with pes2 the HF families' short bf16 training runs and the training tests
#               (PES_FILES: other test files; NO_MPS=1: without MPS)
#   tests       one rank per GPU, W = all GPUs (RAY_MOE_TEST_GPUS: fewer): the same GPU tests
#               (TESTS_FILES: other test files)
#   comm        bench comm at W = all GPUs (COMM_WORLD: fewer; skipped on one GPU): T_local 128, 4096,
#               16384 (COMM_TOKENS), variants COMM_VARIANTS, on COMM_PROGRAMS (default 16,32,66)
#               programs: eager and graph-replayed; COMM_ARGS=--stages adds the kernels' timer stamps
#   layer       bench layer --sections ep at W = all GPUs (EP_WORLD: fewer; skipped on one GPU), with
#               and without Tuning.interleave (EP_INTERLEAVE), EP_ROUNDS rounds, against one GPU
#               running T_local and T tokens; EP_PROGRAMS: exchanges on that many SMs (0: all);
#               EP_PROFILE=1: each rank's kernel listing (python -m ray_moe.bench.timeline) of
#               EP_PROFILE_STEPS profiled steps in $OUT/traces_w<W>.tgz (EP_KEEP_TRACES=1: the raw traces too)
#   overlap     bench overlap at W = all GPUs (OV_WORLD: fewer; skipped on one GPU; not in the default list):
#               Qwen3-30B-A3B cut to OV_LAYERS (2,4) layers and the per-layer slope, 16384 tokens per
#               rank, against one rank, OV_ROUNDS (2) ABBA rounds; OV_VARIANTS: bench overlap's
#               --variants; OV_PROGRAMS: parallel.comm_programs (0: every SM); OV_CKPT: checkpointing;
#               OV_PROFILE=1: one profiled step per run, every rank's kernel listing in
#               $OUT/traces_overlap_w<W>.tgz
#   grad        bench grad_reduce at W = all GPUs (skipped on one GPU; not in the default list): the
#               exposed replicated-gradient reduction, ZeRO stages 0, 1, 2, Qwen3-30B-A3B cut to 2 layers
# Keep OUT as the runner gives it. Logs, JSON and a summary table (summary.md) go to $OUT; per-step
# timeouts T_* override the defaults.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_DEDUP_LOGS=0 RAY_MOE_INSTAFAIL=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-pes2,pes4,tests,comm,layer}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
SUMMARY="$OUT/summary.md"; echo "| step | result | seconds |" > "$SUMMARY"; echo "| --- | --- | --- |" >> "$SUMMARY"
quiet() { grep -v "^(" | grep -v "socket.cpp"; }
record() { echo "| $1 | $2 | $3 |" >> "$SUMMARY"; }
pytest_step() {  # name timeout files...: pytest with a per-test limit; the last line is the result
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m pytest -v --durations=0 -p no:cacheprovider --timeout "${T_TEST:-240}" "$@" 2>&1 \
    | tee "$OUT/$name.log" | quiet | grep -E "^FAILED|^E  | PASSED| FAILED| SKIPPED|passed|failed|Timeout" | cut -c1-300 | tail -40
  local rc=${PIPESTATUS[0]} result  # pytest's closing line ("N passed, M skipped ... in S s"), or why none
  result=$(grep -E '(^|= )(([0-9]+ [a-z]+)(, )?)+ in [0-9.]+s|no tests ran' "$OUT/$name.log" | tail -1 \
    | tr -d '=' | sed 's/^ *//; s/ *$//')
  if [ -z "$result" ]; then
    if [ "$rc" = 124 ]; then result="no summary: stopped by the timeout of the step ($limit s)"
    else result="no summary: pytest exited with $rc"; fi
  fi
  record "$name" "$result" $((SECONDS - t0))
  ray_stop
}
ray_stop() { python3 -c 'import sys; from ray.scripts.scripts import main; sys.argv=["ray","stop","--force"]; main()' >/dev/null 2>&1; }
archive_traces() {  # $OUT/$1/*.json.gz -> each trace's kernel listing, all in $OUT/$1.tgz
  # few files come back from the GPU machine: each trace's listing (what ran beside what, per stream) in one
  # archive; the raw traces too with EP_KEEP_TRACES=1. $2: the listing starts after the last kernel
  # named so (default nccl, the layer bench's barrier; '' for a training step's own reductions)
  [ -d "$OUT/$1" ] || return 0
  for f in "$OUT/$1"/*.json.gz; do
    python3 -m ray_moe.bench.timeline "$f" --width 48 --after "${2-nccl}" > "${f%.json.gz}.txt" 2>&1
    [ "${EP_KEEP_TRACES:-0}" = 1 ] || rm -f "$f"
  done
  tar czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"
}
mps_start() {  # CUDA MPS lets the spinning exchange kernels of several processes on one GPU run at once
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  PATH=$PATH:/usr/local/nvidia/bin nvidia-cuda-mps-control -d && echo "MPS on" || echo "MPS did not start"
}
mps_stop() { echo quit | PATH=$PATH:/usr/local/nvidia/bin nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1; }
# Nothing from an earlier run on a warm machine (an MPS daemon, a Ray cluster) may outlive it into this
# one: a run cut short by a time limit can leave both, and a leftover MPS daemon has broken a later
# run's Ray node. So clear them when the script starts and when it exits. A SIGKILL runs no trap, and
# bash runs one for SIGTERM only after the foreground command ends: give each inner timeout (T_*)
# room inside the outer one.
cleanup() {
  [ -d /tmp/mps-pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe mps_stop
  ray_stop
  return 0
}
cleanup
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

for P in 2 4; do
  has "pes$P" || continue
  [ "${NO_MPS:-0}" = 1 ] || mps_start
  files="tests/gpu/test_nvshmem_gpu.py"
  [ "$P" = 2 ] && files="$files tests/gpu/test_training_gpu.py tests/gpu/test_transport_spec_gpu.py
    tests/gpu/test_models_gpu.py::test_short_training_run tests/gpu/test_models_gpu.py::test_bf16_equal_to_transformers_on_an_nvshmem_group"
  files=${PES_FILES:-$files}  # PES_FILES: other test files for the multi-PE steps
  RAY_MOE_PES_PER_GPU=$P pytest_step "gpu_tests_pes$P" "${T_PES:-300}" $files
  [ "${NO_MPS:-0}" = 1 ] || mps_stop
done
if has tests; then
  RAY_MOE_TEST_GPUS=${RAY_MOE_TEST_GPUS:-$GPUS} pytest_step gpu_tests_w$GPUS "${T_TESTS:-420}" ${TESTS_FILES:-tests/gpu/test_nvshmem_gpu.py tests/gpu/test_training_gpu.py}
fi
CW=${COMM_WORLD:-$GPUS}  # COMM_WORLD: the exchange at fewer ranks than GPUs (e.g. W=2 on a 4-GPU machine)
if [ "$CW" -ge 2 ] && has comm; then
  t0=$SECONDS
  timeout "${T_COMM:-200}" python3 -m ray_moe.bench.comm --world-size "$CW" --tokens "${COMM_TOKENS:-128,4096,16384}" --variants "${COMM_VARIANTS:-all}" --programs "${COMM_PROGRAMS:-16,32,66}" ${COMM_ARGS:-} \
    --json "$OUT/bench_comm_w$CW.json" 2>&1 | quiet | tee "$OUT/bench_comm_w$CW.log" | tail -20
  record "bench comm W=$CW" "see bench_comm_w$CW.json" $((SECONDS - t0)); ray_stop
fi
EP_W=${EP_WORLD:-$GPUS}  # EP_WORLD: the layer at fewer ranks than GPUs (e.g. W=2 on a 4-GPU machine)
if [ "$EP_W" -ge 2 ] && has layer; then
  t0=$SECONDS
  timeout "${T_LAYER:-200}" python3 -m ray_moe.cli bench layer --sections ep --world-size "$EP_W" \
    --T $((16384 * EP_W)) --H 4096 --I 1536 --E 64 --K 8 --transport nvshmem --ep-programs "${EP_PROGRAMS:-0}" --ep-interleave "${EP_INTERLEAVE:-0,1}" --ep-iters "${EP_ITERS:-10}" --ep-rounds "${EP_ROUNDS:-1}" ${EP_PROFILE:+--ep-profile --ep-profile-steps "${EP_PROFILE_STEPS:-1}" --ep-trace-dir "$OUT/traces_w$EP_W"} ${EP_ARGS:-} \
    --json "$OUT/bench_layer_ep_w$EP_W.json" 2>&1 | quiet | tee "$OUT/bench_layer_w$EP_W.log" | tail -20
  record "bench layer ep W=$EP_W" "see bench_layer_ep_w$EP_W.json" $((SECONDS - t0)); ray_stop
  [ -n "${EP_PROFILE:-}" ] && archive_traces "traces_w$EP_W"
fi
if [ "$GPUS" -ge 2 ] && has overlap; then
  t0=$SECONDS; OV_W=${OV_WORLD:-$GPUS}
  timeout "${T_OVERLAP:-420}" python3 -m ray_moe.cli bench overlap --world-size "$OV_W" --layers "${OV_LAYERS:-2,4}" \
    --checkpointing "${OV_CKPT:-none}" --comm-programs "${OV_PROGRAMS:-0}" --rounds "${OV_ROUNDS:-2}" \
    --variants "${OV_VARIANTS:-sequential,rebalance+bf16_reduce}" ${OV_ARGS:-} \
    ${OV_PROFILE:+--trace-dir "$OUT/traces_overlap_w$OV_W"} \
    --json "$OUT/bench_overlap_w${OV_W}_g${OV_PROGRAMS:-0}.json" 2>&1 | quiet | tee "$OUT/bench_overlap_w${OV_W}_g${OV_PROGRAMS:-0}.log" | tail -12
  record "bench overlap W=$OV_W G=${OV_PROGRAMS:-0}" "see bench_overlap_w${OV_W}_g${OV_PROGRAMS:-0}.json" $((SECONDS - t0)); ray_stop
  [ -n "${OV_PROFILE:-}" ] && archive_traces "traces_overlap_w$OV_W" ""
fi
if [ "$GPUS" -ge 2 ] && has grad; then
  t0=$SECONDS
  timeout "${T_GRAD:-240}" python3 -m ray_moe.cli bench grad_reduce --world-size "$GPUS" --stages 0,1,2 \
    --moments bfloat16 --json "$OUT/bench_grad_reduce_w$GPUS.json" 2>&1 | quiet | tee "$OUT/bench_grad_reduce.log" | tail -12
  record "bench grad_reduce W=$GPUS" "see bench_grad_reduce_w$GPUS.json" $((SECONDS - t0)); ray_stop
fi
cat "$SUMMARY"
