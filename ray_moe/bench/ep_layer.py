"""Timing one MoE layer step (forward, backward, clone coherence) on every rank of a live group.

Shared by ``ray-moe bench layer --world-size W`` (EP rows: per-rank time against the
single-GPU layer) and ``ray-moe bench balance --mode train`` (skewed routing, cloning off vs
on). The step is what training does per MoE layer: route → dispatch → experts → combine,
backward, clone gradients onto owners, owners' weights into clones.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ray_moe.comm.base import BufferSpec
from ray_moe.comm.local import LocalTransport
from ray_moe.config import torch_dtype
from ray_moe.device import synchronize
from ray_moe.model.moe import MoELayer
from ray_moe.placement.clones import push_clone_weights, reduce_clone_grads
from ray_moe.placement.placement import Placement


@dataclass
class StepSpec:
    tokens: int = 4096  # T_local, tokens per rank
    d_model: int = 1024
    hidden: int = 512
    num_experts: int = 16
    top_k: int = 4
    dtype: str = "bfloat16"
    impl: str = "auto"
    iters: int = 10
    warmup: int = 3
    zipf_s: float = 0.0  # > 0: Zipf-skewed routing whose hottest experts live on rank 0
    placement: dict | None = None  # Placement.to_dict(); None = native
    clone_slots: int = 0
    local: bool = False  # run on this rank alone through the identity transport (W = 1)
    seed: int = 0

    def fwd_flops(self) -> float:
        return 6.0 * self.tokens * self.top_k * self.d_model * self.hidden


def zipf_router_bias(num_experts: int, world_size: int, s: float) -> torch.Tensor:
    """float32 [E] logit bias: Zipf(s) over experts, rank 0's experts hottest."""
    ranks = torch.arange(num_experts, dtype=torch.float64)  # expert e is the (e+1)-th hottest
    return (-s * torch.log1p(ranks)).float()


def time_layer_step(worker: Any, spec: StepSpec | dict) -> dict[str, Any]:
    """Run on every rank (``group.execute``) or on one (``spec.local``). Returns this rank's
    median forward and forward+backward milliseconds and the loads it saw."""
    if isinstance(spec, dict):
        spec = StepSpec(**spec)
    device = worker.device
    if spec.local:
        transport, W, rank = LocalTransport(), 1, 0
    else:
        transport, W, rank = worker.transport, worker.rank_info.world_size, worker.rank_info.rank
    E, H, I = spec.num_experts, spec.d_model, spec.hidden
    placement = (
        Placement.from_dict(spec.placement) if spec.placement else Placement.native(E, W, spec.clone_slots)
    )
    dtype = torch_dtype(spec.dtype)
    transport.reserve(BufferSpec(max_tokens=spec.tokens, hidden=H, elem_bytes=dtype.itemsize, max_top_k=spec.top_k))
    layer = MoELayer(H, E, spec.top_k, I, transport, placement, dtype=dtype,
                     expert_impl=spec.impl, device=device, seed=spec.seed)
    g = torch.Generator().manual_seed(spec.seed * 7919 + rank)
    x = torch.randn(spec.tokens, H, generator=g).to(device=device, dtype=dtype)
    if spec.zipf_s > 0:
        with torch.no_grad():  # a constant feature times the bias row skews the logits
            x[:, 0] = 1.0
            layer.router[0] = zipf_router_bias(E, W, spec.zipf_s).to(device)
    grad = torch.randn(spec.tokens, H, generator=g).to(device=device, dtype=dtype)
    distributed = not spec.local and W > 1 and dist.is_initialized()

    def barrier():
        if distributed:
            dist.barrier()

    fwd, bwd = [], []
    for i in range(spec.warmup + spec.iters):
        barrier()
        synchronize(device)
        t0 = time.perf_counter()
        out, _ = layer(x)
        synchronize(device)
        t1 = time.perf_counter()
        out.backward(grad)
        reduce_clone_grads(layer, placement)
        push_clone_weights(layer, placement)
        synchronize(device)
        t2 = time.perf_counter()
        layer.w13.grad = layer.w2.grad = layer.router.grad = None
        if i >= spec.warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    tokens, pairs = layer.pop_load()
    out = {
        "rank": rank, "world_size": W,
        "forward_ms": statistics.median(fwd),
        "backward_ms": statistics.median(bwd),
        "forward_backward_ms": statistics.median([a + b for a, b in zip(fwd, bwd)]),
        "expert_tokens": tokens.tolist(), "received_pairs": float(pairs),
        "spec": asdict(spec),
    }
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def tflops(spec: StepSpec, ms: float, backward: bool = False) -> float:
    flops = spec.fwd_flops() * (3 if backward else 1)  # backward is twice the forward
    return flops / (ms * 1e-3) / 1e12 if ms > 0 and math.isfinite(ms) else float("nan")


def ep_layer_rows(
    T: int, H: int, I: int, E: int, K: int, world_size: int, transport: str = "auto",
    address: str | None = None, dtype: str = "bfloat16", impl: str = "auto", iters: int = 10,
    device: str = "auto", force_remote_path: bool = False,
) -> list[dict]:
    """Expert-parallel rows: per-rank layer time at T/W tokens per rank against one GPU running
    T/W tokens (exposed communication) and all T tokens (scaling efficiency)."""
    import ray

    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup

    if T % world_size:
        raise ValueError(f"T={T} is not divisible by world_size={world_size}")
    cfg = Config.from_dict({
        # seq_len x batch_size/W sizes the NVSHMEM buffer: T/W tokens per rank.
        "model": {"d_model": H, "n_heads": 1, "dtype": dtype, "seq_len": T // world_size},
        "moe": {"num_experts": E, "top_k": K, "expert_hidden": I, "expert_impl": impl},
        "parallel": {"world_size": world_size, "transport": transport, "device": device,
                     "cpu_per_worker": 1 if device != "cpu" else 0.5,
                     "force_remote_path": force_remote_path},
        "train": {"batch_size": world_size},
    })
    base = dict(d_model=H, hidden=I, num_experts=E, top_k=K, dtype=dtype, impl=impl, iters=iters)
    with WorkerGroup(cfg) as group:
        ep = group.execute(time_layer_step, asdict(StepSpec(tokens=T // world_size, **base)))
        local = ray.get(group.actors[0].execute.remote(
            time_layer_step, asdict(StepSpec(tokens=T // world_size, local=True, **base))))
        full = ray.get(group.actors[0].execute.remote(
            time_layer_step, asdict(StepSpec(tokens=T, local=True, **base))))
        transport_name = group.transport_name
    spec_ep, spec_full = StepSpec(tokens=T // world_size, **base), StepSpec(tokens=T, **base)
    rows = []
    for name, res, spec in (("EP per rank (max over ranks)", None, spec_ep),
                            ("one GPU, T/W tokens", local, spec_ep),
                            ("one GPU, all T tokens", full, spec_full)):
        if res is None:
            f = max(r["forward_ms"] for r in ep)
            b = max(r["backward_ms"] for r in ep)
        else:
            f, b = res["forward_ms"], res["backward_ms"]
        rows.append({"section": "ep", "what": name, "transport": transport_name if res is None else "local",
                     "tokens": spec.tokens, "fwd_ms": f, "fwd_TFLOPs": tflops(spec, f),
                     "fwd+bwd_ms": f + b, "fwd+bwd_TFLOPs": tflops(spec, f + b, backward=True)})
    ep_f, ep_fb = rows[0]["fwd_ms"], rows[0]["fwd+bwd_ms"]
    rows.append({
        "section": "ep", "what": "derived", "world_size": world_size,
        "scaling_eff_fwd": full["forward_ms"] / (world_size * ep_f),
        "scaling_eff_fwd+bwd": (full["forward_ms"] + full["backward_ms"]) / (world_size * ep_fb),
        "exposed_comm_fwd_ms": ep_f - local["forward_ms"],
        "exposed_comm_fwd+bwd_ms": ep_fb - (local["forward_ms"] + local["backward_ms"]),
        "exposed_comm_frac_fwd+bwd": (ep_fb - (local["forward_ms"] + local["backward_ms"]))
        / (local["forward_ms"] + local["backward_ms"]),
    })
    return rows
