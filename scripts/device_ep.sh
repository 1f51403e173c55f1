#!/usr/bin/env bash
# Expert parallelism on the device, one command (issue 23): the multi-PE GPU tests, the comm sweep
# and the EP layer. Runs on one GPU (several NVSHMEM PEs per GPU under CUDA MPS) and on any
# multi-GPU kind (W = all GPUs; pes2 on two GPUs is W=4). Measured on nvidia-h100-x2 (session 11,
# 2026-11-25): tests with TESTS_FILES=tests/gpu/test_nvshmem_gpu.py ~260 s (test_force_remote_path
# alone ~60 s), the training tests ~150 s, pes2 with PES_FILES=tests/gpu/test_nvshmem_gpu.py ~330 s,
# comm 139 s (84 s on H200), layer 81-85 s; pes2 with every NVSHMEM test 250 s on H200 x2 (session 12);
# a fresh machine costs ~60 s of the budget before the command starts, and it goes back after 30 s
# idle, so chain calls. Session 15 ran on H200 x4 (docs/BENCHMARKS.md, "Session 15"): at W=4
# the whole NVSHMEM test file takes more than 250 s (layout 48 s and the parity cases 107 s at W=8),
# comm with every variant more than 150 s (pick COMM_VARIANTS), the layer 97-136 s. Session 16 (H200 x4):
# layer with 12 variants and EP_PROFILE=1 185 s; EP_WORLD=2 with 6 variants 115 s. Done since: the W=8
# clone test, the overlapped update at W=4, the SM ceiling, the pipelined profile (chunking alone
# costs the step 5-17 %, so no chunked overlap wins; docs/BENCHMARKS.md, "Session 16"). Session 17
# (H200 x2, x4): the power-capped GEMMs slow several % as the GPU heats, so compare variants with
# EP_ROUNDS >= 3 (ABBA order, medians; layer at W=2 with 4 variants x 4 rounds 144 s, W=4 with
# 4 x 3 rounds 166 s). Keep OUT as the tool gives it (an exported OUT=/tmp/... loses the JSON). Session 19
# (H200 x2, x4): bench overlap ~110 s per depth at W=2 and W=4 (2 rounds); the two-batch parity tests
# ~75 s at W=4. Session 20 (H200 x2, x4): -k two_batch over test_nvshmem_gpu.py + test_models_gpu.py
# 170 s at W=2, 182 s at W=4; overlap with OV_ROUNDS=1 ~100 s. Whole-step listings need
# EP_KEEP_TRACES=1 only to re-read them offline (the .txt listings now start at the first kernel).
# Session 21 (H200 x2/x4, H100 x2/x4): overlap with 3 variants x 2 rounds at 2 layers 110-160 s (W=2, W=4);
# comm at COMM_TOKENS=128 with the latency floor 31-44 s; tests/gpu/test_zero_gpu.py's overlapped-update
# cases 100-130 s, the compiled-blocks ZeRO test 81 s. Done since: ZeRO's update beside the next forward
# (parallel.overlap_param_gather, the default), bf16 reduction, the imbalance column and rebalance variant.
# Session 22 (H200 x2): the four overlapped-update cases + the clone-gradient test 150-160 s; overlap with
# 4 variants x 2 rounds at 2 layers 174 s, 3 variants x 1 round at 2,4 layers 138-142 s, 1 variant at
# 8 layers 60-66 s (peak 61 GiB at W=2, 89 GiB one rank); layer with 1 variant x 3 rounds 92 s. Done
# since: the two-batch step re-timed at W=2 after the race fix (still slower), clone gradients sent
# during backward (rebalance+bf16_reduce the fastest W=2 step: 0.958 at 2 layers, 0.975 at 4).
# Session 23 (H100 x2, then H200 x2): the four overlapped-update cases + both clone-gradient cases 215 s
# on H100; comm COMM_TOKENS=16384,128 (2 variants, now with the hybrid ceiling) 43 s; COMM_TOKENS=128
# with every variant's timer stamps 43 s; layer 1 variant x 3 rounds 84 s. Done since: session 22's
# CPU-only GPU checks passed; where the small pair's time goes (the release before each arrival
# signal, 3.6-4.4 us per kernel: <= 20 us needs flags inside the data); the hybrid (copy engines +
# SMs) ceiling read below the copy engines', but the SM copy waited for the host each call (fixed):
# re-run COMM_TOKENS=16384 ... comm to settle whether a hybrid dispatch could gain; the stamps then
# in exact ns (they were rounded to 0.256 us).
# Session 24 (H200 x4): comm W=4 COMM_TOKENS=16384,128 (2 variants) 64 s; comm at W=2 on two of the
# four GPUs 60-62 s with CUDA_VISIBLE_DEVICES=0,1 COMM_WORLD=2 (a first try with all four visible, right
# after the W=4 run, hit its 90-s limit after its last variant: not diagnosed; bench comm's progress lines
# now carry seconds and name each phase, so a repeat shows where it waits); overlap W=4 with 2 variants
# x 2 layers x 2 rounds 213-226 s; six NVSHMEM tests at W=4 375 s (interleaved copy-out parity 185 s).
# Done since: the corrected ceilings (W=2: copy engines 356, SMs 353, both 332: the links bound it),
# where a large dispatch's time goes (COMM_ARGS=--stages: rows at the ceiling, layout 12 us, the copy-out
# of the received rows 40-54 us), the two-batch step at W=4 (opt-in stays), rebalance+bf16_reduce at W=4
# (-8.6 % / -4.3 %).
# Next lease:
#   1. x8: the default steps with T_TESTS=500 and COMM_VARIANTS=r8h4096w16rot,r8h4096w16 (scaling
#      target >= 0.90 at W=8; never lent so far), and OV_VARIANTS=sequential,rebalance+bf16_reduce ... overlap
#   2. once built: the expert GEMM reading the received rows in the symmetric region (no copy-out: 40-54 us
#      of the 437-us dispatch at T_local=16384), then COMM_ARGS=--stages ... comm at W=2 and W=4
#   3. once built: the halves' weight gradients accumulated in the Triton wgrad epilogue (session 20:
#      +1.8 ms of per-half weight gradients and additions at W=2, 2 layers)
# On one GPU, pes2 with every file took ~360 s.
# Usage (device machine, repo root):  . .devbundle/setup.sh && bash scripts/device_ep.sh [steps]
# steps (default: pes2,pes4,tests,comm,layer; a failing step does not stop the next one):
#   pes2, pes4  2 / 4 ranks on each GPU, of two GPUs at most unless RAY_MOE_TEST_GPUS says more
#               (RAY_MOE_PES_PER_GPU, under CUDA MPS): tests/gpu's
#               NVSHMEM transport tests (layout, validators, parity, clones, graph replay, reserve),
#               and with pes2 the HF families' short bf16 training runs and the training tests
#   tests       one rank per GPU, W = all GPUs (RAY_MOE_TEST_GPUS: fewer): the same GPU tests
#               (TESTS_FILES: other test files)
#   comm        bench comm at W = all GPUs (COMM_WORLD: fewer; skipped on one GPU): T_local 128, 4096, 16384, also with
#               COMM_PROGRAMS (default 16,32,66) programs: eager and graph-replayed, for small-T latency
#   layer       bench layer --sections ep at W = all GPUs (EP_WORLD: fewer; skipped on one GPU): sequential and
#               pipelined (EP_CHUNKS, default 1,2; 1-6-1: chunks of those relative sizes; EP_ROUNDS: run them
#               that many times, ABBA order, medians), each without and
#               with Tuning.interleave (EP_DELAY_WGRAD: and moe.delay_wgrad), against
#               one GPU running T_local and T tokens (EP_PROFILE=1: the kernels of EP_PROFILE_STEPS
#               (default 1) back-to-back EP steps of every variant, per step and per rank's exchanges,
#               each rank's kernel listing (python -m ray_moe.bench.timeline) in $OUT/traces_w<W>.tgz, against
#               a rank's own compute; EP_PROGRAMS, default 0: exchanges on that many SMs, e.g.
#               16,32 with EP_DELAY_WGRAD=1, which can only overlap the backward exchange with the
#               weight gradients when the exchange leaves SMs free)
#   overlap     bench overlap at W = all GPUs (OV_WORLD: fewer; skipped on one GPU; not in the default list):
#               Qwen3-30B-A3B cut to OV_LAYERS (2,4) layers and the per-layer slope, 16384 tokens per rank, the step with each rank's
#               batch in one pass and as two staggered halves (moe.two_batch_overlap), OV_ROUNDS (2) ABBA
#               rounds, against one rank; OV_VARIANTS: bench overlap's --variants (e.g.
#               sequential,param_gather,param_gather+bf16_reduce); OV_PROGRAMS: parallel.comm_programs (0: every SM); OV_CKPT: checkpointing;
#               OV_PROFILE=1: one profiled step per run of the first round, every rank's kernel listing in
#               $OUT/traces_overlap_w<W>.tgz
#   grad        bench grad_reduce at W = all GPUs (skipped on one GPU; not in the default list):
#               issue 27's exposed replicated-gradient reduction, ZeRO stages 0, 1, 2, Qwen3-30B-A3B
#               cut to 2 layers; fits the `comm,layer` call (`comm,layer,grad`)
# Logs, JSON and a summary table (summary.md) go to $OUT; per-step timeouts T_* override defaults.
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
  # the device tool returns ~8 files: each trace's listing (what ran beside what, per stream) in one
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
# Nothing from an earlier run on a warm machine (an MPS daemon, a Ray cluster) may outlive it into this one: a
# run cut short by the device tool's limit can leave both (session 27: a pes2 step found call 1's MPS daemon
# still running; the W=2 NVSHMEM tests after it lost their Ray node, cause not known). So clear them when the
# script starts and when it exits. A SIGKILL runs no trap, and bash runs one for SIGTERM only after the
# foreground command ends: give each inner timeout (T_*) room inside the outer one.
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
CW=${COMM_WORLD:-$GPUS}  # COMM_WORLD: the exchange at fewer ranks than GPUs (W=2 on an x4 lease)
if [ "$CW" -ge 2 ] && has comm; then
  t0=$SECONDS
  timeout "${T_COMM:-200}" python3 -m ray_moe.bench.comm --world-size "$CW" --tokens "${COMM_TOKENS:-128,4096,16384}" --variants "${COMM_VARIANTS:-all}" --programs "${COMM_PROGRAMS:-16,32,66}" ${COMM_ARGS:-} \
    --json "$OUT/bench_comm_w$CW.json" 2>&1 | quiet | tee "$OUT/bench_comm_w$CW.log" | tail -20
  record "bench comm W=$CW" "see bench_comm_w$CW.json" $((SECONDS - t0)); ray_stop
fi
EP_W=${EP_WORLD:-$GPUS}  # EP_WORLD: the layer at fewer ranks than GPUs (W=2 on an x4 lease)
if [ "$EP_W" -ge 2 ] && has layer; then
  t0=$SECONDS
  timeout "${T_LAYER:-200}" python3 -m ray_moe.cli bench layer --sections ep --world-size "$EP_W" \
    --T $((16384 * EP_W)) --H 4096 --I 1536 --E 64 --K 8 --transport nvshmem --ep-chunks "${EP_CHUNKS:-1,2}" --ep-programs "${EP_PROGRAMS:-0}" --ep-interleave "${EP_INTERLEAVE:-0,1}" --ep-iters "${EP_ITERS:-10}" --ep-rounds "${EP_ROUNDS:-1}" ${EP_PROFILE:+--ep-profile --ep-profile-steps "${EP_PROFILE_STEPS:-1}" --ep-trace-dir "$OUT/traces_w$EP_W"} --ep-delay-wgrad "${EP_DELAY_WGRAD:-0,1}" --ep-early "${EP_EARLY:-0}" ${EP_ARGS:-} \
    --json "$OUT/bench_layer_ep_w$EP_W.json" 2>&1 | quiet | tee "$OUT/bench_layer_w$EP_W.log" | tail -20
  record "bench layer ep W=$EP_W" "see bench_layer_ep_w$EP_W.json" $((SECONDS - t0)); ray_stop
  [ -n "${EP_PROFILE:-}" ] && archive_traces "traces_w$EP_W"
fi
if [ "$GPUS" -ge 2 ] && has overlap; then
  t0=$SECONDS; OV_W=${OV_WORLD:-$GPUS}
  timeout "${T_OVERLAP:-420}" python3 -m ray_moe.cli bench overlap --world-size "$OV_W" --layers "${OV_LAYERS:-2,4}" \
    --checkpointing "${OV_CKPT:-none}" --comm-programs "${OV_PROGRAMS:-0}" --rounds "${OV_ROUNDS:-2}" \
    --variants "${OV_VARIANTS:-sequential,two_batch}" ${OV_ARGS:-} \
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
