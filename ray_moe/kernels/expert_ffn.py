"""``expert_ffn_triton``: the fused SwiGLU experts as one autograd Function.

Forward (5 launches, no host sync, shapes fixed by R, K, H, I, S):
    pair_layout (3 small kernels) → gate_up_swiglu (gather fused into loads, SwiGLU epilogue,
    saves g|u) → down_scaled (router weight in the epilogue) → gather_sum (one write per row).
Backward:
    swiglu_backward_rows (grad_out gathered; recomputes a from g|u; gives d(g|u), weight*a and
    the router-weight gradient) → dgrad_rows + gather_sum (dx) → grouped_wgrad twice (dW13, dW2; Triton, or
    ``torch._grouped_mm`` on gathered rows when the plan says ``wgrad="grouped_mm"``, or quack's
    varlen-K GEMM with the row gather in its loads for ``wgrad="quack"``).
Saved for backward: x, weight, w13, w2 (inputs), g|u [R*K, 2I] (pre-activations) and the int32
pair layout; nothing else.

With a deferral (:class:`ray_moe.model.wgrad.WgradDeferral`) the two weight-gradient GEMMs run
on its side stream and accumulate into ``w13.grad``/``w2.grad`` there, so what autograd runs next
(the dispatch's backward exchange of dx) overlaps them; the deferral's ``join`` (called by that
exchange once launched, and by the engine after backward) makes the current stream wait for them.
"""

from __future__ import annotations

from typing import Any

import torch

from ray_moe.kernels.gather_sum import gather_sum
from ray_moe.kernels.grouped_swiglu import (
    KernelPlan,
    RowSplit,
    default_plan,
    dgrad_rows,
    down_scaled,
    gate_up_swiglu,
    grouped_wgrad,
    grouped_wgrad_mm,
    swiglu_backward_rows,
)
from ray_moe.kernels.quack_wgrad import grouped_wgrad_quack
from ray_moe.kernels.routing import PairLayout, pair_layout, pair_layout_local_first


def _early_split(slot: torch.Tensor, n_slots: int, early: Any) -> tuple[PairLayout, RowSplit]:
    """The pair layout with each group's early rows first, and the up-projection's two launches
    (``early``: :class:`ray_moe.model.experts.EarlyRows`)."""
    d = max(0, min(early.slots, n_slots))
    layout, local_end, rest_start = pair_layout_local_first(slot, n_slots, early.lo, early.hi, d)
    source = None if early.source is None else (early.source, early.source_rows, early.lo)
    return layout, RowSplit(first=(layout.offsets[:d], local_end[:d]), rest=(rest_start, layout.offsets[1:]),
                            wait=early.wait, first_source=source)


class _ExpertFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot, weight, w13, w2, plan, deferral=None, early=None):
        R, K = slot.shape
        split = None
        if early is None:
            layout = pair_layout(slot, w13.shape[0])
        else:
            layout, split = _early_split(slot, w13.shape[0], early)
        needs_grad = any(ctx.needs_input_grad)
        cfg = plan.gate_up if split is None else (plan.gate_up_split or plan.gate_up)
        act, h13 = gate_up_swiglu(x, layout, K, w13, save_preact=needs_grad, cfg=cfg, split=split)
        y = down_scaled(act, layout, K, weight, w2, cfg=plan.down)
        del act
        out = gather_sum(y, layout, K)
        if needs_grad:
            ctx.save_for_backward(x, weight, w13, w2, h13, *layout)
        ctx.top_k = K
        ctx.plan = plan
        ctx.deferral = deferral
        # The deferral sets .grad on the parameters themselves. Under activation checkpointing
        # (saved-tensor hooks) ctx.saved_tensors hands back new tensors sharing their storage, and a
        # .grad set on those is lost: keep the parameters (leaves, alive anyway) on ctx instead.
        ctx.params = (w13, w2) if deferral is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, w13, w2, h13, *layout_t = ctx.saved_tensors
        layout = PairLayout(*layout_t)
        K, plan = ctx.top_k, ctx.plan
        grad_out = grad_out.contiguous()
        dh13, aw, dw_pos = swiglu_backward_rows(
            grad_out, layout, K, weight, w2, h13, cfg=plan.dact, fused=plan.fused_dact
        )
        dx = dw13 = dw2 = dweight = None
        if ctx.needs_input_grad[0]:
            dx = gather_sum(dgrad_rows(dh13, layout, K, w13, cfg=plan.dx), layout, K)
        if ctx.needs_input_grad[2]:
            n_valid = layout.offsets[-1]
            pos = layout.pair_pos.long()
            dweight = torch.where(pos < n_valid, dw_pos[pos], 0.0).reshape(weight.shape)
        wg13, wg2 = plan.wgrad13, plan.wgrad2  # TMA reads past offsets[S]: both dact forms zero ZERO_TAIL rows there
        library = {"grouped_mm": grouped_wgrad_mm, "quack": grouped_wgrad_quack}.get(plan.wgrad)
        need13, need2 = ctx.needs_input_grad[3], ctx.needs_input_grad[4]

        def weight_grads():
            g13 = g2 = None
            if need13:
                g13 = (library(x, dh13, layout, K, gather_a=True, gather_b=False) if library else
                       grouped_wgrad(x, dh13, layout, K, gather_a=True, gather_b=False, role="wgrad13",
                                     cfg=wg13, dual=plan.dual_wgrad13))
            if need2:
                g2 = (library(aw, grad_out, layout, K, gather_a=False, gather_b=True) if library else
                      grouped_wgrad(aw, grad_out, layout, K, gather_a=False, gather_b=True, role="wgrad2",
                                    cfg=wg2))
            return g13, g2

        if ctx.deferral is not None and (need13 or need2):
            ctx.deferral.launch(ctx.params, weight_grads, (x, dh13, aw, grad_out, *layout_t))
        else:
            dw13, dw2 = weight_grads()
        return dx, None, dweight, dw13, dw2, None, None, None


def expert_ffn_triton(
    x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    plan: KernelPlan | None = None, deferral: Any = None, early: Any = None,
) -> torch.Tensor:
    """Weighted SwiGLU experts over received rows, fused Triton kernels (sync-free, graph-capturable).

    Args:
        x: [R, H] float32 or bfloat16 token rows.
        slot: int32/int64 [R, K] local slot per (row, k), -1 where that k is not for this rank.
        weight: float32 [R, K] routing weights (0 where slot is -1).
        w13: [S, H, 2I] gate|up weights (x.dtype); w2: [S, I, H] (x.dtype).
        plan: tiles per GEMM (None → :func:`default_plan` for x's dtype and device).
        deferral: an object with ``launch(params, fn, inputs)`` (the model's
            ``WgradDeferral``): the weight gradients go to it, which accumulates them into
            w13.grad / w2.grad (leaf parameters only; autograd gets None for them).
        early: rows of x still arriving (:class:`ray_moe.model.experts.EarlyRows`: ``lo``, ``hi``,
            ``slots``, ``wait``): the up-projection of rows [lo, hi) for the first ``slots``
            slots runs before ``wait()``, the rest after it.
    Returns:
        [R, H] in x.dtype: sum_k weight[r,k] * (silu(x[r] @ gate_s) * (x[r] @ up_s)) @ w2_s over valid k.
        Differentiable w.r.t. x, weight, w13, w2 (slots with no pairs get exactly zero weight grads).
    """
    if x.dim() != 2 or slot.dim() != 2 or weight.shape != slot.shape or slot.shape[0] != x.shape[0]:
        raise ValueError(
            f"expected x [R, H], slot [R, K], weight [R, K]; got x {tuple(x.shape)}, "
            f"slot {tuple(slot.shape)}, weight {tuple(weight.shape)}"
        )
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] != x.shape[1] or w13.shape[2] != 2 * w2.shape[1] \
            or w2.shape[2] != x.shape[1] or w2.shape[0] != w13.shape[0]:
        raise ValueError(
            f"expected w13 [S, H, 2I] and w2 [S, I, H] with H={x.shape[1]}; got {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    if weight.dtype != torch.float32:
        raise TypeError(f"weight must be float32, got {weight.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"x, w13, w2 must share one dtype in (float32, bfloat16); got {x.dtype}, {w13.dtype}, {w2.dtype}")
    devices = {t.device for t in (x, slot, weight, w13, w2)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    plan = plan or default_plan(x.dtype, x.device)
    if deferral is not None and not (w13.is_leaf and w2.is_leaf):
        raise ValueError("a WgradDeferral accumulates into .grad: w13 and w2 must be leaf parameters")
    return _ExpertFFN.apply(x.contiguous(), slot.contiguous(), weight.contiguous(), w13, w2, plan, deferral, early)
