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
  - with ``--fp8-sweep``, ``experts fp8 swept tiles``: the expert side on the sweep's winners.

Before them, :func:`fp8_kernel_rows`: every kernel of one FP8 expert step alone (the quantisations,
up + SwiGLU, down, G = grad_out·w2ᵀ and the SwiGLU backward, dX, dW13, dW2, the
gather-sums) with its ms, share of the step and, for the GEMMs, the bf16 kernel of the same role
beside it, then each fused kernel beside the kernels it replaced (``fusion`` rows); and with
``--fp8-sweep``, :func:`fp8_sweep_rows`: each FP8 GEMM of the shape under every candidate of
:func:`~ray_moe.kernels.fp8_grouped.fp8_candidates` (tiles, stages, warps, promotion form,
persistent or grid), its winner, and the :data:`~ray_moe.kernels.fp8_grouped.FP8_TILES`
entries that make the winners the default for this shape. With ``--fp8-parts ceiling``,
:func:`fp8_ceiling_rows`: torch's library FP8 GEMMs (block-scaled and rowwise) beside its bf16 GEMM
on the up-projection's FLOPs as one dense GEMM, the speed-up this GPU gives the recipe at best.

Targets: ≥ 1.4× bf16 at T=32768, H=4096, I=1536, E=128, K=8; ≥ 1.2× at Qwen3-30B-A3B's
experts (H=2048, I=768, E=128, K=8); ahead of torchao's path at both.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Callable, Mapping
from types import MappingProxyType
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


# the FP8 GEMMs of one expert step: sweep name → (role of fp8_grouped.FP8_ROLES, what it computes)
FP8_GEMMS = MappingProxyType({
    "gate_up": ("gate_up", "up + SwiGLU (x·w13, act written FP8)"),
    "down": ("down", "down (act·w2 × routing weight)"),
    "dact": ("dact", "G = grad_out·w2ᵀ"),
    "dx": ("dx", "dX rows = dh13·w13ᵀ"),
    "wgrad13": ("wgrad", "dW13 = xᵀ·dh13"),
    "wgrad2": ("wgrad", "dW2 = awᵀ·grad_out"),
})


def gemm_dims(name: str, shape: LayerShape) -> tuple[int, int]:
    """The dims :func:`~ray_moe.kernels.fp8_grouped.fp8_config` keys GEMM ``name`` (of
    :data:`FP8_GEMMS`) on: (N, KD) of a row GEMM, (M, N) of a weight gradient."""
    H, I = shape.H, shape.I
    return {"gate_up": (I, H), "down": (H, I), "dact": (I, H), "dx": (H, 2 * I), "wgrad13": (H, 2 * I),
            "wgrad2": (I, H)}[name]


def tiled_ops(tiles: Mapping[tuple[str, int, int], Any]):
    """:data:`~ray_moe.kernels.fp8_expert_ffn.TRITON_OPS` with each GEMM's config looked up in
    ``tiles`` (keys as :data:`~ray_moe.kernels.fp8_grouped.FP8_TILES`'; absent: the default chooser)."""
    from ray_moe.kernels import fp8_grouped as G
    from ray_moe.kernels.fp8_expert_ffn import TRITON_OPS

    def cfg(role: str, d0: int, d1: int, device: torch.device):
        return G.fp8_config(role, (d0, d1), device, tiles=tiles)

    def gate_up(xq, xs, w13t, w13t_s, layout, top_k, out_dtype, save_preact=True):
        return G.fp8_gate_up(xq, xs, w13t, w13t_s, layout, top_k, out_dtype, save_preact,
                             cfg=cfg("gate_up", w13t.shape[1] // 2, w13t.shape[2], xq.device))

    def down(act_q, act_s, w2t, w2t_s, layout, top_k, weight, out_dtype):
        return G.fp8_down(act_q, act_s, w2t, w2t_s, layout, top_k, weight, out_dtype,
                          cfg=cfg("down", w2t.shape[1], w2t.shape[2], act_q.device))

    def rows(a_q, a_s, bt, bt_s, layout, top_k, gather_a, out_dtype):
        return G.fp8_rows(a_q, a_s, bt, bt_s, layout, top_k, gather_a, out_dtype,
                          cfg=cfg("dact" if gather_a else "dx", bt.shape[1], bt.shape[2], a_q.device))

    def wgrad(at, at_s, bt, bt_s, group_tiles, out_dtype):
        return G.fp8_wgrad(at, at_s, bt, bt_s, group_tiles, out_dtype,
                           cfg=cfg("wgrad", at.shape[0], bt.shape[0], at.device))

    return dataclasses.replace(TRITON_OPS, gate_up=gate_up, down=down, rows=rows, wgrad=wgrad)


class _Step:
    """Every intermediate of one FP8 expert step at a layer shape, each kernel callable alone (the
    Triton kernels: CUDA, or the CPU under Triton's interpreter; ``ops``: the steps between the
    GEMMs, :data:`~ray_moe.kernels.fp8_expert_ffn.TRITON_OPS` unless given)."""

    def __init__(self, shape: LayerShape, dtype: torch.dtype, seed: int, device: torch.device, ops: Any = None) -> None:
        from ray_moe.kernels import fp8_quant as Q
        from ray_moe.kernels.fp8_expert_ffn import TRITON_OPS, quantize_expert_weights
        from ray_moe.model.router import route

        prob = layer_problem(shape, device, dtype, seed)
        self.shape, self.dtype, self.ops, K = shape, dtype, ops or TRITON_OPS, shape.K
        self.x, self.go, self.w13, self.w2 = prob["x"], prob["grad"], prob["w13"], prob["w2"]
        with torch.no_grad():
            weight, self.slot, _ = route(self.x, prob["router"], K)
        self.weight = weight.contiguous()
        ops = self.ops
        self.layout = ops.pair_layout(self.slot, shape.E)
        self.fw = quantize_expert_weights(self.w13, self.w2, ops)
        self.xq = ops.quantize_rows(self.x)
        self.act_q, self.act_s, self.h13 = self.gemm("gate_up")
        self.y = self.gemm("down")
        self.gq = ops.quantize_rows(self.go)
        self.g = self.gemm("dact")
        sb = ops.swiglu_bwd(self.g, self.h13, self.weight, self.layout)
        self.dq = sb.dh13_rows
        self.dxr = self.gemm("dx")
        self.tiles = Q.group_tiles(self.layout.offsets)
        self.cols = {"x": ops.quantize_cols(self.xq[0], self.layout, K, True, self.xq[1], dtype),
                     "dh13": sb.dh13_cols, "aw": sb.aw_cols,
                     "grad_out": ops.quantize_cols(self.go, self.layout, K, True)}

    def unfused_swiglu_bwd(self) -> Any:
        """What the fused SwiGLU backward replaces: the elementwise kernel writing dh13 and aw in
        x.dtype, then dh13's row and column quantisations and aw's column one (four kernels)."""
        from ray_moe.kernels import fp8_quant as Q
        from ray_moe.kernels.grouped_swiglu import gated_act_backward_rows

        P, I = self.g.shape
        dh13 = torch.empty(P, 2 * I, dtype=self.g.dtype, device=self.g.device)
        aw = torch.empty(P, I, dtype=self.g.dtype, device=self.g.device)
        dw = torch.empty(P, dtype=torch.float32, device=self.g.device)
        gated_act_backward_rows(self.g, self.h13, self.weight, self.layout, dh13, aw, dw)
        return (Q.quantize_rows(dh13), Q.quantize_cols(dh13, self.layout, 1, False),
                Q.quantize_cols(aw, self.layout, 1, False), dw)

    def unfused_x_cols(self) -> Any:
        """x's column tiles through a dequantised copy of its FP8 rows (what reading them on load replaces)."""
        from ray_moe.kernels import fp8_quant as Q

        x = Q.dequantize_rows(*self.xq).to(self.dtype)
        return Q.quantize_cols(x, self.layout, self.shape.K, True)

    def gemm(self, name: str, cfg: Any = None) -> Any:
        """GEMM ``name`` of :data:`FP8_GEMMS` on this step's operands (``cfg``: None, the chooser's)."""
        from ray_moe.kernels import fp8_grouped as G

        fw, lay, K, dt = self.fw, self.layout, self.shape.K, self.dtype
        if name == "gate_up":
            return G.fp8_gate_up(*self.xq, fw.w13t, fw.w13_s.transpose(1, 2), lay, K, dt, cfg=cfg)
        if name == "down":
            return G.fp8_down(self.act_q, self.act_s, fw.w2t, fw.w2_s.transpose(1, 2), lay, K, self.weight, dt, cfg=cfg)
        if name == "dact":
            return G.fp8_rows(*self.gq, fw.w2, fw.w2_s, lay, K, True, dt, cfg=cfg)
        if name == "dx":
            return G.fp8_rows(*self.dq, fw.w13, fw.w13_s, lay, K, False, dt, cfg=cfg)
        a, b = ("x", "dh13") if name == "wgrad13" else ("aw", "grad_out")
        return G.fp8_wgrad(*self.cols[a], *self.cols[b], self.tiles, dt, cfg=cfg)

    def checked_output(self, name: str, cfg: Any = None) -> torch.Tensor:
        """The output a config must reproduce: h13 (bf16 g|u) of gate_up, else the GEMM's result."""
        out = self.gemm(name, cfg)
        return out[2] if name == "gate_up" else out


def fp8_kernel_rows(shape: LayerShape, dtype: torch.dtype, seed: int, warmup_ms: int, rep_ms: int,
                    device: torch.device = torch.device("cuda"), ops: Any = None) -> list[dict]:
    """Each kernel of one FP8 expert step (forward and backward, the chooser's tiles) alone: ms,
    share of the step's kernel time, TFLOP/s of the GEMMs and the bf16 kernel of the same role
    (the default plan) beside each GEMM; then per kind (quantise, up, down, dX, dW, other)."""
    from ray_moe.kernels import grouped_swiglu as gs

    st = _Step(shape, dtype, seed, device, ops)
    ops, lay, K = st.ops, st.layout, shape.K
    P = shape.T * K
    gemm = 2.0 * P * shape.H * shape.I  # one [P, H] x [H, I] product
    plan = gs.default_plan(dtype, st.x.device)
    act_bf, h13_bf = gs.gate_up_swiglu(st.x, lay, K, st.w13, save_preact=True, cfg=plan.gate_up)
    dh13_bf, aw_bf, _ = gs.swiglu_backward_rows(st.go, lay, K, st.weight, st.w2, h13_bf, cfg=plan.dact)
    # (kind, what, fn, flops, the bf16 kernel of the same role or None); kinds: quantise, up, down,
    # dX (G, the SwiGLU backward, dX rows), dW, other
    steps: list[tuple[str, str, Callable[[], Any], float, Callable[[], Any] | None]] = [
        ("quantise", "weights w13 + w2, 128x128 blocks (once per step)",
         lambda: (ops.quantize_blocks(st.w13), ops.quantize_blocks(st.w2)), 0.0, None),
        ("quantise", "x rows 1x128", lambda: ops.quantize_rows(st.x), 0.0, None),
        ("up", FP8_GEMMS["gate_up"][1], lambda: st.gemm("gate_up"), 2 * gemm,
         lambda: gs.gate_up_swiglu(st.x, lay, K, st.w13, save_preact=True, cfg=plan.gate_up)),
        ("down", FP8_GEMMS["down"][1], lambda: st.gemm("down"), gemm,
         lambda: gs.down_scaled(act_bf, lay, K, st.weight, st.w2, cfg=plan.down)),
        ("other", "gather_sum of y (bf16: the same kernel)", lambda: ops.gather_sum(st.y, lay, K), 0.0,
         lambda: ops.gather_sum(st.y, lay, K)),
        ("quantise", "grad_out rows 1x128", lambda: ops.quantize_rows(st.go), 0.0, None),
        ("dX", FP8_GEMMS["dact"][1] + " (bf16 ms: G and the SwiGLU backward, both kernels)", lambda: st.gemm("dact"), gemm,
         lambda: gs.swiglu_backward_rows(st.go, lay, K, st.weight, st.w2, h13_bf, cfg=plan.dact)),
        ("dX", "SwiGLU backward on G, its outputs written quantised (dh13 rows and cols, aw cols; one kernel)",
         lambda: ops.swiglu_bwd(st.g, st.h13, st.weight, lay), 0.0, None),
        ("dX", FP8_GEMMS["dx"][1], lambda: st.gemm("dx"), 2 * gemm,
         lambda: gs.dgrad_rows(dh13_bf, lay, K, st.w13, cfg=plan.dx)),
        ("other", "gather_sum of dX rows (bf16: the same kernel)", lambda: ops.gather_sum(st.dxr, lay, K), 0.0,
         lambda: ops.gather_sum(st.dxr, lay, K)),
        ("quantise", "x cols (gathered, 128 positions x 1, from its FP8 rows)",
         lambda: ops.quantize_cols(st.xq[0], lay, K, True, st.xq[1], dtype), 0.0, None),
        ("dW", FP8_GEMMS["wgrad13"][1], lambda: st.gemm("wgrad13"), 2 * gemm,
         lambda: gs.grouped_wgrad(st.x, dh13_bf, lay, K, True, False, cfg=plan.wgrad13, dual=plan.dual_wgrad13)),
        ("quantise", "grad_out cols (gathered)", lambda: ops.quantize_cols(st.go, lay, K, True), 0.0, None),
        ("dW", FP8_GEMMS["wgrad2"][1], lambda: st.gemm("wgrad2"), gemm,
         lambda: gs.grouped_wgrad(aw_bf, st.go, lay, K, False, True, cfg=plan.wgrad2)),
    ]
    section = f"fp8 kernels T={shape.T} H={shape.H} I={shape.I} E={shape.E} K={shape.K}"
    out: list[dict] = []
    fp8_ms: dict[str, list[float]] = {}
    bf16_ms: dict[str, list[float]] = {}
    for kind, name, fn, flops, bf16 in steps:
        ms = median_ms(fn, warmup_ms, rep_ms)
        fp8_ms.setdefault(kind, []).append(ms)
        row: dict[str, Any] = {"section": section, "kind": kind, "what": name, "fp8 ms": ms}
        if flops:
            row["fp8 TFLOP/s"] = tflops(flops, ms)
        if bf16 is not None:
            bms = median_ms(bf16, warmup_ms, rep_ms)
            bf16_ms.setdefault(kind, []).append(bms)
            row.update({"bf16 ms": bms, "fp8 speed-up": bms / ms})
        out.append(row)
    total = sum(sum(v) for v in fp8_ms.values())
    for row in out:
        row["share"] = row["fp8 ms"] / total
    for kind in ("quantise", "up", "down", "dX", "dW", "other"):
        ms = sum(fp8_ms.get(kind, []))
        row = {"section": section, "kind": kind, "what": f"total {kind}", "fp8 ms": ms, "share": ms / total}
        if kind in bf16_ms:
            row.update({"bf16 ms": sum(bf16_ms[kind]), "fp8 speed-up": sum(bf16_ms[kind]) / ms})
        out.append(row)
    bf16_total = sum(sum(v) for v in bf16_ms.values())
    out.append({"section": section, "kind": "all", "what": "total of the kernels above", "fp8 ms": total, "share": 1.0,
                "bf16 ms": bf16_total, "fp8 speed-up": bf16_total / total})
    # each fused kernel beside what it replaced (not in the totals): the evidence that it wins
    for what, fused, unfused in (
            ("SwiGLU backward + quantisations of dh13 and aw: one kernel vs four",
             lambda: ops.swiglu_bwd(st.g, st.h13, st.weight, lay), st.unfused_swiglu_bwd),
            ("x cols from its FP8 rows vs through a dequantised copy",
             lambda: ops.quantize_cols(st.xq[0], lay, K, True, st.xq[1], dtype), st.unfused_x_cols)):
        ms, ums = median_ms(fused, warmup_ms, rep_ms), median_ms(unfused, warmup_ms, rep_ms)
        out.append({"section": section, "kind": "fusion", "what": what, "fp8 ms": ms, "unfused ms": ums,
                    "fused speed-up": ums / ms})
    return out


def fp8_sweep_rows(shape: LayerShape, dtype: torch.dtype, seed: int, warmup_ms: int, rep_ms: int,
                   names: tuple[str, ...] = tuple(FP8_GEMMS), device: torch.device = torch.device("cuda"),
                   candidates: Callable[[str], tuple] | None = None, ops: Any = None,
                   ) -> tuple[list[dict], dict[tuple[str, int, int], Any]]:
    """Each FP8 GEMM in ``names`` (of :data:`FP8_GEMMS`) alone under every candidate config of its
    role, each checked against the default config's output (relative error < 5e-3 in the output
    dtype, else reported and not chosen); a config that fails to compile (shared memory) is
    reported, not fatal. Returns the rows (the winners marked, then one row per GEMM with its
    :data:`~ray_moe.kernels.fp8_grouped.FP8_TILES` entry) and the winners keyed as that table.
    ``candidates``: role → configs (None: :func:`~ray_moe.kernels.fp8_grouped.fp8_candidates`)."""
    from ray_moe.kernels import fp8_grouped as G

    candidates = candidates or G.fp8_candidates
    st = _Step(shape, dtype, seed, device, ops)
    P = shape.T * shape.K
    gemm = 2.0 * P * shape.H * shape.I
    flops = {"gate_up": 2 * gemm, "down": gemm, "dact": gemm, "dx": 2 * gemm, "wgrad13": 2 * gemm, "wgrad2": gemm}
    section = f"fp8 sweep T={shape.T} H={shape.H} I={shape.I} E={shape.E} K={shape.K}"
    out: list[dict] = []
    winners: dict[tuple[str, int, int], Any] = {}
    for name in names:
        role = FP8_GEMMS[name][0]
        dims = gemm_dims(name, shape)
        chosen = G.fp8_config(role, dims, st.x.device)
        ref = st.checked_output(name, chosen).float()
        best: tuple[float, Any] | None = None
        rows = []
        for cfg in [chosen] + [c for c in candidates(role) if c != chosen]:
            row: dict[str, Any] = {"section": section, "what": f"{name} {cfg.name}",
                                   "chosen now": cfg == chosen}
            try:
                err = rel_err_gpu(st.checked_output(name, cfg).float(), ref)
                ms = median_ms(lambda cfg=cfg: st.gemm(name, cfg), warmup_ms, rep_ms)
                row.update({"ms": ms, "TFLOP/s": tflops(flops[name], ms), "rel_err_vs_chosen": err})
                if err >= 5e-3:
                    row["note"] = "output differs from the chosen config's: not a candidate"
                elif best is None or ms < best[0]:
                    best = (ms, cfg)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"
            rows.append(row)
            torch.cuda.empty_cache()
        for row in rows:
            row["winner"] = best is not None and row["what"] == f"{name} {best[1].name}"
        out += rows
        if best is not None:
            key = (role, *dims)
            winners[key] = best[1]
            chosen_ms = next((r["ms"] for r in rows if r["chosen now"] and "ms" in r), float("nan"))
            out.append({"section": section, "what": f"{name} winner: {best[1].name}", "ms": best[0],
                        "speed-up over chosen": chosen_ms / best[0],
                        "FP8_TILES entry": f"{key!r}: {_cfg_literal(best[1])},"})
    entries = [r["FP8_TILES entry"] for r in out if "FP8_TILES entry" in r]
    print("FP8_TILES entries of this shape's winners (ray_moe/kernels/fp8_grouped.py):", *entries, sep="\n    ",
          flush=True)
    return out, winners


def _cfg_literal(cfg: Any) -> str:
    """``cfg`` as the ``_F(...)`` literal of :data:`~ray_moe.kernels.fp8_grouped.FP8_TILES`' source
    (only the fields that differ from the defaults after the four positional ones)."""
    default = type(cfg)()
    extra = "".join(f", {f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)[4:]
                    if getattr(cfg, f.name) != getattr(default, f.name))
    return f"_F({cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}{extra})"


def fp8_layer_rows(shape: LayerShape, dtype: torch.dtype, seed: int, warmup_ms: int, rep_ms: int, rounds: int = 3,
                   tiles: Mapping[tuple[str, int, int], Any] | None = None) -> list[dict]:
    """The rows of the module docstring for ``shape`` (CUDA; bf16 weights). ``tiles``: a sweep's
    winners (keys as ``FP8_TILES``'): adds the expert side on them (``experts fp8 swept tiles``)."""
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
    swept = tiled_ops(tiles) if tiles else None
    mm, why = torchao_rowwise_mm()
    if mm is None:
        print(f"torchao fp8 rowwise rows skipped: {why}", flush=True)
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
            "fp8 swept tiles": lambda: expert_ffn_fp8(x, slot, weight, w13, w2, cache=cache, ops=swept),
            "torchao fp8 rowwise": lambda: torchao_expert_ffn(x, slot, weight, w13_t, w2_t, mm),
        }[name]
        leaves = [x, weight, *((w13_t, w2_t) if name.startswith("torchao") else (w13, w2))]
        return call, lambda: torch.autograd.grad(call(), leaves, go)

    cases: dict[str, tuple[Callable, Callable]] = {f"layer {p}": layer_fn(p) for p in ("bf16", "fp8")}
    for name in ("bf16", "fp8") + (("fp8 swept tiles",) if swept else ()) + (("torchao fp8 rowwise",) if mm else ()):
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
        if swept:
            errs["experts fp8 swept tiles"] = rel_err_gpu(cases["experts fp8 swept tiles"][0]().float(), ref)
    for phase in ("fwd", "fwd+bwd"):
        for scope in ("layer", "experts"):
            out.append({"section": f"fp8 {where}", "what": f"{scope} fp8 speed-up over bf16, {phase}",
                        "ratio": med[(f"{scope} bf16", phase)] / med[(f"{scope} fp8", phase)],
                        "rel_err_vs_bf16": errs[f"{scope} fp8"]})
        if mm is not None:
            out.append({"section": f"fp8 {where}", "what": f"experts fp8 speed-up over torchao fp8 rowwise, {phase}",
                        "ratio": med[("experts torchao fp8 rowwise", phase)] / med[("experts fp8", phase)],
                        "rel_err_vs_bf16": errs["experts torchao fp8 rowwise"]})
        for other in (("bf16", "torchao fp8 rowwise") if mm else ("bf16",)) if swept else ():
            out.append({"section": f"fp8 {where}", "what": f"experts fp8 swept tiles speed-up over {other}, {phase}",
                        "ratio": med[(f"experts {other}", phase)] / med[("experts fp8 swept tiles", phase)],
                        "rel_err_vs_bf16": errs["experts fp8 swept tiles"]})
    if mm is None:
        out.append({"section": f"fp8 {where}", "what": "experts torchao fp8 rowwise", "note": why})
    out.append({"section": f"fp8 {where}", "what": "FP8 weight quantisations during the run (one per weight version)",
                "count": cache.quantizations + layers["fp8"].fp8_weights.quantizations})
    return out


def _scaled_mm_blockwise(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor
                         ) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """Calls of torch's block-scaled FP8 GEMM (cuBLASLt, DeepSeek-V3's 1×128 and 128×128 scales)
    on ``aq [M, K]`` e4m3 with ``sa [M, K/128]`` and ``bq [N, K]`` e4m3 with ``sb [N/128, K/128]``,
    one per scale layout torch releases have asked for; the caller keeps the first that is right."""
    F = torch.nn.functional
    b = bq.t()  # [K, N], column-major: the layout FP8 GEMMs take
    sa_layouts = {"sa": sa, "sa M-major": sa.t().contiguous().t()}
    sb_layouts = {"sbT": sb.t(), "sbT contiguous": sb.t().contiguous(), "sb": sb}
    calls: list[tuple[str, Callable[[], torch.Tensor]]] = []
    for (na, a_s), (nb, b_s) in itertools.product(sa_layouts.items(), sb_layouts.items()):
        if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
            st = F.ScalingType
            calls.append((f"F.scaled_mm {na}, {nb}", lambda a_s=a_s, b_s=b_s: F.scaled_mm(
                aq, b, a_s, st.BlockWise1x128, b_s, st.BlockWise128x128, output_dtype=torch.bfloat16)))
        calls.append((f"torch._scaled_mm {na}, {nb}", lambda a_s=a_s, b_s=b_s: torch._scaled_mm(
            aq, b, scale_a=a_s, scale_b=b_s, out_dtype=torch.bfloat16)))
    return calls


def fp8_ceiling_rows(shape: LayerShape, warmup_ms: int, rep_ms: int, seed: int = 0,
                     device: torch.device = torch.device("cuda")) -> list[dict]:
    """What a library FP8 GEMM gains over bf16 on this GPU, for the up-projection's FLOPs as one
    dense GEMM (``[T·K, H] × [H, 2I]``, no grouping): torch's bf16 ``mm`` beside cuBLASLt's
    block-scaled FP8 (DeepSeek-V3's scales, where this torch has it) and the rowwise FP8 GEMM with
    and without fast accumulation. The speed-up of the block-scaled row is the ceiling a grouped
    FP8 kernel with the same recipe can expect; each FP8 output is checked against float32 of the
    same quantised operands (rows that miss by more than 1e-2 relative are reported as wrong)."""
    from ray_moe.kernels import fp8_quant as Q

    M, Kd, N = shape.T * shape.K, shape.H, 2 * shape.I
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(M, Kd, device=device, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(N, Kd, device=device, dtype=torch.bfloat16, generator=g) / Kd ** 0.5).contiguous()
    aq, sa = Q.quantize_rows(a)
    bq, _, sb = Q.quantize_blocks(w[None])
    bq, sb = bq[0], sb[0]
    check_rows = slice(0, min(M, 2048))
    ref = Q.dequantize_rows(aq[check_rows], sa[check_rows]) @ Q.dequantize_blocks(bq[None], sb[None])[0].t()
    flops = 2.0 * M * Kd * N
    where = f"fp8 ceiling [{M}, {Kd}] x [{Kd}, {N}]"
    out: list[dict] = []
    bf16_ms = median_ms(lambda: a @ w.t(), warmup_ms, rep_ms)
    out.append({"section": where, "what": "bf16 torch.mm", "ms": bf16_ms, "TFLOP/s": tflops(flops, bf16_ms)})

    def timed(what: str, fn: Callable[[], torch.Tensor], ref_: torch.Tensor) -> str:
        """Times ``fn`` into a row if its output is right; else returns why not."""
        try:
            err = rel_err_gpu(fn()[check_rows].float(), ref_)
        except Exception as exc:  # this torch or GPU lacks the recipe or refuses the layout
            return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
        if err > 1e-2:
            return f"wrong: rel. error {err:.3g} against float32 of the quantised operands"
        ms = median_ms(fn, warmup_ms, rep_ms)
        out.append({"section": where, "what": what, "ms": ms, "TFLOP/s": tflops(flops, ms),
                    "fp8 speed-up": bf16_ms / ms, "rel_err_vs_f32": err})
        return ""

    calls = _scaled_mm_blockwise(aq, sa, bq, sb)
    whys: dict[str, str] = {}
    for what, fn in calls:
        whys[what] = timed(f"block-scaled FP8 ({what})", fn, ref)
        if not whys[what]:
            break
    else:
        out.append({"section": where, "what": "block-scaled FP8 (cuBLASLt 1x128 / 128x128)",
                    "note": f"none of {len(calls)} scale layouts ran right: "
                            + " | ".join(dict.fromkeys(whys.values()))})
    # rowwise: one scale per row of A and per column of B over all of K (torchao's recipe)
    a_amax = a.float().abs().amax(1, keepdim=True).clamp_min(1e-12)
    w_amax = w.float().abs().amax(1, keepdim=True).clamp_min(1e-12)
    ra, rw = a_amax / 448.0, w_amax / 448.0
    aq_r = (a.float() / ra).clamp(-448, 448).to(Q.FP8_DTYPE)
    wq_r = (w.float() / rw).clamp(-448, 448).to(Q.FP8_DTYPE)
    ref_r = (aq_r[check_rows].float() * ra[check_rows]) @ (wq_r.float() * rw).t()
    for fast in (False, True):
        what = f"rowwise FP8 torch._scaled_mm, use_fast_accum={fast}"
        why = timed(what, lambda fast=fast: torch._scaled_mm(
            aq_r, wq_r.t(), scale_a=ra, scale_b=rw.t(), out_dtype=torch.bfloat16, use_fast_accum=fast), ref_r)
        if why:
            out.append({"section": where, "what": what, "note": why})
    return out
