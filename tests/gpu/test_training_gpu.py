"""The layer and the training driver on real GPUs (run on the GPU machine; skipped without CUDA).

The NCCL transport (torch all_to_all_single) against the oracle in bf16, and short training
runs of a bf16 MoE LM with the Triton expert kernels over NCCL and over NVSHMEM, on two GPUs
where the machine has them, else one.
"""

from __future__ import annotations

import math

import pytest

from tests.support import gpu_ranks

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2


@pytest.mark.parametrize("case", [dict(), dict(routing="empty_rank"), dict(routing="one_expert", top_k=1),
                                  dict(tokens_per_rank=[1, 33], top_k=4)])
def test_nccl_layer_parity_bf16(case):
    W, per_gpu = gpu_ranks()
    if per_gpu > 1:
        pytest.skip("NCCL refuses two ranks on one GPU (RAY_MOE_PES_PER_GPU > 1)")
    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup
    from ray_moe.validation import Case
    from ray_moe.validation.layer import layer_parity

    cfg = Config.from_dict({"parallel": {"world_size": W, "device": "cuda", "transport": "nccl",
                                         "workers_per_gpu": per_gpu},
                            "moe": {"num_experts": 8}})
    if W == 1 and case.get("tokens_per_rank") == [1, 33]:
        case = dict(case, tokens_per_rank=[17])  # one rank: a single token's router gradient is bf16 noise
    with WorkerGroup(cfg) as g:
        for impl in ("triton", "grouped_mm"):
            res = g.execute(layer_parity, Case(seed=3, dtype="bfloat16", hidden=64,
                                                    expert_hidden=96, expert_impl=impl, **case))
            for rank, errs in enumerate(res):
                bad = {k: v for k, v in errs.items() if not v <= BF16_TOL}
                assert not bad, f"{impl} rank {rank} {case}: {bad}"


@pytest.mark.parametrize("transport", ["nccl", "nvshmem"])
def test_gpu_training_learns(tmp_path, transport):
    W, per_gpu = gpu_ranks()
    if per_gpu > 1 and transport == "nccl":
        pytest.skip("NCCL refuses two ranks on one GPU (RAY_MOE_PES_PER_GPU > 1)")
    if transport == "nvshmem":
        pytest.importorskip("nvshmem.core")
    from ray_moe.config import Config
    from ray_moe.driver.trainer import Trainer

    cfg = Config.from_yaml("jobs/gpu_2x.yaml", [
        f"parallel.transport={transport}", f"parallel.world_size={W}", f"parallel.workers_per_gpu={per_gpu}",
        "train.steps=30", "train.eval_interval=0",
        "train.checkpoint_interval=0", "train.plots=false", f"train.run_dir={tmp_path}",
        "model.n_layers=2", "model.d_model=256", "model.n_heads=4", "model.seq_len=256",
        "moe.expert_hidden=256", "train.batch_size=16", "data.max_bytes=2000000",
        "balance.enabled=true", "balance.clone_slots=1", "balance.interval=10",
    ])
    with Trainer(cfg, progress=False) as t:
        first = t.evaluate()
        t.train()
        last = t.evaluate()
        s = t.summary()
    assert s["transport"] == transport
    assert all(math.isfinite(m["loss"]) for m in t.metrics if "loss" in m)
    assert last < first - 0.5, (first, last)
    assert s["rebalances"] >= 2


def test_cuda_clock_times_the_device_work_between_marks_without_waiting():
    import torch

    from ray_moe.worker.step_clock import StepClock

    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    clock = StepClock(dev)
    clock.mark("start")
    for _ in range(20):
        a = a @ a / 64
    clock.mark("work")
    clock.mark("none")
    torch.cuda.current_stream(dev).synchronize()
    # 20 products of 4096^2 (2.7 TFLOP) take more than 0.1 ms on any GPU; nothing ran between the last two marks
    assert clock.seconds("start", "work") > 1e-4
    assert clock.seconds("work", "none") < clock.seconds("start", "work") / 10
