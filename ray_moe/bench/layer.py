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
from types import MappingProxyType
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
    # few rows per expert (small T, decode): narrower tiles, more programs and stages to stream the weights
    narrow = [C(64, 128, 64, 8, 4, 4), C(64, 64, 64, 8, 4, 5), C(128, 64, 64, 8, 4, 4), C(64, 128, 128, 8, 4, 3),
              C(64, 256, 64, 8, 8, 3)]
    return {
        "gate_up": [(C(128, 128, 64, 8, 8, 3), False), (C(128, 128, 64, 16, 8, 3), False)]
        + [(c, False) for c in hopper(C(128, 128, 64, 8, 8, 3))] + [(C(128, 128, 64, 8, 8, 4, tma=True), False)]
        + [(c, False) for c in narrow] + [(c, False) for c in hopper(C(64, 128, 64, 8, 4, 4))],
        "down": [(c, False) for c in wide] + [(c, False) for c in hopper(C(128, 256, 64, 8, 8, 4), stages_flat=3)]
        + [(c, False) for c in narrow] + [(c, False) for c in hopper(C(64, 128, 64, 8, 4, 4))],
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
    from ray_moe.model.moe import MoELayer, MoELayerSpec

    w13 = prob["w13"]
    layer = MoELayer(MoELayerSpec(shape.H, shape.E, shape.K, shape.I, dtype=w13.dtype, expert_impl=impl),
                     LocalTransport(), device=w13.device, reset=False)
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


SONIC_PRECOMPILE_ENV = MappingProxyType({"QUACK_ARCH": "90", "CUTE_DSL_ARCH": "sm_90a"})


def sonic_precompile(shape: LayerShape, cache_dir: str, limit: int | None = None) -> dict[str, dict[str, int]]:
    """Compile, without a GPU, every quack GEMM config that SonicMoE's autotuner times on sm_90a
    (H100/H200), into quack's on-disk kernel cache ``cache_dir`` (its ``QUACK_CACHE_DIR``).

    SonicMoE's first training step autotunes each of its six quack GEMMs (training and inference
    up-projection + SwiGLU, down-projection, dSwiGLU, dX, dW1, dW2: 9 to 22 configs each) by
    compiling every config in worker processes and timing it; on a fresh device machine that
    takes longer than one 10-minute command. The compiled objects do not depend on T, E, H or I
    (quack compiles with symbolic shapes), so they can be built here once, carried, unpacked
    into the device's ``QUACK_CACHE_DIR``, and the autotuner there only loads and times them:
    SonicMoE still picks its fastest config by measuring every candidate on the device.

    This mirrors quack's own worker path (``quack._compile_worker``: fake tensors,
    ``COMPILE_ONLY``) through SonicMoE's own op bodies, so the tensors, strides and flags are the
    ones a real step passes. Needs the environment of :data:`SONIC_PRECOMPILE_ENV` set before
    cutlass is imported (``main`` does it); the DSL's one-time CUDA driver check is skipped,
    since nothing is launched. Run it in a process of its own: it patches quack's autotuner and
    custom ops for the duration of the call.

    Args:
        shape: any shape (only dtypes, layouts and flags reach the compiled kernels).
        cache_dir: quack's kernel cache directory to fill (``<dir>/<source fingerprint>/*.o``).
        limit: compile at most this many configs per GEMM (tests).
    Returns:
        {step: {"configs": n, "failed": m}} per SonicMoE GEMM call.
    """
    import time

    import cutlass.base_dsl.compiler as dsl_compiler
    import quack.autotuner as qat
    import quack.cache_utils as qcu
    import quack.gemm_interface as qgi
    import sonicmoe.functional.backward as sb
    import sonicmoe.functional.forward as sf
    from torch._library.custom_ops import CustomOpDef
    from torch._subclasses.fake_tensor import FakeTensorMode

    counts: dict[str, dict[str, int]] = {}
    current: dict[str, int] = {}

    def compile_all(self, *args, **kwargs):  # stands in for Autotuner.__call__
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs)[:limit]
        current["configs"] = current.get("configs", 0) + len(configs)
        ret = None  # the caller may unpack a result (gemm_dgated's colvec reduction): a fake tensor
        for cfg in configs:
            t0 = time.time()
            try:
                ret = self.fn(*args, **kwargs, **cfg.all_kwargs())
            except Exception as exc:  # reported; the device autotuner skips such a config too
                current["failed"] = current.get("failed", 0) + 1
                _log(f"  {self.fn.__name__} {cfg}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            _log(f"  {self.fn.__name__} {time.time() - t0:5.1f} s {cfg}")
        return ret

    saved = {"call": qat.Autotuner.__call__, "only": qcu.COMPILE_ONLY, "dir": qcu.CACHE_DIR,
             "check": dsl_compiler.Compiler._check_cuda_dependencies_once,
             "ops": {n: getattr(qgi, n) for n in dir(qgi) if isinstance(getattr(qgi, n), CustomOpDef)}}
    qat.Autotuner.__call__ = compile_all
    qcu.COMPILE_ONLY, qcu.CACHE_DIR = True, cache_dir
    dsl_compiler.Compiler._check_cuda_dependencies_once = lambda self, libs: None
    for n, op in saved["ops"].items():  # quack's custom ops → their Python bodies (no fake kernels)
        setattr(qgi, n, op._init_fn)
    try:
        T, H, I, E, K = shape.T, shape.H, shape.I, shape.E, shape.K
        TK, bf, i32 = T * K, torch.bfloat16, torch.int32
        with FakeTensorMode():
            def t(*size, dtype=bf):
                return torch.empty(*size, dtype=dtype, device="cuda")

            x, dout = t(T, H), t(T, H)
            w1 = t(E, 2 * I, H).permute(1, 2, 0)  # SonicLayer's c_fc.permute(1, 2, 0)
            w2 = t(E, H, I).permute(1, 2, 0)  # c_proj.permute(1, 2, 0)
            off, gidx, sidx = t(E + 1, dtype=i32), t(TK, dtype=i32), t(TK, dtype=i32)
            a, h, scores = t(TK, I), t(TK, 2 * I), t(TK, dtype=torch.float32)
            steps = {  # SonicMoE's op bodies, called as _UpProjection / _DownProjection call them
                "up-projection + SwiGLU (training)":
                    lambda: sf._up_projection_forward._init_fn(x, w1, h, a, None, off, gidx, "swiglu", False, False),
                "up-projection + SwiGLU (inference)":
                    lambda: sf._up_projection_forward._init_fn(x, w1, None, a, None, off, gidx, "swiglu", True, False),
                "down-projection": lambda: sf._down_projection_forward._init_fn(w2, a, t(TK, H), None, off),
                "dSwiGLU (grad_out gathered)": lambda: sb._down_projection_backward_act._init_fn(
                    dout, h, w2, torch.empty_like(h), torch.empty_like(scores), None, None, t(TK, I), scores, off,
                    gidx, sidx, "swiglu"),
                "dW2": lambda: sb._down_projection_backward_weight._init_fn(dout, a, torch.empty_like(w2), off, gidx),
                "dX rows": lambda: sb._up_projection_backward_act._init_fn(w1, t(TK, H), h, None, off, True, False),
                "dW1 (x gathered)": lambda: sb._up_projection_backward_weight._init_fn(
                    x, torch.empty_like(w1), h, off, gidx, True, False),
            }
            for name, step in steps.items():
                current.clear()
                t0 = time.time()
                _log(f"sonic precompile: {name}")
                step()
                counts[name] = {"configs": current.get("configs", 0), "failed": current.get("failed", 0)}
                _log(f"sonic precompile: {name}: {counts[name]} in {time.time() - t0:.0f} s")
    finally:
        qat.Autotuner.__call__ = saved["call"]
        qcu.COMPILE_ONLY, qcu.CACHE_DIR = saved["only"], saved["dir"]
        dsl_compiler.Compiler._check_cuda_dependencies_once = saved["check"]
        for n, op in saved["ops"].items():
            setattr(qgi, n, op)
    return counts


def sonic_autotune_summary() -> dict[str, Any]:
    """What SonicMoE's quack autotuner chose in this process: per tuned GEMM, the number of
    shapes tuned, configs timed for the last one, and the chosen config per shape (short form)."""
    try:
        import quack.gemm_interface as qgi
    except Exception:
        return {}
    out: dict[str, Any] = {}
    for name in ("gemm_gated_tuned", "gemm_tuned", "gemm_dgated_tuned"):
        tuner = getattr(qgi, name, None)
        cache = getattr(tuner, "cache", None) or {}
        if not cache:
            continue

        def short(c: Any) -> str:
            c = c.kwargs.get("config", c)
            return (f"{c.tile_m}x{c.tile_n} {'pp' if c.pingpong else 'coop'} c{c.cluster_m}x{c.cluster_n}"
                    f"{' swapAB' if c.swap_ab else ''}")

        out[name] = {"shapes": len(cache), "configs timed (last)": len(getattr(tuner, "configs_timings", {}) or {}),
                     "chosen": sorted({short(c) for c in cache.values()})}
    return out


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
            note["chooser ms"] = [{n: (round(t, 2) if isinstance(t, float) else t) for n, t in tm.items()}
                                  for tm in layer.expert_chooser.timings.values()]
        if name == "sonicmoe":
            note["quack autotune"] = sonic_autotune_summary()
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
    from ray_moe.device import capture_graph

    graph, _ = capture_graph(fn, warmup=3)
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


def layer_steps(shape: LayerShape, dtype: torch.dtype, seed: int,
                impls: tuple[str, ...]) -> dict[str, tuple[Callable[[], torch.Tensor], Callable[[], None]]]:
    """Per implementation in ``impls`` (ray_moe; SonicMoE where it imports), on one layer problem:
    its training-mode forward (→ [T, H]) and one training step (forward, then backward to the
    input and every weight with the problem's output gradient)."""
    prob = layer_problem(shape, torch.device("cuda"), dtype, seed)
    x = prob["x"].detach().requires_grad_()
    layer = ray_moe_layer(shape, prob)
    runs = {"ray_moe": (lambda: layer(x)[0], (x, layer.router, layer.w13, layer.w2))}
    if "sonicmoe" in impls and sonic_import_error() is None:
        sonic = SonicLayer(prob, shape.K)
        runs["sonicmoe"] = (lambda: sonic(x), (x, *sonic.params))

    def step_of(fwd: Callable[[], torch.Tensor], params: tuple[torch.Tensor, ...]) -> Callable[[], None]:
        def step() -> None:
            torch.autograd.grad(fwd(), params, prob["grad"])

        return step

    return {name: (fwd, step_of(fwd, params)) for name, (fwd, params) in runs.items() if name in impls}


def profile_rows(shape: LayerShape, dtype: torch.dtype, seed: int, top: int = 22,
                 impls: tuple[str, ...] = ("ray_moe", "sonicmoe")) -> list[dict]:
    """Where one training step's GPU time goes (torch.profiler, CUDA kernels by total time):
    one forward+backward of ray_moe's layer and, when it imports, SonicMoE's, after warm-up."""
    from torch.profiler import ProfilerActivity, profile

    rows: list[dict] = []
    for name, (_, step) in layer_steps(shape, dtype, seed, impls).items():
        for _ in range(2):
            step()
        walls = []
        for _ in range(3):  # the step's wall time on the device, to compare with its kernels' sum
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            step()
            t1.record()
            torch.cuda.synchronize()
            walls.append(t0.elapsed_time(t1))
        wall = sorted(walls)[1]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events) / 1e3
        sec = f"profile {name} T={shape.T} E={shape.E}"
        rows.append({"section": sec, "what": "step wall time (events, median of 3) / sum of kernel times",
                     "calls": sum(e.count for e in events), "ms": wall, "share": total / wall})
        for e in events[:top]:
            rows.append({"section": sec, "what": e.key[:90], "calls": e.count, "ms": e.device_time_total / 1e3,
                         "share": e.device_time_total / 1e3 / total})
        rest = events[top:]
        if rest:
            rows.append({"section": sec, "what": f"{len(rest)} other kernels", "calls": sum(e.count for e in rest),
                         "ms": sum(e.device_time_total for e in rest) / 1e3,
                         "share": sum(e.device_time_total for e in rest) / 1e3 / total})
        try:  # the step's kernels in launch order (one name covers several GEMMs: the order tells them apart)
            rows += _timeline_rows(prof, f"timeline {name} T={shape.T} E={shape.E}")
        except Exception as exc:  # profiler internals differ between torch versions: report, go on
            rows.append({"section": sec, "what": "timeline", "note": f"{type(exc).__name__}: {exc}"[:200]})
        torch.cuda.empty_cache()
    return rows


def wgrad_backend_rows(shape: LayerShape, dtype: torch.dtype, seed: int, warmup_ms: int, rep_ms: int) -> list[dict]:
    """The two weight-gradient GEMMs at the layer shape, each backend (Triton default plan, quack
    where installed, torch._grouped_mm) timed alone, with its error against the float32 reference
    (the same routing: float32 router logits, top-k of the layer problem)."""
    from ray_moe.kernels.grouped_swiglu import (
        default_plan,
        grouped_wgrad,
        grouped_wgrad_mm,
        grouped_wgrad_reference,
    )
    from ray_moe.kernels.quack_wgrad import grouped_wgrad_quack, quack_available
    from ray_moe.kernels.routing import pair_layout
    from ray_moe.model.router import route

    device = torch.device("cuda")
    prob = layer_problem(shape, device, dtype, seed)
    x, K, E = prob["x"], shape.K, shape.E
    with torch.no_grad():
        _, ids, _ = route(x, prob["router"], K, need_probs=False)
    layout = pair_layout(ids.to(torch.int32), E)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    P = shape.T * K
    dh13 = torch.randn(P, 2 * shape.I, generator=g, device=device).to(dtype)
    aw = torch.randn(P, shape.I, generator=g, device=device).to(dtype)
    go = torch.randn(shape.T, shape.H, generator=g, device=device).to(dtype)
    plan = default_plan(dtype, device)
    cases = {"dW13 (x gathered)": (x, dh13, True, False, plan.wgrad13, plan.dual_wgrad13, "wgrad13"),
             "dW2 (grad_out gathered)": (aw, go, False, True, plan.wgrad2, False, "wgrad2")}
    rows: list[dict] = []
    for what, (a, b, ga, gb, cfg, dual, role) in cases.items():
        ref = grouped_wgrad_reference(a, b, layout, K, ga, gb)
        flops = 2.0 * P * a.shape[1] * b.shape[1]
        args = (a, b, layout, K, ga, gb)
        backends = {"triton": lambda args=args, role=role, cfg=cfg, dual=dual: grouped_wgrad(
                        *args, role=role, cfg=cfg, dual=dual),
                    "grouped_mm": lambda args=args: grouped_wgrad_mm(*args)}
        if quack_available():
            backends["quack"] = lambda args=args: grouped_wgrad_quack(*args)
        for name, fn in backends.items():
            row: dict[str, Any] = {"section": f"wgrad T={shape.T} E={E}", "what": f"{what} {name}"}
            try:
                err = _rel_err_gpu(fn(), ref)
                ms = _median_ms(fn, warmup_ms, rep_ms)
                row.update({"ms": ms, "TFLOP/s": _tflops(flops, ms), "rel_err vs float32": float(f"{err:.3g}")})
            except Exception as exc:  # a backend that cannot run here is reported, not fatal
                row["note"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            _log(f"wgrad: {row}")
            rows.append(row)
        del ref
    return rows


def steady_rows(shape: LayerShape, dtype: torch.dtype, seed: int, warmup_ms: int, rep_ms: int, n_steps: int = 3,
                impls: tuple[str, ...] = ("ray_moe", "sonicmoe")) -> list[dict]:
    """Training steps back to back, as the timings run them (no synchronisation between steps),
    profiled with the host side: per step, the kernels' sum and the device's idle time; the gap
    between steps; the host's CUDA API calls by total time, and for every call that waits on the
    device (``*Synchronize``, a blocking copy) the torch op and Python stack it came from. Tells
    a steady-state gap between kernel sums and step times apart into device idle (host-bound or
    a synchronisation) and slower kernels."""
    from torch.profiler import ProfilerActivity, profile

    rows: list[dict] = []
    for name, (fwd, step) in layer_steps(shape, dtype, seed, impls).items():
        step()
        t_step = _median_ms(step, warmup_ms, rep_ms)
        t_fwd = _median_ms(fwd, warmup_ms, rep_ms)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(n_steps):
                step()
            torch.cuda.synchronize()
        sec = f"steady {name} T={shape.T} E={shape.E}"
        rows.append({"section": sec, "what": "do_bench median: fwd+bwd / fwd (same process)", "ms": t_step,
                     "note": {"fwd ms": round(t_fwd, 3)}})
        try:
            rows += _steady_analysis(prof.events(), n_steps, sec)
        except Exception as exc:  # profiler internals differ between torch versions: report, go on
            rows.append({"section": sec, "what": "analysis failed", "note": f"{type(exc).__name__}: {exc}"[:200]})
        del prof
        torch.cuda.empty_cache()
    return rows


def _steady_analysis(events: list, n_steps: int, section: str) -> list[dict]:
    """Rows of :func:`steady_rows` from profiler events (``FunctionEvent``-like: name,
    device_type, time_range.start/end in us, thread, stack): the kernels split evenly into
    ``n_steps`` steps in start order."""
    from torch.autograd import DeviceType

    kern = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    per = len(kern) // max(n_steps, 1)
    rows: list[dict] = []
    prev_end = None
    for i in range(n_steps):
        ks = kern[i * per:(i + 1) * per]
        if not ks:
            break
        busy = sum(k.time_range.end - k.time_range.start for k in ks) / 1e3
        start, end = ks[0].time_range.start, max(k.time_range.end for k in ks)
        row = {"section": section, "what": f"step {i + 1}: span first → last kernel", "calls": len(ks),
               "ms": (end - start) / 1e3, "note": {"kernel sum ms": round(busy, 3),
                                                   "idle ms": round((end - start) / 1e3 - busy, 3)}}
        if prev_end is not None:
            row["note"]["gap before ms"] = round((start - prev_end) / 1e3, 3)
        rows.append(row)
        prev_end = end
    host = [e for e in events if e.device_type == DeviceType.CPU and (e.name.startswith("cuda") or e.name.startswith("cu"))]
    agg: dict[str, list[float]] = {}
    for e in host:
        d = (e.time_range.end - e.time_range.start) / 1e3
        a = agg.setdefault(e.name, [0, 0.0, 0.0])
        a[0] += 1
        a[1] += d
        a[2] = max(a[2], d)
    for nm, (n, tot, mx) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:8]:
        rows.append({"section": section, "what": f"host API {nm}", "calls": n, "ms": tot, "note": {"max ms": round(mx, 3)}})
    waits = [e for e in host if "Synchronize" in e.name or ("Memcpy" in e.name and "Async" not in e.name)
             or ("Memcpy" in e.name and (e.time_range.end - e.time_range.start) > 50)]
    host_ids = {id(e) for e in host}
    ops = [e for e in events if e.device_type == DeviceType.CPU and id(e) not in host_ids]
    for w in waits[:12]:
        inner = [o for o in ops if o.thread == w.thread and o.time_range.start <= w.time_range.start
                 and o.time_range.end >= w.time_range.end]
        op = min(inner, key=lambda o: o.time_range.end - o.time_range.start) if inner else None
        stack = [f for f in (getattr(op, "stack", None) or []) if "ray_moe" in f or "sonicmoe" in f or "quack" in f][:4]
        rows.append({"section": section, "what": f"device wait: {w.name}", "calls": 1,
                     "ms": (w.time_range.end - w.time_range.start) / 1e3,
                     "note": {"in op": op.name if op is not None else None, "stack": stack}})
    return rows


def _timeline_rows(prof: Any, section: str, min_ms: float = 0.1) -> list[dict]:
    """The profiled kernels in start order: each kernel of at least ``min_ms`` on its own row,
    shorter ones merged per run, and device idle gaps of at least ``min_ms`` (start in ms from
    the first kernel)."""
    from torch.autograd import DeviceType

    kern = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
    if not kern:
        return []
    t0 = kern[0].time_range.start
    rows: list[dict] = []
    small = {"n": 0, "ms": 0.0, "start": 0.0}
    busy_end = t0
    idle = 0.0

    def flush() -> None:
        if small["n"]:
            rows.append({"section": section, "what": f"{small['n']} short kernels", "calls": small["n"],
                         "ms": small["ms"], "start ms": small["start"]})
            small.update(n=0, ms=0.0)

    for e in kern:
        start, end = e.time_range.start, e.time_range.end
        gap = (start - busy_end) / 1e3
        if gap > 0:
            idle += gap
        if gap >= min_ms:
            flush()
            rows.append({"section": section, "what": "(device idle)", "ms": gap, "start ms": (busy_end - t0) / 1e3})
        dur = (end - start) / 1e3
        if dur >= min_ms:
            flush()
            rows.append({"section": section, "what": e.name[:90], "calls": 1, "ms": dur, "start ms": (start - t0) / 1e3})
        else:
            if not small["n"]:
                small["start"] = (start - t0) / 1e3
            small["n"] += 1
            small["ms"] += dur
        busy_end = max(busy_end, end)
    flush()
    rows.append({"section": section, "what": "span first kernel start → last kernel end; idle inside it",
                 "ms": (busy_end - t0) / 1e3, "note": {"idle ms": round(idle, 3)}})
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
                   " as weight bytes/s against the copy bandwidth; profile: kernel time of one training step;"
                   " steady: training steps back to back with the host side (device idle, waits, API calls);"
                   " wgrad: the weight-gradient GEMMs alone per backend (triton, grouped_mm, quack)")
    p.add_argument("--layer-E", default=None, help="layer/small/profile: comma list of E (default: --E)")
    p.add_argument("--small-T", default="128,1024", help="small: comma list of token counts")
    p.add_argument("--impls", default="ray_moe,sonicmoe", help="layer/small/profile: which layers to run")
    p.add_argument("--sonic-mode", default="full", choices=["full", "forward"],
                   help="layer: SonicMoE forward+backward, or its forward only (its backward GEMMs autotune"
                        " for over ten minutes on a fresh machine)")
    p.add_argument("--sweep", action="store_true", help="time alternative tile configs per kernel")
    p.add_argument("--sonic-precompile", default=None, metavar="DIR",
                   help="no GPU needed: compile every quack GEMM config SonicMoE's autotuner times on sm_90a"
                        " into DIR (carry it as the device's QUACK_CACHE_DIR), then exit")
    p.add_argument("--sonic-precompile-limit", type=int, default=None, help=argparse.SUPPRESS)
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
    if args.sonic_precompile:
        import os

        for k, v in SONIC_PRECOMPILE_ENV.items():  # read when cutlass / quack are first imported
            os.environ.setdefault(k, v)
        counts = sonic_precompile(shape, args.sonic_precompile, args.sonic_precompile_limit)
        print(json.dumps(counts, indent=1))
        return 1 if any(c["failed"] or not c["configs"] for c in counts.values()) else 0
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
    if sections & {"layer", "small", "profile", "steady", "wgrad"}:
        inp = None
        torch.cuda.empty_cache()
        print(f"device: {torch.cuda.get_device_name()}; sonicmoe: {sonic_import_error() or 'imports'}", flush=True)
    if "small" in sections:
        copy_gbs = copy_bandwidth_gbs()
        rows.append({"section": "small T", "what": "device copy bandwidth (read + write)", "GB/s": copy_gbs})
        print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    for name_, E in [(n, e) for n in ("layer", "small", "profile", "steady", "wgrad") for e in layer_es]:
        eshape = LayerShape(shape.T, shape.H, shape.I, E, shape.K)
        for name, step in (
            ("layer", lambda eshape=eshape: sonic_layer_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms, impls,
                                               args.sonic_mode)),
            ("small", lambda eshape=eshape: small_t_rows(eshape, [int(t) for t in args.small_T.split(",")], dtype, args.seed,
                                           args.warmup_ms, args.rep_ms, copy_gbs, impls)),
            ("profile", lambda eshape=eshape: profile_rows(eshape, dtype, args.seed, impls=impls)),
            ("steady", lambda eshape=eshape: steady_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms, impls=impls)),
            ("wgrad", lambda eshape=eshape: wgrad_backend_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms)),
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
