"""The benchmark problem of ``ray-moe bench layer``: the shape, random inputs and weights, the
layer under test at W=1, and the timing helpers every section shares.

Notation (docs/ARCHITECTURE.md): T tokens, H hidden, I expert intermediate, E experts, top-K.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class LayerShape:
    """Benchmark problem: T tokens, hidden H, expert intermediate I, E experts, top-K."""

    T: int = 32768
    H: int = 4096
    I: int = 1536
    E: int = 64
    K: int = 8

    @property
    def fwd_flops(self) -> float:
        return 6.0 * self.T * self.K * self.H * self.I


def log(msg: str) -> None:
    """Progress line with wall time (long steps, e.g. SonicMoE's first-call autotuning, show up)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median_ms(fn: Callable[[], Any], warmup_ms: int, rep_ms: int) -> float:
    """Median time of ``fn`` in ms (``triton.testing.do_bench``)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def make_inputs(shape: LayerShape, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random tokens, router and expert weights; slots from softmax top-k of random logits.

    Returns x [T, H], w13 [E, H, 2I], w2 [E, I, H] (dtype), logits float32 [T, E],
    slot int64 [T, K], weight float32 [T, K].
    """
    from ray_moe.model.router import route

    g = torch.Generator(device="cpu").manual_seed(seed)
    T, H, I, E, K = shape.T, shape.H, shape.I, shape.E, shape.K

    def randn(*size: int, scale: float) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dtype)

    x = randn(T, H, scale=1.0)
    router_w = (torch.randn(H, E, generator=g) / H**0.5).to(device)
    w13 = randn(E, H, 2 * I, scale=H**-0.5)
    w2 = randn(E, I, H, scale=I**-0.5)
    weight, slot, _ = route(x, router_w, K)
    logits = x.float() @ router_w
    return {"x": x, "w13": w13, "w2": w2, "logits": logits, "slot": slot, "weight": weight.contiguous()}


def tflops(flops: float, ms: float) -> float:
    """``flops`` done in ``ms`` milliseconds, in TFLOP/s."""
    return flops / (ms * 1e-3) / 1e12


def layer_problem(shape: LayerShape, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random layer weights and inputs drawn on the device (fast at E=128).

    Returns x [T, H], grad [T, H] (dtype), router float32 [H, E], w13 [E, H, 2I], w2 [E, I, H] (dtype).
    """
    T, H, I, E = shape.T, shape.H, shape.I, shape.E
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)

    w13 = torch.empty(E, H, 2 * I, dtype=dtype, device=device)
    w2 = torch.empty(E, I, H, dtype=dtype, device=device)
    for e in range(E):  # one expert at a time: no float32 copy of all weights
        w13[e] = randn(H, 2 * I, scale=H**-0.5)
        w2[e] = randn(I, H, scale=I**-0.5)
    return {"x": randn(T, H), "grad": randn(T, H), "w13": w13, "w2": w2,
            "router": torch.randn(H, E, generator=g, device=device) / H**0.5}


def ray_moe_layer(shape: LayerShape, prob: dict[str, torch.Tensor], impl: str = "auto",
                  expert_precision: str = "bf16") -> Any:
    """``MoELayer`` at W=1 over ``LocalTransport`` (route + experts + combine) holding ``prob``'s
    weights (the layer's own expert initialisation is skipped: the weights are copied in right
    after); ``expert_precision``: bf16 or fp8 (``moe.expert_precision``)."""
    from ray_moe.comm.local import LocalTransport
    from ray_moe.model.moe import MoELayer, MoELayerSpec

    w13 = prob["w13"]
    layer = MoELayer(MoELayerSpec(shape.H, shape.E, shape.K, shape.I, dtype=w13.dtype, expert_impl=impl,
                                  expert_precision=expert_precision),
                     LocalTransport(), device=w13.device, reset=False)
    with torch.no_grad():
        layer.router.copy_(prob["router"])
        layer.w13.copy_(w13)
        layer.w2.copy_(prob["w2"])
    return layer


def rel_err_gpu(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| accumulated in float64 on the device, slice by slice along dim 0."""
    num = den = torch.zeros((), dtype=torch.float64, device=b.device)
    step = max(1, (1 << 26) // max(1, b[0].numel() if b.dim() else 1))
    for i in range(0, b.shape[0] if b.dim() else 1, step):
        bb = b[i:i + step].double() if b.dim() else b.double()
        aa = a[i:i + step].double() if a.dim() else a.double()
        num = num + (aa - bb).pow(2).sum()
        den = den + bb.pow(2).sum()
    if not torch.isfinite(num):
        return float("inf")
    return float((num.sqrt() / den.sqrt()).item()) if den.item() > 0 else float(num.sqrt().item())


def graph_ms(fn: Callable[[], Any], warmup_ms: int, rep_ms: int) -> float:
    """Median replay time of ``fn`` captured in a CUDA graph (warmed up on a side stream first)."""
    from ray_moe.device import capture_graph

    graph, _ = capture_graph(fn, warmup=3)
    return median_ms(graph.replay, warmup_ms, rep_ms)
