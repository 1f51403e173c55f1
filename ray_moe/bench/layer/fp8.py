"""``bench layer --sections fp8``: the routed experts in FP8 beside bf16 and beside torchao, one run.

Rows (forward and forward+backward, medians over ABBA rounds, same inputs):
  - ``layer bf16`` / ``layer fp8``: the MoE layer at W=1 (route + experts + combine,
    :func:`~ray_moe.bench.layer.problem.ray_moe_layer`) with ``moe.expert_precision`` bf16 (the
    Triton kernels) and fp8 (:mod:`ray_moe.kernels.fp8_expert_ffn`, DeepSeek-V3's block scaling);
  - ``experts bf16`` / ``experts fp8`` / ``experts torchao fp8 rowwise``: the expert side alone on
    the same routing; torchao's differentiable FP8 rowwise grouped GEMM
    (``torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm``, over
    ``torch._scaled_grouped_mm``) with the permutation its groups need (each expert's rows padded
    to a multiple of 16), as torchtitan runs it; a row saying why where torchao does not import;
  - ratios: fp8 over bf16 and over torchao (speed-ups, > 1 is faster), and each FP8 output's error
    against the bf16 one.
The issue targets: ≥ 1.4× bf16 at T=32768, H=4096, I=1536, E=128, K=8; ≥ 1.2× at Qwen3-30B-A3B's
experts (H=2048, I=768, E=128, K=8); ahead of torchao's path at both.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from ray_moe.bench.layer.problem import LayerShape, layer_problem, median_ms, ray_moe_layer, rel_err_gpu, tflops


def torchao_rowwise_mm() -> tuple[Callable | None, str]:
    """torchao's differentiable FP8 rowwise grouped GEMM ``fn(A [M, K], B_t [E, K, N] column-major,
    offs int32 [E]) -> [M, N] bf16``, or (None, why not)."""
    try:
        import torchao.prototype.moe_training as mt
    except Exception as exc:  # not installed, or built for another torch
        return None, f"torchao does not import ({type(exc).__name__}: {str(exc)[:120]}); pip install torchao"
    fn = getattr(mt, "_to_fp8_rowwise_then_scaled_grouped_mm", None)
    if fn is not None:  # torchao >= 0.15: groups must come padded (pad_token_groups_for_grouped_mm=False)
        return (lambda a, b_t, offs: fn(a, b_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)), ""
    try:
        from torchao.prototype.moe_training import _scaled_grouped_mm as old
    except ImportError:
        return None, "this torchao has no FP8 rowwise grouped GEMM"
    return (lambda a, b_t, offs: old(a, b_t, offs, out_dtype=torch.bfloat16)), ""


def torchao_expert_ffn(x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, w13_t: torch.Tensor,
                       w2_t: torch.Tensor, mm: Callable) -> torch.Tensor:
    """The SwiGLU experts through ``mm`` (:func:`torchao_rowwise_mm`), sync-free.

    Args: x [R, H] bf16; slot [R, K]; weight float32 [R, K]; w13_t [E, 2I, H] and w2_t [E, H, I]
        (row-major, so that their transposes are the column-major B_t the GEMM wants).
    Returns: [R, H] bf16, differentiable w.r.t. x, weight, w13_t, w2_t.
    """
    from ray_moe.kernels.routing import pair_layout, pair_layout_reference

    R, K = slot.shape
    E, H = w13_t.shape[0], x.shape[1]
    layout = (pair_layout if x.is_cuda else pair_layout_reference)(slot, E)
    offsets = layout.offsets.long()
    padded = (offsets[1:] - offsets[:-1] + 15) // 16 * 16
    pad_end = padded.cumsum(0)
    P = R * K
    cap = P + 16 * E
    pos = torch.arange(P, device=x.device)
    group = torch.searchsorted(offsets[1:], pos, right=True).clamp(max=E - 1)
    valid = pos < offsets[-1]
    dest = torch.where(valid, pad_end[group] - padded[group] + pos - offsets[group], cap)  # cap: a trash row
    pair = layout.sorted_pair.long()
    rows = pair // K
    xp = x.new_zeros(cap + 1, H).index_copy(0, dest, x[rows])[:cap]
    offs = pad_end.to(torch.int32)
    h = mm(xp, w13_t.transpose(1, 2), offs)
    gate, up = h.chunk(2, dim=1)
    a = (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)
    y = mm(a.contiguous(), w2_t.transpose(1, 2), offs)
    w = torch.where(valid, weight.reshape(-1)[pair], 0.0)
    yv = torch.where(valid[:, None], y[dest.clamp(max=cap - 1)].float(), 0.0) * w[:, None]  # rows past the groups: unset
    return torch.zeros(R, H, dtype=torch.float32, device=x.device).index_add(0, rows, yv).to(x.dtype)


def fp8_layer_rows(shape: LayerShape, dtype: torch.dtype, seed: int, warmup_ms: int, rep_ms: int, rounds: int = 3) -> list[dict]:
    """The rows of the module docstring for ``shape`` (CUDA; bf16 weights)."""
    from ray_moe.kernels import expert_ffn_triton
    from ray_moe.kernels.fp8_expert_ffn import Fp8WeightCache, expert_ffn_fp8
    from ray_moe.model.router import route

    device = torch.device("cuda")
    prob = layer_problem(shape, device, dtype, seed)
    x = prob["x"].detach().requires_grad_()
    go = prob["grad"]
    layers = {p: ray_moe_layer(shape, prob, impl="triton", expert_precision=p) for p in ("bf16", "fp8")}
    with torch.no_grad():
        weight, slot, _ = route(prob["x"], prob["router"], shape.K)
    weight = weight.contiguous().requires_grad_()
    w13 = prob["w13"].detach().requires_grad_()
    w2 = prob["w2"].detach().requires_grad_()
    cache = Fp8WeightCache()
    mm, why = torchao_rowwise_mm()
    w13_t = w2_t = None
    if mm is not None:
        w13_t = prob["w13"].transpose(1, 2).contiguous().requires_grad_()
        w2_t = prob["w2"].transpose(1, 2).contiguous().requires_grad_()
        try:  # one call first: a torchao that rejects these operands costs its rows, not the section
            out = torchao_expert_ffn(x, slot, weight, w13_t, w2_t, mm)
            torch.autograd.grad(out, [x, weight, w13_t, w2_t], go)
        except Exception as exc:
            mm, why = None, f"torchao's path failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            w13_t = w2_t = None

    def layer_fn(p: str) -> Callable[[], Any]:
        layer = layers[p]
        params = [layer.router, layer.w13, layer.w2]
        return lambda: layer(x)[0], lambda: torch.autograd.grad(layer(x)[0], [x, *params], go)

    def experts_fn(name: str):
        call = {
            "bf16": lambda: expert_ffn_triton(x, slot, weight, w13, w2),
            "fp8": lambda: expert_ffn_fp8(x, slot, weight, w13, w2, cache=cache),
            "torchao fp8 rowwise": lambda: torchao_expert_ffn(x, slot, weight, w13_t, w2_t, mm),
        }[name]
        leaves = [x, weight, *((w13_t, w2_t) if name.startswith("torchao") else (w13, w2))]
        return call, lambda: torch.autograd.grad(call(), leaves, go)

    cases: dict[str, tuple[Callable, Callable]] = {f"layer {p}": layer_fn(p) for p in ("bf16", "fp8")}
    for name in ("bf16", "fp8") + (("torchao fp8 rowwise",) if mm is not None else ()):
        cases[f"experts {name}"] = experts_fn(name)
    times: dict[tuple[str, str], list[float]] = {}
    names = list(cases)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fwd, fwd_bwd = cases[name]

            def no_grad(fwd=fwd):
                with torch.no_grad():
                    return fwd()

            for phase, fn in (("fwd", no_grad), ("fwd+bwd", fwd_bwd)):
                times.setdefault((name, phase), []).append(median_ms(fn, warmup_ms, rep_ms))
            torch.cuda.empty_cache()
    where = f"T={shape.T} H={shape.H} I={shape.I} E={shape.E} K={shape.K}"
    out: list[dict] = []
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in names:
        for phase, flops in (("fwd", shape.fwd_flops), ("fwd+bwd", 3 * shape.fwd_flops)):
            out.append({"section": f"fp8 {where}", "what": f"{name} {phase}", "ms": med[(name, phase)],
                        "TFLOP/s": tflops(flops, med[(name, phase)]), "rounds": rounds})
    with torch.no_grad():
        ref = cases["experts bf16"][0]().float()
        errs = {"experts fp8": rel_err_gpu(cases["experts fp8"][0]().float(), ref),
                "layer fp8": rel_err_gpu(cases["layer fp8"][0]().float(), cases["layer bf16"][0]().float())}
        if mm is not None:
            errs["experts torchao fp8 rowwise"] = rel_err_gpu(cases["experts torchao fp8 rowwise"][0]().float(), ref)
    for phase in ("fwd", "fwd+bwd"):
        for scope in ("layer", "experts"):
            out.append({"section": f"fp8 {where}", "what": f"{scope} fp8 speed-up over bf16, {phase}",
                        "ratio": med[(f"{scope} bf16", phase)] / med[(f"{scope} fp8", phase)],
                        "rel_err_vs_bf16": errs[f"{scope} fp8"]})
        if mm is not None:
            out.append({"section": f"fp8 {where}", "what": f"experts fp8 speed-up over torchao fp8 rowwise, {phase}",
                        "ratio": med[("experts torchao fp8 rowwise", phase)] / med[("experts fp8", phase)],
                        "rel_err_vs_bf16": errs["experts torchao fp8 rowwise"]})
    if mm is None:
        out.append({"section": f"fp8 {where}", "what": "experts torchao fp8 rowwise", "note": why})
    out.append({"section": f"fp8 {where}", "what": "FP8 weight quantisations during the run (one per weight version)",
                "count": cache.quantizations + layers["fp8"].fp8_weights.quantizations})
    return out
