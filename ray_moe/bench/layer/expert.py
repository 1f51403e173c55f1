"""Single-GPU sections of ``ray-moe bench layer`` on the expert side (kernels, expert, ffn,
routing, saved): for T, H, I, E, K

  - per-kernel times (optionally a sweep of tile configs: ``kernels``);
  - expert compute alone: ``torch._grouped_mm`` on pre-permuted rows vs the Triton kernels
    (gather fused into the loads), forward and forward+backward, TFLOP/s with 6*T*K*H*I forward
    FLOPs and twice that backward (``expert``);
  - the expert side of a layer (``expert_ffn``) end to end: grouped_mm path vs triton path (``ffn``);
  - routing + permutation (top-k softmax; sort/gather vs counting-sort layout; combine: ``routing``);
  - bytes saved for backward by each path (``saved``);
  - the expert side with gpt-oss's biases and clamped activation beside plain SwiGLU (``epilogue``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ray_moe.bench.layer.problem import LayerShape, median_ms, tflops
from ray_moe.kernels.grouped_swiglu import GEMM_ROLES


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
        dh13, aw, _ = swiglu_backward_rows(go, layout, K, weight, w2, h13, cfg=plan.dact)
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
        ms = median_ms(fn, warmup_ms, rep_ms)
        times[name] = ms
        out.append({"section": "expert compute", "what": name, "ms": ms, "TFLOP/s": tflops(flops, ms)})
    for phase in ("fwd", "fwd+bwd"):
        out.append({
            "section": "expert compute", "what": f"speedup triton/grouped_mm {phase}",
            "ratio": times[f"grouped_mm {phase}"] / times[f"triton {phase}"],
        })
    return out


def expert_ffn_rows(
    shape: LayerShape, inp: dict[str, torch.Tensor], warmup_ms: int, rep_ms: int, plan: Any = None,
    rounds: int = 3,
) -> list[dict]:
    """The expert side of a layer end to end (layout/permutation + GEMMs + combine), with the
    default tiles and, where ``plan`` (a ``--sweep``'s fastest tiles) differs from them, with
    ``plan`` too ("(swept)" rows): in ``rounds`` ABBA rounds, medians, so that a layer-level A/B of
    the tiles is not one GPU temperature against another."""
    import statistics

    from ray_moe.kernels.expert_ffn import expert_ffn_triton
    from ray_moe.kernels.grouped_swiglu import default_plan
    from ray_moe.model.expert_choice import ExpertImplChooser
    from ray_moe.model.experts import expert_ffn

    default = default_plan(inp["x"].dtype, inp["x"].device)
    plans = {"": default}
    if plan is not None and plan != default:
        plans[" (swept)"] = plan
    if len(plans) == 1:
        rounds = 1

    def run(impl: str, *args: torch.Tensor) -> torch.Tensor:
        name, _, tag = impl.partition(" ")
        p = plans[f" {tag}" if tag else ""]
        if name == "triton":
            return expert_ffn_triton(*args, plan=p)
        if name == "triton+mm_wgrad":
            return expert_ffn_triton(*args, plan=dataclasses.replace(p, wgrad="grouped_mm"))
        return expert_ffn(*args, impl=name)

    x = inp["x"].detach().requires_grad_()
    weight = inp["weight"].detach().requires_grad_()
    w13 = inp["w13"].detach().requires_grad_()
    w2 = inp["w2"].detach().requires_grad_()
    slot = inp["slot"]
    go = torch.randn_like(inp["x"])
    impls = ["grouped_mm"] + [f"{i}{tag}" for tag in plans for i in ("triton", "triton+mm_wgrad")]
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for impl in (impls if r % 2 == 0 else impls[::-1]):
            def fwd(impl=impl):
                with torch.no_grad():
                    return run(impl, x, slot, weight, w13, w2)

            def fwd_bwd(impl=impl):
                y = run(impl, x, slot, weight, w13, w2)
                torch.autograd.grad(y, (x, weight, w13, w2), go)

            for phase, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                times.setdefault((impl, phase), []).append(median_ms(fn, warmup_ms, rep_ms))
    out = []
    for impl in impls:
        for phase, flops in (("fwd", shape.fwd_flops), ("fwd+bwd", 3 * shape.fwd_flops)):
            ms = statistics.median(times[(impl, phase)])
            out.append({"section": "expert_ffn", "what": f"{impl} {phase}", "ms": ms, "TFLOP/s": tflops(flops, ms),
                        "rounds": rounds})
    for tag in [t for t in plans if t]:
        for impl in impls[1:3]:
            with torch.no_grad():  # the other tiles compute the same layer (a tile that miscomputes shows here)
                ref, got = run(impl, x, slot, weight, w13, w2).float(), run(f"{impl}{tag}", x, slot, weight, w13, w2).float()
            err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
            for phase in ("fwd", "fwd+bwd"):
                out.append({"section": "expert_ffn", "what": f"{tag.strip(' ()')} / default tiles, {impl} {phase}",
                            "ratio": statistics.median(times[(f"{impl}{tag}", phase)])
                            / statistics.median(times[(impl, phase)]), "rel_err_vs_default": err})
    # what moe.expert_impl=auto picks for this shape (its own shorter measurement, for training)
    chooser = ExpertImplChooser()
    choice = chooser.choose(inp["x"], slot, inp["weight"], inp["w13"], inp["w2"], needs_grad=True)
    (timings,) = chooser.timings.values()
    out.append({"section": "expert_ffn", "what": f"auto chooses {choice.name}",
                "ms": timings[choice.name], "note": {n: (round(t, 3) if isinstance(t, float) else t)
                                                     for n, t in timings.items()}})
    return out


def epilogue_rows(shape: LayerShape, inp: dict[str, torch.Tensor], warmup_ms: int, rep_ms: int,
                  rounds: int = 3) -> list[dict]:
    """The expert side (``expert_ffn``) with gpt-oss's experts (biases b13, b2 and the clamped
    activation, limit 7) beside plain SwiGLU on the same weights: Triton (bias and activation in the
    epilogues, bias gradients by per-slot sums) and grouped_mm, forward and forward+backward, in
    ``rounds`` ABBA rounds (medians); the ratio of each to its plain SwiGLU row."""
    import statistics

    from ray_moe.model.experts import SWIGLU, ExpertActivation, expert_ffn

    clamped = ExpertActivation("clamped_swiglu", 1.702, 7.0)
    gen = torch.Generator(device=inp["x"].device).manual_seed(1)
    leaves = {n: inp[n].detach().requires_grad_() for n in ("x", "weight", "w13", "w2")}
    for name, cols in (("b13", inp["w13"].shape[2]), ("b2", inp["w2"].shape[2])):
        leaves[name] = (torch.randn(inp["w13"].shape[0], cols, generator=gen, device=inp["x"].device) * 0.1).to(
            inp["x"].dtype).requires_grad_()
    go = torch.randn_like(inp["x"])
    cases = [(impl, kind) for impl in ("triton", "grouped_mm") for kind in ("swiglu", "gpt-oss")]

    def run(impl: str, kind: str) -> torch.Tensor:
        extra = dict(act=clamped, b13=leaves["b13"], b2=leaves["b2"]) if kind == "gpt-oss" else dict(act=SWIGLU)
        return expert_ffn(leaves["x"], inp["slot"], leaves["weight"], leaves["w13"], leaves["w2"], impl=impl, **extra)

    times: dict[tuple[str, str, str], list[float]] = {}
    for r in range(rounds):
        for impl, kind in (cases if r % 2 == 0 else cases[::-1]):
            def fwd(impl=impl, kind=kind):
                with torch.no_grad():
                    return run(impl, kind)

            def fwd_bwd(impl=impl, kind=kind):
                wrt = [leaves[n] for n in ("x", "weight", "w13", "w2")] + (
                    [leaves["b13"], leaves["b2"]] if kind == "gpt-oss" else [])
                torch.autograd.grad(run(impl, kind), wrt, go)

            for phase, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                times.setdefault((impl, kind, phase), []).append(median_ms(fn, warmup_ms, rep_ms))
    out = []
    for impl, kind in cases:
        for phase in ("fwd", "fwd+bwd"):
            ms = statistics.median(times[(impl, kind, phase)])
            out.append({"section": "epilogue", "what": f"{impl} {kind} {phase}", "ms": ms, "rounds": rounds,
                        "ratio": ms / statistics.median(times[(impl, "swiglu", phase)])})
    with torch.no_grad():  # the two gpt-oss paths compute the same experts
        a, b = run("triton", "gpt-oss").float(), run("grouped_mm", "gpt-oss").float()
    out.append({"section": "epilogue", "what": "gpt-oss triton vs grouped_mm output",
                "rel_err": float((a - b).norm() / b.norm().clamp_min(1e-30))})
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
        {"section": "routing", "what": name, "ms": median_ms(fn, warmup_ms, rep_ms)} for name, fn in cases
    ]


def sweep_candidates(role: str) -> list[tuple[Any, bool]]:
    """(GemmConfig, variant flag) alternatives timed by ``--sweep`` for one GEMM role; the flag is
    ``dual_wgrad13`` for wgrad13, unused otherwise. Pointer-kernel tiles
    first, then the Hopper variants (TMA descriptors; persistent; persistent + flattened loop)."""
    from dataclasses import replace

    from ray_moe.kernels.grouped_swiglu import GemmConfig as C

    def hopper(c: Any, stages_flat: int | None = None) -> list[Any]:
        return [replace(c, tma=True), replace(c, tma=True, persistent=True),
                replace(c, tma=True, persistent=True, flatten=True, num_stages=stages_flat or c.num_stages)]

    wide = [C(128, 256, 64, 8, 8, 3), C(128, 256, 64, 8, 8, 4), C(256, 128, 64, 8, 8, 3)]
    # the persistent flattened default's neighbours: SonicMoE's 256x128 tile, a shallower k-step, a wider swizzle
    flat_alternatives = [C(*t, tma=True, persistent=True, flatten=True)
                         for t in ((256, 128, 64, 8, 8, 3), (128, 256, 32, 8, 8, 6), (128, 256, 64, 16, 8, 3))]
    # few rows per expert (small T, decode): narrower tiles, more programs and stages to stream the weights
    narrow = [C(64, 128, 64, 8, 4, 4), C(64, 64, 64, 8, 4, 5), C(128, 64, 64, 8, 4, 4), C(64, 128, 128, 8, 4, 3),
              C(64, 256, 64, 8, 8, 3)]
    return {
        "gate_up": [(C(128, 128, 64, 8, 8, 3), False), (C(128, 128, 64, 16, 8, 3), False)]
        + [(C(128, 128, bk, g, 8, s, one_dot=True), False)
           for bk, g, s in ((64, 8, 3), (64, 16, 3), (64, 8, 4), (64, 16, 4), (32, 8, 6), (32, 8, 8))]
        + [(c, False) for c in hopper(C(128, 128, 64, 8, 8, 3))] + [(C(128, 128, 64, 8, 8, 4, tma=True), False)]
        + [(c, False) for c in narrow] + [(c, False) for c in hopper(C(64, 128, 64, 8, 4, 4))],
        "down": [(c, False) for c in wide] + [(c, False) for c in hopper(C(128, 256, 64, 8, 8, 4), stages_flat=3)]
        + [(c, False) for c in flat_alternatives]
        + [(c, False) for c in narrow] + [(c, False) for c in hopper(C(64, 128, 64, 8, 4, 4))],
        "dact": [(C(128, 256, 64, 8, 8, 3), False), (C(128, 128, 64, 8, 8, 4), False)]
        + [(c, False) for c in hopper(C(128, 256, 64, 8, 8, 3))],
        "dx": [(c, False) for c in wide] + [(c, False) for c in hopper(C(128, 256, 64, 8, 8, 3))]
        + [(c, False) for c in flat_alternatives],
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
    shape: LayerShape, inp: dict[str, torch.Tensor], warmup_ms: int, rep_ms: int, sweep: bool,
    sweep_roles: tuple[str, ...] = GEMM_ROLES,
) -> tuple[list[dict], Any]:
    """Each Triton GEMM alone with the default plan's tiles and (``sweep``) alternatives for the
    roles in ``sweep_roles``.

    Returns the rows and the fastest KernelPlan found (the default plan without ``sweep``; the
    roles outside ``sweep_roles`` keep their default tiles).
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
    dh13, aw, _ = gs.swiglu_backward_rows(go, layout, K, weight, w2, h13, cfg=plan.dact)
    gemm = 2.0 * P * shape.H * shape.I  # one [P,H]x[H,I] product
    roles: dict[str, tuple[Callable[[Any, bool], Any], float]] = {
        "gate_up": (lambda c, f: gs.gate_up_swiglu(x, layout, K, w13, save_preact=True, cfg=c), 2 * gemm),
        "down": (lambda c, f: gs.down_scaled(act, layout, K, weight, w2, cfg=c), gemm),
        "dact": (lambda c, f: gs.swiglu_backward_rows(go, layout, K, weight, w2, h13, cfg=c), gemm),
        "dx": (lambda c, f: gs.dgrad_rows(dh13, layout, K, w13, cfg=c), 2 * gemm),
        "wgrad13": (lambda c, f: gs.grouped_wgrad(x, dh13, layout, K, True, False, cfg=c, dual=f), 2 * gemm),
        "wgrad2": (lambda c, f: gs.grouped_wgrad(aw, go, layout, K, False, True, cfg=c), gemm),
    }
    out = []
    best: dict[str, tuple[float, Any, bool]] = {}
    for role, (fn, flops) in roles.items():
        flag = plan.dual_wgrad13 if role == "wgrad13" else False
        default = (getattr(plan, role), flag)
        swept = sweep and role in sweep_roles
        candidates = [default] + ([c for c in sweep_candidates(role) if c != default] if swept else [])
        for cfg, fused in candidates:
            try:
                ms = median_ms(lambda: fn(cfg, fused), warmup_ms, rep_ms)
                row = {"ms": ms, "TFLOP/s": tflops(flops, ms)}
                if role not in best or ms < best[role][0]:
                    best[role] = (ms, cfg, fused)
            except Exception as exc:  # a config that fails to compile (shared memory) is reported, not fatal
                row = {"error": f"{type(exc).__name__}: {str(exc)[:80]}"}
            tag = " dual" if role == "wgrad13" and fused else ""
            out.append({"section": "kernels", "what": f"{role}{tag} {_cfg_name(cfg)}{' (default)' if (cfg, fused) == default else ''}", **row})
    picked = dataclasses.replace(
        plan, **{r: best[r][1] for r in best},
        dual_wgrad13=best["wgrad13"][2] if "wgrad13" in best else plan.dual_wgrad13,
    )
    return out, picked


def _cfg_name(cfg: Any) -> str:
    flags = "".join(f" {n}" for n in ("tma", "persistent", "flatten", "one_dot") if getattr(cfg, n, False))
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
