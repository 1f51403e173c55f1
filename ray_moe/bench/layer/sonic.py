"""The whole layer beside SonicMoE (same process, same weights and inputs): the ``layer`` and
``small`` sections of ``ray-moe bench layer``, SonicMoE's adapter, and its kernel precompilation
(``--sonic-precompile``, no GPU needed)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable

import torch

from ray_moe.bench.layer.problem import (
    LayerShape,
    graph_ms,
    layer_problem,
    log,
    median_ms,
    ray_moe_layer,
    rel_err_gpu,
    tflops,
)


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
    compiling every config in worker processes and timing it; on a fresh GPU machine that
    takes over ten minutes. The compiled objects do not depend on T, E, H or I
    (quack compiles with symbolic shapes), so they can be built once without a GPU, copied,
    unpacked into the GPU machine's ``QUACK_CACHE_DIR``, and the autotuner there only loads and times them:
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
                log(f"  {self.fn.__name__} {cfg}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            log(f"  {self.fn.__name__} {time.time() - t0:5.1f} s {cfg}")
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
                log(f"sonic precompile: {name}")
                step()
                counts[name] = {"configs": current.get("configs", 0), "failed": current.get("failed", 0)}
                log(f"sonic precompile: {name}: {counts[name]} in {time.time() - t0:.0f} s")
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
    log(f"{sec}: float32 oracle")
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

        log(f"{sec}: {name} first call (compile / autotune / per-shape choice)")
        (fwd_bwd if backward else fwd)()  # compiles / autotunes (SonicMoE's quack GEMMs; ray_moe's choice)
        torch.cuda.synchronize()
        log(f"{sec}: {name} errors, saved bytes, timings")
        out = fwd().detach()
        errs = {"out": rel_err_gpu(out, ref_out)}
        if backward:
            grads = to_ray(*torch.autograd.grad(fwd(), params, grad))
            errs.update({f"d{n}": rel_err_gpu(a, b) for n, a, b in zip(("x", "router", "w13", "w2"), grads, ref_grads)})
            del grads
        del out
        saved, peak = _saved_and_peak(
            fwd, (lambda o, params=params: torch.autograd.grad(o, params, grad)) if backward else (lambda o: None),
            params)
        t_f = median_ms(fwd, warmup_ms, rep_ms)
        t_fb = median_ms(fwd_bwd, warmup_ms, rep_ms) if backward else float("nan")
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
        log(f"{sec}: {name} fwd {t_f:.2f} ms, fwd+bwd {t_fb:.2f} ms, errors {errs}")
        rows.append({"section": sec, "what": name, "fwd ms": t_f, "fwd TFLOP/s": tflops(fl, t_f),
                     "fwd+bwd ms": t_fb, "bwd ms": t_fb - t_f, "bwd TFLOP/s": tflops(2 * fl, t_fb - t_f),
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
    ms = median_ms(lambda: dst.copy_(src), warmup_ms, rep_ms)
    return 2 * n_bytes / (ms * 1e-3) / 1e9


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
            log(f"small T E={shape.E}: {name} T={T}")
            try:
                with torch.no_grad():
                    fn()  # compile / autotune / per-shape choice outside the timings
                    eager = median_ms(fn, warmup_ms, rep_ms)
                    graph = graph_ms(fn, warmup_ms, rep_ms)
                gbs = w_bytes / (graph * 1e-3) / 1e9
                res[name] = {"eager": eager, "graph": graph}
                note: dict[str, Any] = {"experts touched": touched, "weight MB": w_bytes / 1e6}
                if name == "ray_moe":  # the chooser's pick for these rows (forward only) and its timings
                    chooser = layer.expert_chooser
                    key = chooser.key(x, ids, layer.w13, needs_grad=False)
                    if key in chooser.choices:
                        note["expert impl"] = chooser.choices[key].name
                        note["chooser ms"] = {n: (round(t, 3) if isinstance(t, float) else t)
                                              for n, t in chooser.timings[key].items()}
                row.update({"eager ms": eager, "graph ms": graph, "eager / graph": eager / graph,
                            "weight GB/s (graph)": gbs, "of copy BW": gbs / copy_gbs, "note": note})
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
