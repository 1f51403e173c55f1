#!/usr/bin/env bash
# One GPU: the real model's step beside torchtitan, the optimizer's share of a step, the MoE layer
# beside SonicMoE, and the one-rank GPU tests; each fits one step of 10 minutes.
# Usage (GPU machine, repo root), with the bundle each step needs:
#   . .titanbundle/setup.sh && . .devbundle/setup.sh && bash scripts/device_step.sh train,moments
#   . .sonicbundle/setup.sh && bash scripts/device_step.sh sonic     # a command of its own (bundle sizes)
#   . .titanbundle/setup.sh && bash scripts/device_step.sh families  # Qwen3, DeepSeek-V3 beside torchtitan, FP8
#   . .titanbundle/setup.sh && bash scripts/device_step.sh gptoss    # a command of its own (flex autotuning)
#   . .devbundle/setup.sh && . .aobundle/setup.sh && bash scripts/device_step.sh gputests  # one-rank GPU tests
# steps (comma list; default train,moments); logs and JSON go to $OUT:
#   train    bench train at 2 and 4 layers of Qwen3-30B-A3B's layer shape: ray_moe eager and
#            compiled, torchtitan eager and compiled, both with full recompute (--titan-ac full
#            matches model.activation_checkpointing=full); the step, the part outside the layers
#            and the per-layer time come from the 2- and 4-layer rows of one run
#            (docs/RESULTS.md#step-vs-torchtitan)
#   qwen3, dsv3, gptoss   bench train of one family's 4 layers beside torchtitan's model of that
#            family, both compiled (--skip-eager), full recompute, the attention's share of each
#            step (--attention-share): Qwen3-30B-A3B at 16,384 tokens; four DeepSeek-V3 MoE layers
#            (MLA; its three dense first layers made MoE layers, first_k_dense_replace=0) with its
#            256 routed experts cut to 8 (--experts 8: top-8 of 8, every token through 8 experts of
#            2048 as in the published model) and gpt-oss-20b, each at 8,192 tokens with bf16 AdamW
#            moments (to fit 80 GB: python -m ray_moe.arch on that config, 63.5 GiB at the peak).
#            The preset and flags of each: QWEN3_ARGS, DSV3_ARGS (DSV3_SET: its config overrides), GPTOSS_ARGS
#   fp8      bench train of Qwen3-30B-A3B's 4 layers with bf16 and with FP8 experts
#            (moe.expert_precision=fp8), ABBA in one run, the ratio to bf16's step (FP8_VARIANTS)
#   families qwen3,dsv3,fp8 (their limits add up to 420 s); gptoss takes a command of its own:
#            torchtitan's gpt-oss autotunes its flex attention for minutes (past 140 s on 2026-12-07)
#   moments  bench precision --sections step with fp32 and bf16 AdamW moments, each also with
#            train.overlap_update (MOMENT_VARIANTS; optimizer_exposed_pct is the part nothing hides;
#            docs/RESULTS.md#optimizer-share)
#   sonic    the MoE layer beside SonicMoE at E=128 and E=64 (docs/RESULTS.md#layer-vs-sonicmoe);
#            SonicMoE's GEMM autotuning outlasts a 10-minute step unless its compiled configs
#            travel with it: build them first without a GPU (bash scripts/make-sonic-kernels.sh,
#            ~5 min) and carry .sonicbundle and .sonickernels: this step unpacks them into QUACK_CACHE_DIR
#   gputests every one-rank GPU test file, one after another (a fault or a hang in one cannot take
#            the others with it; never beside each other under MPS), each with its own limit
#            (T_FILE, 240 s; the step starts no file after T_GPUTESTS, 560 s: split the list over
#            commands with GPUTESTS_FILES), a line per
#            file in $OUT/summary.md and the logs in one archive, $OUT/gputests.tgz;
#            GPUTESTS_FILES: other files (default: tests/gpu/ but the multi-rank ones, which
#            scripts/device_ep.sh runs); the optimizer's own: test_precision_gpu.py test_zero_gpu.py;
#            GPUTESTS_K: a pytest -k expression applied to every file (e.g. "fp32_equal or clamp")
# Time limits (seconds) per step: T_GPUTESTS (and T_FILE per file), T_TRAIN, T_MOMENTS, T_SONIC, T_QWEN3, T_DSV3, T_GPTOSS, T_FP8
# (each bench writes its JSON after every row: a step cut short keeps the rows it finished).
# A tile A/B of one GEMM role alone: python3 -m ray_moe.bench.layer ... --sections kernels,ffn --sweep
# --sweep-roles ROLE (~60-100 s per E). Single-GPU benches need no Ray (python3 -m ray_moe.bench.layer
# and the ray-moe CLI), so they run with .sonicbundle, which cannot travel beside .devbundle; the
# pytest GPU tests need .devbundle (tests/conftest.py imports Ray).
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-train,moments}
STEPS=${STEPS//families/qwen3,dsv3,fp8}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')" | tee "$OUT/versions.txt"
if has gputests; then
  export RAY_AUTH_MODE=disabled  # the tests' own throwaway Ray clusters
  # an image may force TF32 on cuBLAS for every float32 matmul (read once at start); the float32
  # tests compare float32 models, so record it and run without it
  echo "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=${TORCH_ALLOW_TF32_CUBLAS_OVERRIDE-<unset>} (unset for the tests)" | tee "$OUT/tf32.txt"
  unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE
  GT_FILES=${GPUTESTS_FILES:-"tests/gpu/test_kernels_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_models_gpu.py
    tests/gpu/test_precision_gpu.py tests/gpu/test_zero_gpu.py tests/gpu/test_compile_gpu.py tests/gpu/test_linear_ce_gpu.py
    tests/gpu/test_memory_model_gpu.py tests/gpu/test_bench_gpu.py tests/gpu/test_dense_fp8_gpu.py"}
  mkdir -p "$OUT/gputests"; t_all=$SECONDS
  echo "| file | result | seconds |" > "$OUT/summary.md"; echo "| --- | --- | --- |" >> "$OUT/summary.md"
  for f in $GT_FILES; do
    if [ $((SECONDS - t_all)) -ge "${T_GPUTESTS:-560}" ]; then echo "| $f | not started: T_GPUTESTS reached | |" >> "$OUT/summary.md"; continue; fi
    t0=$SECONDS; log="$OUT/gputests/$(basename "$f" .py).log"
    timeout "${T_FILE:-240}" python3 -m pytest -q -rs -p no:cacheprovider --timeout 120 ${GPUTESTS_K:+-k "$GPUTESTS_K"} "$f" > "$log" 2>&1
    result=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    echo "| $f | ${result:-no summary (limit T_FILE)} | $((SECONDS - t0)) |" | tee -a "$OUT/summary.md"
    grep -E "^FAILED|^ERROR" "$log" | cut -c1-200 | head -8
  done
  tar czf "$OUT/gputests.tgz" -C "$OUT" gputests && rm -rf "${OUT:?}/gputests"
fi
if has train; then
  timeout ${T_TRAIN:-360} python3 -m ray_moe.cli bench train --layers 2,4 --titan yes --compile --titan-compile \
    --titan-ac full --set model.activation_checkpointing=full --json "$OUT/bench_train.json" \
    2>&1 | tee "$OUT/bench_train.log" | tail -20
fi
family() {  # family NAME LIMIT "BENCH ARGS" "CONFIG OVERRIDES": 4 layers beside torchtitan's, both compiled
  # shellcheck disable=SC2086  # $3 and $4 are word lists
  timeout "$2" python3 -m ray_moe.cli bench train --layers 4 --titan yes --compile --titan-compile --skip-eager \
    --attention-share --titan-ac full --warmup 1 --iters 3 $3 --json "$OUT/bench_train_$1.json" \
    --set model.activation_checkpointing=full $4 2>&1 | tee "$OUT/bench_train_$1.log" | tail -6
}
BF16_MOMENTS=train.optimizer_state_dtype=bfloat16
has qwen3 && family qwen3 "${T_QWEN3:-130}" "${QWEN3_ARGS:---preset qwen3-30b-a3b --tokens 16384}" ""
has dsv3 && family dsv3 "${T_DSV3:-160}" "${DSV3_ARGS:---preset deepseek-v3 --experts 8 --tokens 8192}" \
  "$BF16_MOMENTS ${DSV3_SET:-model.hf.first_k_dense_replace=0}"
has gptoss && family gptoss "${T_GPTOSS:-540}" "${GPTOSS_ARGS:---preset gpt-oss-20b --tokens 8192}" "$BF16_MOMENTS"
if has fp8; then
  timeout ${T_FP8:-130} python3 -m ray_moe.cli bench train --layers 4 --titan no --warmup 1 --iters 3 \
    --variants "${FP8_VARIANTS:-bf16=;fp8=moe.expert_precision=fp8}" --json "$OUT/bench_train_fp8.json" \
    2>&1 | tee "$OUT/bench_train_fp8.log" | tail -4
fi
if has moments; then
  timeout ${T_MOMENTS:-240} python3 -m ray_moe.cli bench precision --sections step --variants ${MOMENT_VARIANTS:-new,bf16_moments,bf16_moments_overlap,new_overlap} \
    --json "$OUT/bench_moments.json" 2>&1 | tee "$OUT/bench_moments.log" | tail -8
fi
if has sonic; then
  export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/tmp/qcache}
  if [ -f .sonickernels/sonic_kernels.tgz ] && [ ! -f "$QUACK_CACHE_DIR/.unpacked" ]; then
    mkdir -p "$QUACK_CACHE_DIR" && tar xzf .sonickernels/sonic_kernels.tgz -C "$QUACK_CACHE_DIR" \
      && touch "$QUACK_CACHE_DIR/.unpacked" && echo "SonicMoE's precompiled GEMMs unpacked into $QUACK_CACHE_DIR"
  fi
  timeout ${T_SONIC:-540} python3 -m ray_moe.bench.layer --warmup-ms 50 --rep-ms 400 --sections layer \
    --layer-E 128,64 --json "$OUT/bench_layer_sonic.json" 2>&1 | tee "$OUT/bench_layer_sonic.log" | tail -20
fi
