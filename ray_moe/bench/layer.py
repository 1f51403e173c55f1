"""``ray-moe bench layer``: expert compute, routing/permutation and saved-activation audit.

Single-GPU rows (this module): for T, H, I, E, K
  - expert compute alone: ``torch._grouped_mm`` on pre-permuted rows vs the Triton kernels
    (gather fused into the loads), forward and forward+backward, TFLOP/s with 6*T*K*H*I forward
    FLOPs and twice that backward;
  - the expert side of a layer (``expert_ffn``) end to end: grouped_mm path vs triton path;
  - routing + permutation (top-k softmax; sort/gather vs counting-sort layout; combine);
  - per-kernel times (optionally a sweep of tile configs);
  - bytes saved for backward by each path.
EP rows (several GPUs) come from :func:`ep_rows`, a hook that takes a transport.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass
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


def _log(msg: str) -> None:
    """Progress line with wall time (long steps, e.g. SonicMoE's first-call autotuning, show up)."""
    import time

    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _median_ms(fn: Callable[[], Any], warmup_ms: int, rep_ms: int) -> float:
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


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def expert_compute_rows(
    shape: LayerShape, inp: dict[str, torch.Tensor], warmup_ms: int, rep_ms: int, plan: Any = None
) -> list[dict]:
    """Expert GEMMs alone (no routing, no combine): grouped_mm on pre-permuted rows vs triton
    (``plan``: a KernelPlan, None → default)."""
    from ray_moe.kernels.grouped_swiglu import (
        default_plan,
        dgrad_rows,
        down_scaled,
        gate_up_swiglu,
        grouped_wgrad,
        grouped_wgrad_mm,
        swiglu_backward_rows,
    )
    from ray_moe.kernels.routing import pair_layout, pair_layout_reference
    from ray_moe.model.experts import swiglu

    x, w13, w2, slot, weight = inp["x"], inp["w13"], inp["w2"], inp["slot"], inp["weight"]
    K, E = shape.K, shape.E
    plan = plan or default_plan(x.dtype, x.device)
    layout = pair_layout(slot, E)
    ref = pair_layout_reference(slot, E)
    if not all(torch.equal(a, b) for a, b in zip(layout, ref)):
        raise RuntimeError("pair_layout disagrees with its reference on the benchmark input")
    rows = layout.sorted_pair.long() // K
    offs = layout.offsets[1:].contiguous()
    xs = x[rows].detach().requires_grad_()
    w13g = w13.detach().requires_grad_()
    w2g = w2.detach().requires_grad_()
    gy = torch.randn(xs.shape[0], shape.H, device=x.device, dtype=x.dtype)
    go = torch.randn_like(x)

    def mm_fwd():
        h = torch._grouped_mm(xs, w13g, offs=offs)
        return torch._grouped_mm(swiglu(h), w2g, offs=offs)

    def mm_fwd_bwd():
        torch.autograd.grad(mm_fwd(), (xs, w13g, w2g), gy)

    def tr_fwd():
        act, h13 = gate_up_swiglu(x, layout, K, w13, save_preact=True, cfg=plan.gate_up)
        return down_scaled(act, layout, K, weight, w2, cfg=plan.down), h13

    def tr_fwd_bwd(mm_wgrad: bool = False):
        _, h13 = tr_fwd()
        dh13, aw, _ = swiglu_backward_rows(go, layout, K, weight, w2, h13, cfg=plan.dact, fused=plan.fused_dact)
        dgrad_rows(dh13, layout, K, w13, cfg=plan.dx)
        if mm_wgrad:
            grouped_wgrad_mm(x, dh13, layout, K, gather_a=True, gather_b=False)
            grouped_wgrad_mm(aw, go, layout, K, gather_a=False, gather_b=True)
            return
        grouped_wgrad(x, dh13, layout, K, gather_a=True, gather_b=False, cfg=plan.wgrad13, dual=plan.dual_wgrad13)
        grouped_wgrad(aw, go, layout, K, gather_a=False, gather_b=True, cfg=plan.wgrad2)

    fl = shape.fwd_flops
    out = []
    times = {}
    for name, fn, flops in [
        ("grouped_mm fwd", mm_fwd, fl), ("triton fwd", tr_fwd, fl),
        ("grouped_mm fwd+bwd", mm_fwd_bwd, 3 * fl), ("triton fwd+bwd", tr_fwd_bwd, 3 * fl),
        ("triton+mm_wgrad fwd+bwd", lambda: tr_fwd_bwd(mm_wgrad=True), 3 * fl),
    ]:
        ms = _median_ms(fn, warmup_ms, rep_ms)
        times[name] = ms
        out.append({"section": "expert compute", "what": name, "ms": ms, "TFLOP/s": _tflops(flops, ms)})
    for phase in ("fwd", "fwd+bwd"):
        out.append({
            "section": "expert compute", "what": f"speedup triton/grouped_mm {phase}",
            "ratio": times[f"grouped_mm {phase}"] / times[f"triton {phase}"],
        })
    return out


def expert_ffn_rows(
    shape: LayerShape, inp: dict[str, torch.Tensor], warmup_ms: int, rep_ms: int, plan: Any = None
) -> list[dict]:
    """The expert side of a layer end to end (layout/permutation + GEMMs + combine)."""
    import dataclasses

    from ray_moe.kernels.expert_ffn import expert_ffn_triton
    from ray_moe.kernels.grouped_swiglu import default_plan
    from ray_moe.model.expert_choice import ExpertImplChooser
    from ray_moe.model.experts import expert_ffn

    base_plan = plan or default_plan(inp["x"].dtype, inp["x"].device)

    def run(impl: str, *args: torch.Tensor) -> torch.Tensor:
        if impl == "triton":
            return expert_ffn_triton(*args, plan=base_plan)
        if impl == "triton+mm_wgrad":
            return expert_ffn_triton(*args, plan=dataclasses.replace(base_plan, wgrad="grouped_mm"))
        return expert_ffn(*args, impl=impl)

    x = inp["x"].detach().requires_grad_()
    weight = inp["weight"].detach().requires_grad_()
    w13 = inp["w13"].detach().requires_grad_()
    w2 = inp["w2"].detach().requires_grad_()
    slot = inp["slot"]
    go = torch.randn_like(inp["x"])
    out = []
    for impl in ("grouped_mm", "triton", "triton+mm_wgrad"):
        def fwd(impl=impl):
            with torch.no_grad():
                return run(impl, x, slot, weight, w13, w2)

        def fwd_bwd(impl=impl):
            y = run(impl, x, slot, weight, w13, w2)
            torch.autograd.grad(y, (x, weight, w13, w2), go)

        for phase, fn, flops in (("fwd", fwd, shape.fwd_flops), ("fwd+bwd", fwd_bwd, 3 * shape.fwd_flops)):
            ms = _median_ms(fn, warmup_ms, rep_ms)
            out.append({"section": "expert_ffn", "what": f"{impl} {phase}", "ms": ms, "TFLOP/s": _tflops(flops, ms)})
    # what moe.expert_impl=auto picks for this shape (its own shorter measurement, for training)
    chooser = ExpertImplChooser()
    choice = chooser.choose(inp["x"], slot, inp["weight"], inp["w13"], inp["w2"], needs_grad=True)
    (timings,) = chooser.timings.values()
    out.append({"section": "expert_ffn", "what": f"auto chooses {choice.name}",
                "ms": timings[choice.name], "note": {n: (round(t, 3) if isinstance(t, float) else t)
                                                     for n, t in timings.items()}})
    return out


def routing_rows(shape: LayerShape, inp: dict[str, torch.Tensor], warmup_ms: int, rep_ms: int) -> list[dict]:
    """Routing and permutation: textbook torch ops vs the Triton kernels."""
    from ray_moe.kernels.gather_sum import gather_sum
    from ray_moe.kernels.routing import (
        pair_layout,
        topk_softmax,
        topk_softmax_reference,
    )

    x, slot, weight, logits = inp["x"], inp["slot"], inp["weight"], inp["logits"]
    K, E = shape.K, shape.E
    lg = logits.detach().requires_grad_()
    gw = torch.rand(shape.T, K, device=x.device)

    def textbook_permute():
        key = torch.where(slot >= 0, slot, E).reshape(-1)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
        counts[:E].cumsum(0, dtype=torch.int32)
        return x[order // K]

    layout = pair_layout(slot, E)
    y = torch.randn(shape.T * K, shape.H, device=x.device, dtype=x.dtype)
    rows = layout.sorted_pair.long() // K
    wsorted = weight.reshape(-1)[layout.sorted_pair.long()]

    def textbook_combine():
        return torch.zeros_like(x).index_add(0, rows, y * wsorted.to(y.dtype).unsqueeze(1))

    from ray_moe.model.router import SplitRouterLogits

    xg = x.detach().requires_grad_()
    router_w = (torch.randn(shape.H, E, device=x.device) / shape.H**0.5).requires_grad_()
    glog = torch.randn(shape.T, E, device=x.device)

    def router_fp32(backward: bool):
        out = xg.float() @ router_w
        return torch.autograd.grad(out, (xg, router_w), glog) if backward else out

    def router_split(backward: bool):
        out = SplitRouterLogits.apply(xg, router_w)
        return torch.autograd.grad(out, (xg, router_w), glog) if backward else out

    cases = [
        ("router logits fwd: x.float() @ w (float32)", lambda: router_fp32(False)),
        ("router logits fwd: split bf16 GEMMs", lambda: router_split(False)),
        ("router logits fwd+bwd: float32", lambda: router_fp32(True)),
        ("router logits fwd+bwd: split bf16 GEMMs", lambda: router_split(True)),
        ("top-k softmax: torch softmax/topk/renorm", lambda: topk_softmax_reference(logits, K)),
        ("top-k softmax: triton", lambda: topk_softmax(logits, K)),
        ("top-k softmax fwd+bwd: torch", lambda: torch.autograd.grad(topk_softmax_reference(lg, K)[0], lg, gw)),
        ("top-k softmax fwd+bwd: triton", lambda: torch.autograd.grad(topk_softmax(lg, K)[0], lg, gw)),
        ("permute: argsort + counts + x[rows] gather", textbook_permute),
        ("permute: triton pair_layout (gather fused into GEMM)", lambda: pair_layout(slot, E)),
        ("combine: y*w + index_add", textbook_combine),
        ("combine: triton gather_sum", lambda: gather_sum(y, layout, K)),
    ]
    return [
        {"section": "routing", "what": name, "ms": _median_ms(fn, warmup_ms, rep_ms)} for name, fn in cases
    ]


def sweep_candidates(role: str) -> list[tuple[Any, bool]]:
    """(GemmConfig, variant flag) alternatives timed by ``--sweep`` for one GEMM role; the flag is
    ``fused_dact`` for dact, ``dual_wgrad13`` for wgrad13, unused otherwise. Pointer-kernel tiles
    first, then the Hopper variants (TMA descriptors; persistent; persistent + flattened loop)."""
    from dataclasses import replace

    from ray_moe.kernels.grouped_swiglu import GemmConfig as C

    def hopper(c: Any, stages_flat: int | None = None) -> list[Any]:
        return [replace(c, tma=True), replace(c, tma=True, persistent=True),
                replace(c, tma=True, persistent=True, flatten=True, num_stages=stages_flat or c.num_stages)]

    wide = [C(128, 256, 64, 8, 8, 3), C(128, 256, 64, 8, 8, 4), C(256, 128, 64, 8, 8, 3)]
    return {
        "gate_up": [(C(128, 128, 64, 8, 8, 3), False), (C(128, 128, 64, 16, 8, 3), False), (C(64, 128, 64, 8, 4, 4), False)]
        + [(c, False) for c in hopper(C(128, 128, 64, 8, 8, 3))] + [(C(128, 128, 64, 8, 8, 4, tma=True), False)],
        "down": [(c, False) for c in wide] + [(c, False) for c in hopper(C(128, 256, 64, 8, 8, 4), stages_flat=3)],
        "dact": [(C(128, 256, 64, 8, 8, 3), False), (C(128, 128, 64, 8, 8, 4), False),
                 (C(128, 128, 64, 8, 8, 4), True), (C(128, 128, 64, 8, 8, 3), True)]
        + [(c, False) for c in hopper(C(128, 256, 64, 8, 8, 3))],
        "dx": [(c, False) for c in wide] + [(c, False) for c in hopper(C(128, 256, 64, 8, 8, 3))],
        "wgrad13": [(C(128, 128, 64, 8, 4, 4), False), (C(128, 128, 64, 8, 8, 3), True), (C(128, 128, 64, 8, 8, 4), True),
                    (C(64, 128, 64, 8, 4, 4), True), (C(128, 64, 64, 8, 4, 4), True), (C(128, 64, 64, 8, 4, 5), True),
                    (C(128, 64, 64, 8, 4, 4, tma=True), True), (C(128, 64, 64, 8, 4, 5, tma=True), True),
                    (C(128, 64, 64, 8, 4, 3, tma=True), True), (C(128, 128, 64, 8, 8, 4, tma=True), True),
                    (C(128, 128, 32, 8, 8, 6, tma=True), True)],
        "wgrad2": [(C(128, 128, 64, 8, 8, 4), False), (C(128, 128, 64, 8, 4, 4), False), (C(128, 128, 64, 8, 8, 5), False),
                   (C(128, 128, 64, 8, 8, 4, tma=True), False), (C(128, 128, 64, 8, 8, 5, tma=True), False),
                   (C(128, 256, 64, 8, 8, 4, tma=True), False), (C(128, 128, 64, 8, 4, 4, tma=True), False),
                   (C(128, 128, 32, 8, 8, 6, tma=True), False)],
    }[role]


def kernel_rows(
    shape: LayerShape, inp: dict[str, torch.Tensor], warmup_ms: int, rep_ms: int, sweep: bool
) -> tuple[list[dict], Any]:
    """Each Triton GEMM alone with the default plan's tiles and (``sweep``) alternatives.

    Returns the rows and the fastest KernelPlan found (the default plan without ``sweep``).
    """
    import dataclasses

    from ray_moe.kernels import grouped_swiglu as gs
    from ray_moe.kernels.routing import pair_layout

    x, w13, w2, slot, weight = inp["x"], inp["w13"], inp["w2"], inp["slot"], inp["weight"]
    K, E, P = shape.K, shape.E, shape.T * shape.K
    plan = gs.default_plan(x.dtype, x.device)
    layout = pair_layout(slot, E)
    act, h13 = gs.gate_up_swiglu(x, layout, K, w13, save_preact=True, cfg=plan.gate_up)
    go = torch.randn_like(x)
    dh13, aw, _ = gs.swiglu_backward_rows(go, layout, K, weight, w2, h13, cfg=plan.dact, fused=plan.fused_dact)
    gemm = 2.0 * P * shape.H * shape.I  # one [P,H]x[H,I] product
    roles: dict[str, tuple[Callable[[Any, bool], Any], float]] = {
        "gate_up": (lambda c, f: gs.gate_up_swiglu(x, layout, K, w13, save_preact=True, cfg=c), 2 * gemm),
        "down": (lambda c, f: gs.down_scaled(act, layout, K, weight, w2, cfg=c), gemm),
        "dact": (lambda c, f: gs.swiglu_backward_rows(go, layout, K, weight, w2, h13, cfg=c, fused=f), gemm),
        "dx": (lambda c, f: gs.dgrad_rows(dh13, layout, K, w13, cfg=c), 2 * gemm),
        "wgrad13": (lambda c, f: gs.grouped_wgrad(x, dh13, layout, K, True, False, cfg=c, dual=f), 2 * gemm),
        "wgrad2": (lambda c, f: gs.grouped_wgrad(aw, go, layout, K, False, True, cfg=c), gemm),
    }
    out = []
    best: dict[str, tuple[float, Any, bool]] = {}
    for role, (fn, flops) in roles.items():
        flag = {"dact": plan.fused_dact, "wgrad13": plan.dual_wgrad13}.get(role, False)
        default = (getattr(plan, role), flag)
        candidates = [default] + ([c for c in sweep_candidates(role) if c != default] if sweep else [])
        for cfg, fused in candidates:
            try:
                ms = _median_ms(lambda: fn(cfg, fused), warmup_ms, rep_ms)
                row = {"ms": ms, "TFLOP/s": _tflops(flops, ms)}
                if role not in best or ms < best[role][0]:
                    best[role] = (ms, cfg, fused)
            except Exception as exc:  # a config that fails to compile (shared memory) is reported, not fatal
                row = {"error": f"{type(exc).__name__}: {str(exc)[:80]}"}
            tag = {"dact": " fused" if fused else " split", "wgrad13": " dual" if fused else ""}.get(role, "")
            out.append({"section": "kernels", "what": f"{role}{tag} {_cfg_name(cfg)}{' (default)' if (cfg, fused) == default else ''}", **row})
    picked = dataclasses.replace(
        plan, **{r: best[r][1] for r in best},
        fused_dact=best["dact"][2] if "dact" in best else plan.fused_dact,
        dual_wgrad13=best["wgrad13"][2] if "wgrad13" in best else plan.dual_wgrad13,
    )
    return out, picked


def _cfg_name(cfg: Any) -> str:
    flags = "".join(f" {n}" for n in ("tma", "persistent", "flatten") if getattr(cfg, n, False))
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}{flags}"


def saved_bytes_rows(shape: LayerShape, inp: dict[str, torch.Tensor]) -> list[dict]:
    """Bytes each path keeps for backward (saved_tensors_hooks, deduplicated by storage)."""
    from ray_moe.model.experts import expert_ffn

    leaves = {k: inp[k].detach().requires_grad_() for k in ("x", "weight", "w13", "w2")}
    input_ptrs = {t.untyped_storage().data_ptr() for t in leaves.values()} | {inp["slot"].untyped_storage().data_ptr()}
    preact = shape.T * shape.K * 2 * shape.I * inp["x"].element_size()
    out = []
    for impl in ("grouped_mm", "triton"):
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = expert_ffn(leaves["x"], inp["slot"], leaves["weight"], leaves["w13"], leaves["w2"], impl=impl)
        inputs = sum(n for p, n in seen.items() if p in input_ptrs)
        other = sum(n for p, n in seen.items() if p not in input_ptrs)
        out.append({
            "section": "saved activations", "what": impl, "input bytes (shared)": inputs, "other bytes": other,
            "pre-activation bytes (T*K*2I)": preact, "other / pre-activations": other / preact,
        })
        del y
    return out


# ---------------------------------------------------------------------------------------------
# The whole layer beside SonicMoE (same process, same weights and inputs)
# ---------------------------------------------------------------------------------------------


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


def ray_moe_layer(shape: LayerShape, prob: dict[str, torch.Tensor], impl: str = "auto") -> Any:
    """``MoELayer`` at W=1 over ``LocalTransport`` (route + experts + combine) holding ``prob``'s
    weights (the layer's own expert initialisation is skipped: the weights are copied in right after)."""
    from ray_moe.comm.local import LocalTransport
    from ray_moe.model.moe import MoELayer

    w13 = prob["w13"]
    layer = MoELayer(shape.H, shape.E, shape.K, shape.I, LocalTransport(), dtype=w13.dtype, expert_impl=impl,
                     device=w13.device, reset=False)
    with torch.no_grad():
        layer.router.copy_(prob["router"])
        layer.w13.copy_(w13)
        layer.w2.copy_(prob["w2"])
    return layer


class SonicLayer:
    """SonicMoE's ``moe_TC_softmax_topk_layer`` on the same weights, in its layout: router [E, H]
    (bf16), ``c_fc`` [E, 2I, H] with gate rows at even and up rows at odd indices, ``c_proj``
    [E, H, I]; the GEMMs take the ``permute(1, 2, 0)`` views (as ``sonicmoe.MoE`` passes them).
    Softmax over the top-k logits equals ray_moe's renormalised softmax top-k."""

    def __init__(self, prob: dict[str, torch.Tensor], top_k: int) -> None:
        w13, w2 = prob["w13"], prob["w2"]
        E, H, I2 = w13.shape
        I = I2 // 2
        self.top_k = top_k
        self.router_w = prob["router"].t().contiguous().to(w13.dtype).requires_grad_()
        fc = torch.empty(E, I2, H, dtype=w13.dtype, device=w13.device)
        fc[:, 0::2, :] = w13[:, :, :I].transpose(1, 2)
        fc[:, 1::2, :] = w13[:, :, I:].transpose(1, 2)
        self.c_fc = fc.requires_grad_()
        self.c_proj = w2.transpose(1, 2).contiguous().requires_grad_()

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        return self.router_w, self.c_fc, self.c_proj

    def __call__(self, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_TC_softmax_topk_layer

        out, _logits, _freq = moe_TC_softmax_topk_layer(
            x, self.router_w, self.c_fc.permute(1, 2, 0), None, self.c_proj.permute(1, 2, 0), None, self.top_k,
            torch.cuda.current_stream().cuda_stream if x.is_cuda else 0, ActivationType.SWIGLU, inference)
        return out

    def grads_in_ray_layout(self, d_router_w, d_fc, d_proj) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router float32 [H, E], w13 [E, H, 2I], w2 [E, I, H]) gradients from SonicMoE's layout."""
        dw13 = torch.cat([d_fc[:, 0::2, :].transpose(1, 2), d_fc[:, 1::2, :].transpose(1, 2)], dim=2)
        return d_router_w.t().float(), dw13, d_proj.transpose(1, 2)


def sonic_import_error() -> str | None:
    """None when SonicMoE (and its CUTLASS DSL) imports here, else the reason."""
    try:
        import sonicmoe.functional  # noqa: F401
    except Exception as exc:  # ImportError, or the DSL failing to load its libraries
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
    return None


def _rel_err_gpu(a: torch.Tensor, b: torch.Tensor) -> float:
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


def _saved_and_peak(step_fwd: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], Any],
                    inputs: tuple[torch.Tensor, ...]) -> tuple[int, float]:
    """Bytes saved for backward besides ``inputs`` (storages deduplicated) and the peak memory
    of one forward+backward above what was allocated before it (GiB)."""
    input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step_fwd()
    backward(out)
    del out
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return sum(n for p, n in seen.items() if p not in input_ptrs), peak


def sonic_layer_rows(shape: LayerShape, dtype: torch.dtype, seed: int, warmup_ms: int, rep_ms: int,
                     impls: tuple[str, ...] = ("ray_moe", "sonicmoe"), sonic_mode: str = "full") -> list[dict]:
    """The full layer, training-mode forward and forward+backward, ray_moe vs SonicMoE.

    ray_moe: ``MoELayer`` (W=1, ``LocalTransport``, ``expert_impl: auto``): router (float32
    weights), fused top-k, counting-sort layout, experts, gather-combine. SonicMoE: the same
    problem through ``moe_TC_softmax_topk_layer`` (bf16 router). Both: x requires grad, the
    backward gives dx and every weight gradient. Errors: output and gradients against the float32
    oracle (:func:`ray_moe.model.experts.reference_moe`, autograd). ``sonic_mode="forward"`` times
    SonicMoE's training-mode forward only (its first backward call autotunes four more GEMMs,
    over ten minutes on a fresh machine).
    """
    from ray_moe.model.experts import reference_moe

    device = torch.device("cuda")
    prob = layer_problem(shape, device, dtype, seed)
    x = prob["x"].detach().requires_grad_()
    grad = prob["grad"]
    fl = shape.fwd_flops
    rows: list[dict] = []
    sec = f"layer T={shape.T} E={shape.E}"

    # float32 oracle first (its autograd graph is the largest allocation of the run)
    _log(f"{sec}: float32 oracle")
    leaves = [t.detach().float().requires_grad_() for t in (prob["x"], prob["router"], prob["w13"], prob["w2"])]
    ref_out, _, _ = reference_moe(*leaves, shape.K)
    ref_grads = torch.autograd.grad(ref_out, leaves, grad.float())
    ref_out = ref_out.detach()
    del leaves
    torch.cuda.empty_cache()

    runs: dict[str, tuple[Callable[[], torch.Tensor], tuple[torch.Tensor, ...], Callable[..., tuple]]] = {}
    layer = ray_moe_layer(shape, prob)
    if "ray_moe" in impls:
        runs["ray_moe"] = (lambda: layer(x)[0], (x, layer.router, layer.w13, layer.w2), lambda *g: g)
    err = sonic_import_error()
    if err is None and "sonicmoe" in impls:
        sonic = SonicLayer(prob, shape.K)
        runs["sonicmoe"] = (lambda: sonic(x), (x, *sonic.params),
                            lambda dx, dr, dfc, dpj: (dx, *sonic.grads_in_ray_layout(dr, dfc, dpj)))
    elif err is not None:
        rows.append({"section": sec, "what": "sonicmoe", "note": f"not run: {err}"})
    times: dict[str, dict[str, float]] = {}
    for name, (fwd, params, to_ray) in runs.items():
        backward = name == "ray_moe" or sonic_mode == "full"

        def fwd_bwd(fwd=fwd, params=params):
            torch.autograd.grad(fwd(), params, grad)

        _log(f"{sec}: {name} first call (compile / autotune / per-shape choice)")
        (fwd_bwd if backward else fwd)()  # compiles / autotunes (SonicMoE's quack GEMMs; ray_moe's choice)
        torch.cuda.synchronize()
        _log(f"{sec}: {name} errors, saved bytes, timings")
        out = fwd().detach()
        errs = {"out": _rel_err_gpu(out, ref_out)}
        if backward:
            grads = to_ray(*torch.autograd.grad(fwd(), params, grad))
            errs.update({f"d{n}": _rel_err_gpu(a, b) for n, a, b in zip(("x", "router", "w13", "w2"), grads, ref_grads)})
            del grads
        del out
        saved, peak = _saved_and_peak(
            fwd, (lambda o, params=params: torch.autograd.grad(o, params, grad)) if backward else (lambda o: None),
            params)
        t_f = _median_ms(fwd, warmup_ms, rep_ms)
        t_fb = _median_ms(fwd_bwd, warmup_ms, rep_ms) if backward else float("nan")
        times[name] = {"fwd": t_f, "fwd+bwd": t_fb}
        note: dict[str, Any] = {"rel_err": {k: float(f"{v:.3g}") for k, v in errs.items()}}
        if name == "ray_moe" and layer.expert_chooser.choices:
            note["expert impl"] = [c.name for c in layer.expert_chooser.choices.values()]
        if not backward:
            note["mode"] = "forward only (peak: forward)"
        _log(f"{sec}: {name} fwd {t_f:.2f} ms, fwd+bwd {t_fb:.2f} ms, errors {errs}")
        rows.append({"section": sec, "what": name, "fwd ms": t_f, "fwd TFLOP/s": _tflops(fl, t_f),
                     "fwd+bwd ms": t_fb, "bwd ms": t_fb - t_f, "bwd TFLOP/s": _tflops(2 * fl, t_fb - t_f),
                     "saved GiB": saved / 2**30, "peak GiB": peak, "note": note})
        torch.cuda.empty_cache()
    if len(times) == 2:
        r, s_ = times["ray_moe"], times["sonicmoe"]
        rows.append({"section": sec, "what": "ray_moe / sonicmoe (time ratio, < 1 = ray_moe faster)",
                     "fwd ms": r["fwd"] / s_["fwd"], "fwd+bwd ms": r["fwd+bwd"] / s_["fwd+bwd"],
                     "bwd ms": (r["fwd+bwd"] - r["fwd"]) / (s_["fwd+bwd"] - s_["fwd"])})
    return rows


def copy_bandwidth_gbs(n_bytes: int = 1 << 31, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written per second (GB/s)."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), warmup_ms, rep_ms)
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def _graph_ms(fn: Callable[[], Any], warmup_ms: int, rep_ms: int) -> float:
    """Median replay time of ``fn`` captured in a CUDA graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _median_ms(graph.replay, warmup_ms, rep_ms)


def small_t_rows(shape: LayerShape, tokens: list[int], dtype: torch.dtype, seed: int, warmup_ms: int,
                 rep_ms: int, copy_gbs: float, impls: tuple[str, ...] = ("ray_moe", "sonicmoe")) -> list[dict]:
    """Inference forward at small token counts, eager and replayed from a CUDA graph, ray_moe
    (``MoELayer``, auto) vs SonicMoE, as expert-weight bytes read per second against the copy
    bandwidth measured in the same run (the layer must read every touched expert's weights once)."""
    device = torch.device("cuda")
    big = LayerShape(max(tokens), shape.H, shape.I, shape.E, shape.K)
    prob = layer_problem(big, device, dtype, seed)
    layer = ray_moe_layer(big, prob)
    err = sonic_import_error()
    sonic = SonicLayer(prob, shape.K) if err is None and "sonicmoe" in impls else None
    w_bytes_per_expert = 3 * shape.H * shape.I * prob["w13"].element_size()
    rows: list[dict] = []
    for T in tokens:
        x = prob["x"][:T].contiguous()
        with torch.no_grad():
            ids = torch.topk(x.float() @ prob["router"], shape.K, dim=-1).indices
        touched = int(torch.unique(ids).numel())
        w_bytes = touched * w_bytes_per_expert
        fns = {"ray_moe": lambda: layer(x)[0]} if "ray_moe" in impls else {}
        if sonic is not None:
            fns["sonicmoe"] = lambda: sonic(x, inference=True)
        res: dict[str, dict[str, float]] = {}
        for name, fn in fns.items():
            row: dict[str, Any] = {"section": f"small T E={shape.E}", "what": f"{name} T={T}"}
            _log(f"small T E={shape.E}: {name} T={T}")
            try:
                with torch.no_grad():
                    fn()  # compile / autotune / per-shape choice outside the timings
                    eager = _median_ms(fn, warmup_ms, rep_ms)
                    graph = _graph_ms(fn, warmup_ms, rep_ms)
                gbs = w_bytes / (graph * 1e-3) / 1e9
                res[name] = {"eager": eager, "graph": graph}
                row.update({"eager ms": eager, "graph ms": graph, "eager / graph": eager / graph,
                            "weight GB/s (graph)": gbs, "of copy BW": gbs / copy_gbs,
                            "note": {"experts touched": touched, "weight MB": w_bytes / 1e6}})
            except Exception as exc:  # a path that cannot be captured is reported, not fatal
                row["note"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            rows.append(row)
        if len(res) == 2:
            rows.append({"section": f"small T E={shape.E}", "what": f"ray_moe / sonicmoe T={T} (time ratio)",
                         "eager ms": res["ray_moe"]["eager"] / res["sonicmoe"]["eager"],
                         "graph ms": res["ray_moe"]["graph"] / res["sonicmoe"]["graph"]})
    if err is not None:
        rows.append({"section": f"small T E={shape.E}", "what": "sonicmoe", "note": f"not run: {err}"})
    return rows


def profile_rows(shape: LayerShape, dtype: torch.dtype, seed: int, top: int = 14,
                 impls: tuple[str, ...] = ("ray_moe", "sonicmoe")) -> list[dict]:
    """Where one training step's GPU time goes (torch.profiler, CUDA kernels by total time):
    one forward+backward of ray_moe's layer and, when it imports, SonicMoE's, after warm-up."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    prob = layer_problem(shape, device, dtype, seed)
    x = prob["x"].detach().requires_grad_()
    layer = ray_moe_layer(shape, prob)
    steps = {"ray_moe": (lambda: layer(x)[0], (x, layer.router, layer.w13, layer.w2))}
    if sonic_import_error() is None and "sonicmoe" in impls:
        sonic = SonicLayer(prob, shape.K)
        steps["sonicmoe"] = (lambda: sonic(x), (x, *sonic.params))
    rows: list[dict] = []
    for name, (fwd, params) in steps.items():
        if name not in impls:
            continue
        def step(fwd=fwd, params=params):
            torch.autograd.grad(fwd(), params, prob["grad"])

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events) / 1e3
        for e in events[:top]:
            rows.append({"section": f"profile {name} T={shape.T} E={shape.E} (one fwd+bwd, {total:.1f} ms of kernels)",
                         "what": e.key[:70], "calls": e.count, "ms": e.device_time_total / 1e3,
                         "share": e.device_time_total / 1e3 / total})
        torch.cuda.empty_cache()
    return rows


def ep_rows(shape: LayerShape, args: argparse.Namespace) -> list[dict]:
    """Expert-parallel rows over a Ray worker group (see :mod:`ray_moe.bench.ep_layer`)."""
    from ray_moe.bench.ep_layer import ep_layer_rows

    return ep_layer_rows(shape.T, shape.H, shape.I, shape.E, shape.K, args.world_size,
                         transport=args.transport, address=args.address, dtype=args.dtype,
                         impl=args.impl, iters=args.ep_iters, device=args.device,
                         force_remote_path=args.force_remote_path,
                         chunks=tuple(int(c) for c in args.ep_chunks.split(",")),
                         comm_programs=tuple(int(g) for g in args.ep_programs.split(",")))


def _print_table(rows: list[dict]) -> None:
    from tabulate import tabulate

    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    print(tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols, floatfmt=".3f"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ray-moe bench layer", description=__doc__.splitlines()[0])
    for name, default in asdict(LayerShape()).items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-ms", type=int, default=100)
    p.add_argument("--rep-ms", type=int, default=400)
    p.add_argument("--sections", default="kernels,expert,ffn,routing,saved",
                   help="comma list of kernels,expert,ffn,routing,saved,layer,small,profile (kernels runs first;"
                   " with --sweep the fastest tiles it finds are used by expert and ffn). layer: the whole"
                   " MoELayer (W=1) vs SonicMoE, training step; small: inference forward at --small-T vs SonicMoE"
                   " as weight bytes/s against the copy bandwidth; profile: kernel time of one training step")
    p.add_argument("--layer-E", default=None, help="layer/small/profile: comma list of E (default: --E)")
    p.add_argument("--small-T", default="128,1024", help="small: comma list of token counts")
    p.add_argument("--impls", default="ray_moe,sonicmoe", help="layer/small/profile: which layers to run")
    p.add_argument("--sonic-mode", default="full", choices=["full", "forward"],
                   help="layer: SonicMoE forward+backward, or its forward only (its backward GEMMs autotune"
                        " for over ten minutes on a fresh machine)")
    p.add_argument("--sweep", action="store_true", help="time alternative tile configs per kernel")
    p.add_argument("--json", default=None, help="write the rows and the setup here")
    p.add_argument("--world-size", type=int, default=0,
                   help="with the 'ep' section: ranks of the expert-parallel group (T is global)")
    p.add_argument("--transport", default="auto", help="ep: auto, nvshmem, nccl, gloo")
    p.add_argument("--address", default=None, help="ep: Ray address (default: local cluster)")
    p.add_argument("--impl", default="auto", help="ep: expert impl (auto, triton, grouped_mm, loop)")
    p.add_argument("--device", default="auto", help="ep: auto, cuda, cpu")
    p.add_argument("--ep-iters", type=int, default=10)
    p.add_argument("--ep-chunks", default="1,4",
                   help="ep: comma list of moe.pipeline_chunks (1: sequential layer; C > 1: pipelined, side by side)")
    p.add_argument("--ep-programs", default="0",
                   help="ep/nvshmem: comma list of programs (SMs) for the exchange kernels (0: every SM)")
    p.add_argument("--force-remote-path", action="store_true", help="ep/nvshmem: use the inter-node path")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """CLI entry: ``ray-moe bench layer [--T ...] [--json out.json]``. Returns the exit code."""
    args = parse_args(argv)
    shape = LayerShape(args.T, args.H, args.I, args.E, args.K)
    sections = set(args.sections.split(","))
    if sections == {"ep"}:  # the EP rows alone also run on CPU clusters (gloo)
        rows = ep_rows(shape, args)
        _print_table(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"setup": {"shape": asdict(shape), "world_size": args.world_size}, "rows": rows}, f, indent=1)
        return 0
    if not torch.cuda.is_available():
        print("bench layer needs a CUDA GPU (only --sections ep runs without one)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    needs_inp = sections & {"kernels", "expert", "ffn", "routing", "saved", "ep"}
    inp = make_inputs(shape, device, getattr(torch, args.dtype), args.seed) if needs_inp else None
    rows: list[dict] = []
    plan = None
    if "kernels" in sections:
        new, plan = kernel_rows(shape, inp, args.warmup_ms, args.rep_ms, args.sweep)
        _print_table(new)
        print(f"plan used below: {plan}\n", flush=True)
        rows += new
        rows.append({"section": "plan", "what": repr(plan)})
        _write_json(args.json, shape, args, rows)
    steps = [
        ("expert", lambda: expert_compute_rows(shape, inp, args.warmup_ms, args.rep_ms, plan)),
        ("ffn", lambda: expert_ffn_rows(shape, inp, args.warmup_ms, args.rep_ms, plan)),
        ("routing", lambda: routing_rows(shape, inp, args.warmup_ms, args.rep_ms)),
        ("saved", lambda: saved_bytes_rows(shape, inp)),
    ]
    for name, step in steps:
        if name in sections:
            new = step()
            _print_table(new)
            print(flush=True)
            rows += new
            _write_json(args.json, shape, args, rows)
            torch.cuda.empty_cache()
    layer_es = [int(e) for e in (args.layer_E or str(shape.E)).split(",")]
    impls = tuple(args.impls.split(","))
    dtype = getattr(torch, args.dtype)
    if sections & {"layer", "small", "profile"}:
        inp = None
        torch.cuda.empty_cache()
        print(f"device: {torch.cuda.get_device_name()}; sonicmoe: {sonic_import_error() or 'imports'}", flush=True)
    if "small" in sections:
        copy_gbs = copy_bandwidth_gbs()
        rows.append({"section": "small T", "what": "device copy bandwidth (read + write)", "GB/s": copy_gbs})
        print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    for name_, E in [(n, e) for n in ("layer", "small", "profile") for e in layer_es]:
        eshape = LayerShape(shape.T, shape.H, shape.I, E, shape.K)
        for name, step in (
            ("layer", lambda: sonic_layer_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms, impls,
                                               args.sonic_mode)),
            ("small", lambda: small_t_rows(eshape, [int(t) for t in args.small_T.split(",")], dtype, args.seed,
                                           args.warmup_ms, args.rep_ms, copy_gbs, impls)),
            ("profile", lambda: profile_rows(eshape, dtype, args.seed, impls=impls)),
        ):
            if name in sections and name == name_:
                try:
                    new = step()
                except Exception as exc:  # one failing comparison must not lose the others' rows
                    import traceback

                    traceback.print_exc()
                    new = [{"section": f"{name} E={E}", "what": "failed",
                            "note": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}]
                _print_table(new)
                print(flush=True)
                rows += new
                _write_json(args.json, shape, args, rows)
                torch.cuda.empty_cache()
    if "ep" in sections and args.world_size > 0:
        inp = None
        torch.cuda.empty_cache()
        new = ep_rows(shape, args)
        _print_table(new)
        rows += new
    _write_json(args.json, shape, args, rows)
    return 0


def _write_json(path: str | None, shape: LayerShape, args: argparse.Namespace, rows: list[dict]) -> None:
    """The rows so far and the setup (rewritten after each section, so a cut-off run keeps them)."""
    if not path:
        return
    setup = {
        "shape": asdict(shape), "dtype": args.dtype, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "python": platform.python_version(),
    }
    try:
        import triton

        setup["triton"] = triton.__version__
    except ImportError:
        pass
    with open(path, "w") as f:
        json.dump({"setup": setup, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
