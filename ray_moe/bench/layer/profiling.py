"""Where a training step's time goes: the ``profile`` (kernel times of one step, in launch
order), ``steady`` (steps back to back with the host side), ``wgrad`` (the weight-gradient
GEMMs per backend) and ``rows`` (the row GEMMs beside SonicMoE's quack kernels) sections of
``ray-moe bench layer``."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ray_moe.bench.layer.problem import (
    LayerShape,
    layer_problem,
    log,
    median_ms,
    ray_moe_layer,
    rel_err_gpu,
    tflops,
)
from ray_moe.bench.layer.sonic import SonicLayer, sonic_import_error


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
                err = rel_err_gpu(fn(), ref)
                ms = median_ms(fn, warmup_ms, rep_ms)
                row.update({"ms": ms, "TFLOP/s": tflops(flops, ms), "rel_err vs float32": float(f"{err:.3g}")})
            except Exception as exc:  # a backend that cannot run here is reported, not fatal
                row["note"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            log(f"wgrad: {row}")
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
        t_step = median_ms(step, warmup_ms, rep_ms)
        t_fwd = median_ms(fwd, warmup_ms, rep_ms)
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


def _interleaved(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] gate | up (ray_moe's concatenated halves) → gate and up columns interleaved
    (g0, u0, g1, u1, ...: quack's and SonicMoE's gated layout)."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)


def _concatenated(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_interleaved`: [..., 2I] interleaved → gate | up."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def _rel_err_or_why(got: torch.Tensor, want: torch.Tensor) -> str:
    """``got``'s relative error against ``want`` (float32) as text, or why there is none (a shape
    that does not match even flattened): a backend's output layout must not cost its timing."""
    if got.shape != want.shape:
        if got.numel() != want.numel():
            return f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
        got = got.reshape(want.shape)
    return f"{rel_err_gpu(got.float(), want):.3g}"


def row_gemm_backend_rows(shape: LayerShape, dtype: torch.dtype, seed: int, warmup_ms: int, rep_ms: int) -> list[dict]:
    """The four row GEMMs at the layer shape, each timed alone once per side, on the same routing and
    inputs: ray_moe's default plan and, where quack imports, the quack kernel SonicMoE runs for it
    (``gemm_gated`` up-projection, ``gemm`` down-projection and dX, ``gemm_dgated`` dSwiGLU; the
    ``rows`` section). Each output's relative error against the float32 reference is printed
    beside the time, so a call whose layout differs shows as a large error, not as a fast row.

    What each side does differs where their designs do: ray_moe's down-projection runs its scale
    epilogue (here with weights 1; SonicMoE scales in the combine), and its dSwiGLU is
    the plan's (split: GEMM, then the elementwise kernel) with gate | up halves concatenated,
    quack's one fused kernel with them interleaved."""
    from ray_moe.kernels import grouped_swiglu as gs
    from ray_moe.kernels.quack_wgrad import quack_available
    from ray_moe.kernels.routing import pair_layout
    from ray_moe.model.router import route

    device = torch.device("cuda")
    prob = layer_problem(shape, device, dtype, seed)
    x, w13, w2, K, E, I = prob["x"], prob["w13"], prob["w2"], shape.K, shape.E, shape.I
    with torch.no_grad():
        _, ids, _ = route(x, prob["router"], K, need_probs=False)
    layout = pair_layout(ids.to(torch.int32), E)
    g = torch.Generator(device=device).manual_seed(seed + 2)
    P = shape.T * K
    weight = torch.rand(shape.T, K, generator=g, device=device)
    w_pos = weight.reshape(-1)[layout.sorted_pair.long()].contiguous()  # float32 [P], each position's weight
    go = torch.randn(shape.T, shape.H, generator=g, device=device).to(dtype)
    plan = gs.default_plan(dtype, device)
    act, h13 = gs.gate_up_swiglu(x, layout, K, w13, save_preact=True, cfg=plan.gate_up)
    dh13, _, _ = gs.swiglu_backward_rows(go, layout, K, weight, w2, h13, cfg=plan.dact)
    gemm = 2.0 * P * shape.H * I
    ones = torch.ones_like(weight)
    ref_act, _ = gs.gate_up_swiglu_reference(x, layout, K, w13)
    refs = {
        "up-projection + SwiGLU": {"act": ref_act},
        "down-projection": {"y": gs.down_scaled_reference(act, layout, K, ones, w2)},
        "dSwiGLU": dict(zip(("dh13", "aw", "dweight"), gs.swiglu_backward_rows_reference(go, layout, K, weight, w2, h13))),
        "dX rows": {"dx": gs.dgrad_rows_reference(dh13, layout, K, w13)},
    }
    flops = {"up-projection + SwiGLU": 2 * gemm, "down-projection": gemm, "dSwiGLU": gemm, "dX rows": 2 * gemm}
    ours = {
        "up-projection + SwiGLU": lambda: {"act": gs.gate_up_swiglu(x, layout, K, w13, save_preact=True, cfg=plan.gate_up)[0]},
        "down-projection": lambda: {"y": gs.down_scaled(act, layout, K, ones, w2, cfg=plan.down)},
        "dSwiGLU": lambda: dict(zip(("dh13", "aw", "dweight"), gs.swiglu_backward_rows(
            go, layout, K, weight, w2, h13, cfg=plan.dact))),
        "dX rows": lambda: {"dx": gs.dgrad_rows(dh13, layout, K, w13, cfg=plan.dx)},
    }
    backends = {"ray_moe": ours}
    if quack_available():
        from quack.gemm_interface import gemm as q_gemm
        from quack.gemm_interface import gemm_dgated, gemm_gated

        # the weights in SonicMoE's layout and the views its functional code passes quack
        # (sonicmoe/functional/forward.py, backward.py): c_fc [S, 2I, H] with gate | up rows
        # interleaved, c_proj [S, H, I], both contiguous
        rows_idx = torch.div(layout.sorted_pair, K, rounding_mode="floor").to(torch.int32)
        offsets = layout.offsets
        c_fc = _interleaved(w13).transpose(1, 2).contiguous()
        c_proj = w2.transpose(1, 2).contiguous()
        h13_i = _interleaved(h13).contiguous()
        dh13_i = _interleaved(dh13).contiguous()

        def quack_dgated() -> dict[str, torch.Tensor]:
            dx_i, postact, ds = gemm_dgated(go, c_proj, PreAct=h13_i, activation="swiglu", colvec_scale=w_pos,
                                            colvec_reduce=True, cu_seqlens_m=offsets, A_idx=rows_idx,
                                            dynamic_scheduler=False)
            return {"dh13 interleaved": dx_i, "aw": postact, "dweight": ds}  # compared once concatenated, not timed

        backends["quack (SonicMoE's kernels)"] = {
            "up-projection + SwiGLU": lambda: {"act": gemm_gated(x, c_fc.transpose(1, 2), activation="swiglu",
                                                                 cu_seqlens_m=offsets, A_idx=rows_idx)[1]},
            "down-projection": lambda: {"y": q_gemm(act, c_proj.transpose(1, 2), cu_seqlens_m=offsets)},
            "dSwiGLU": quack_dgated,
            "dX rows": lambda: {"dx": q_gemm(dh13_i, c_fc, cu_seqlens_m=offsets, dynamic_scheduler=False)},
        }
    rows: list[dict] = []
    for what, ref in refs.items():
        for name, fns in backends.items():
            row: dict[str, Any] = {"section": f"rows T={shape.T} E={E}", "what": f"{what} {name}"}
            try:
                got = fns[what]()
                got = {k.removesuffix(" interleaved"): _concatenated(v) if k.endswith(" interleaved") else v
                       for k, v in got.items() if v is not None}
                errs = {k: _rel_err_or_why(v, ref[k]) for k, v in got.items()}
                ms = median_ms(fns[what], warmup_ms, rep_ms)
                row.update({"ms": ms, "TFLOP/s": tflops(flops[what], ms),
                            "rel_err vs float32": ", ".join(f"{k} {e}" for k, e in errs.items())})
            except Exception as exc:  # a backend that cannot run here is reported, not fatal
                row["note"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            log(f"rows: {row}")
            rows.append(row)
    return rows
