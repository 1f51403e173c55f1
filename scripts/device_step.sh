#!/usr/bin/env bash
# Issues 26 and 27 on one GPU (H100 80GB or H200): what is still to be measured, in one call.
# Usage (device machine, repo root), with the bundle each step needs:
#   . .titanbundle/setup.sh && . .devbundle/setup.sh && bash scripts/device_step.sh train,moments
#   . .sonicbundle/setup.sh && bash scripts/device_step.sh sonic     # a call of its own (bundle sizes)
# steps (comma list; default train,moments); logs and JSON go to $OUT:
#   train    bench train at 2 and 4 layers of Qwen3-30B-A3B's layer shape: ray_moe eager and with
#            model.compile=blocks, torchtitan eager and compiled, both with full recompute
#            (--titan-ac full matches model.activation_checkpointing=full); issue 26's step target
#            (<= 0.8x torchtitan compiled), the rest outside the layers (<= 80 ms) and the layer
#            (<= 38 ms) come from the 2- and 4-layer rows of one run
#   moments  bench precision --sections step with fp32 and bf16 AdamW moments, each also with
#            train.overlap_update (MOMENT_VARIANTS; issue 27: the optimizer <= 8 % of the step with
#            bf16 moments; optimizer_exposed_pct is the part nothing hides)
#   sonic    the MoE layer beside SonicMoE at E=128 and E=64 (issue 26: forward+backward <= 0.95x);
#            SonicMoE's GEMM autotuning outlasts a 10-minute call unless its compiled configs are
#            carried: build them first without a GPU (bash scripts/make-sonic-kernels.sh, ~5 min)
#            and carry [".sonicbundle", ".sonickernels"]: this step unpacks them into QUACK_CACHE_DIR
#   gputests the GPU tests of the optimizer and precision paths (test_precision_gpu.py,
#            test_zero_gpu.py): run it first after any change to worker/optim.py (session 9 moved
#            the fused AdamW update off torch.optim.AdamW; it had run on the CPU only)
# Budgets (seconds) per step: T_GPUTESTS, T_TRAIN, T_MOMENTS, T_SONIC; the whole must fit one 10-minute call.
# Session 25 (one H100): the one-dot up-projection ran, won (6.5-7.3 % alone) and is the Hopper default; the sonic
# step (~130 s with .sonickernels) gave 1.036 / 1.009 fwd+bwd at E=128 / 64, the train step 0.724x torchtitan.
# Session 26 (H100, H200): model.compile's default is now auto (blocks on CUDA); with it the pipeline, precision,
# training and transport-spec tests passed, the incremental decoding after holding it to the eager forward, the memory
# model re-banded (eager 0.89 measured, the new eager band not yet run; compiled 0.85-0.92);
# the down-projection's scale epilogue loads its weights before the main loop (0-2.3 % from the plain one after;
# the before-reading was noisy: re-time both with EP_ROUNDS-like rounds); a Gluon down-projection is correct
# but not faster (scripts/gluon_bench.py). Next lease: the multi-PE tests with compile on by default
# (. .devbundle/setup.sh && bash scripts/device_ep.sh pes2, ~400 s), tests/gpu/test_nvshmem_gpu.py after
# test_interleaved_copy_out_parity, and, on x2, tests/gpu/test_zero_gpu.py; whether E=64, T=128's small-T graph
# forward reads slow only beside SonicMoE (--sections small --layer-E 64, --impls ray_moe vs the default, one call
# with .sonicbundle); which term of the memory model over-counts (measured peak 0.68 GB above the end-of-backward
# state at 2 layers, the model 4.46 GB).
# Session 27 (H200 x2 only): with compile on by default, pes2 passed 26 + 3 (8 skipped), ZeRO 7, the memory model's
# eager band 6 + compiled 2, linear CE 4; the fused dSwiGLU epilogue (GemmConfig.epi_chunks) passed 23 of 60 GPU cases (production shape unrun)
# and timed level with the split form (E=64, H200): not adopted. Next lease: on x2, tests/gpu/test_zero_gpu.py -k "compiled or
# clone" (~200 s) and TESTS_FILES=tests/gpu/test_nvshmem_gpu.py bash scripts/device_ep.sh tests (W=2 on two GPUs:
# session 27's run lost its Ray node, cause unknown: save raylet logs, dmesg, nvidia-smi); pes2 with PES_FILES=
# tests/gpu/test_models_gpu.py::test_bf16_equal_to_transformers_on_an_nvshmem_group (6 of 9 cases unrun); the rest of
# tests/gpu/test_kernels_gpu.py -k "fused or both_dact" (37 of 60 unrun); on an H100 the sonic step and --sweep-roles
# dact at --E 128; with .sonicbundle + .sonickernels, python3 -m ray_moe.bench.layer --sections rows,wgrad --layer-E 128,64
# (new, never run: each row GEMM alone beside the quack kernel SonicMoE runs for it, same run, errors vs float32); OUT=$OUT pytest tests/gpu/test_memory_model_gpu.py (its memory_model.json rows now carry each
# phase's peak and end state, phase_peak / phase_end: which phase sets the peak, ~140 s; the peak: eager, the measured peak sits 0.65-0.91 GB above the end-of-backward state at every recompute mode; compiled 0.36).
# A tile A/B of one GEMM role alone: python3 -m ray_moe.bench.layer ... --sections kernels,ffn --sweep
# --sweep-roles ROLE (~60-100 s per E). Single-GPU benches need no Ray (python3 -m ray_moe.bench.layer, and the
# ray-moe CLI since session 25), so they run with .sonicbundle, which cannot travel beside .devbundle; the pytest
# GPU tests still need .devbundle (tests/conftest.py imports Ray).
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-train,moments}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')" | tee "$OUT/versions.txt"
if has gputests; then
  timeout ${T_GPUTESTS:-240} python3 -m pytest -q -p no:cacheprovider --timeout 180 \
    tests/gpu/test_precision_gpu.py tests/gpu/test_zero_gpu.py 2>&1 | tee "$OUT/gputests.log" | tail -15
fi
if has train; then
  timeout ${T_TRAIN:-360} python3 -m ray_moe.cli bench train --layers 2,4 --titan yes --compile --titan-compile \
    --titan-ac full --set model.activation_checkpointing=full --json "$OUT/bench_train.json" \
    2>&1 | tee "$OUT/bench_train.log" | tail -20
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
