"""``expert_ffn_triton``: the fused gated experts as one autograd Function.

Forward (5 launches, no host sync, shapes fixed by R, K, H, I, S):
    pair_layout (3 small kernels) → gate_up_swiglu (gather fused into loads, bias + activation
    epilogue, saves g|u) → down_scaled (bias, then the router weight, in the epilogue) →
    gather_sum (one write per row).
Backward:
    swiglu_backward_rows (grad_out gathered; recomputes a from g|u; gives d(g|u), weight*a and
    the router-weight gradient) → dgrad_rows + gather_sum (dx) → grouped_wgrad twice (dW13, dW2; Triton, or
    ``torch._grouped_mm`` on gathered rows when the plan says ``wgrad="grouped_mm"``, or quack's
    varlen-K GEMM with the row gather in its loads for ``wgrad="quack"``) → with biases,
    group_sum twice (db13 = per-slot sum of dh13, db2 = of the weight-scaled grad_out rows).
The activation (SwiGLU or gpt-oss's clamped one) and the biases are constexprs of the same
kernels: without them the kernels are the plain SwiGLU specialisation.
Saved for backward: x, weight, w13, w2, b2 (inputs), g|u [R*K, 2I] (pre-activations, bias
included) and the int32 pair layout; nothing else.
"""

from __future__ import annotations

import torch

from ray_moe.kernels.gather_sum import gather_sum
from ray_moe.kernels.group_sum import group_sum
from ray_moe.kernels.grouped_swiglu import (
    KernelPlan,
    default_plan,
    dgrad_rows,
    down_scaled,
    gate_up_swiglu,
    grouped_wgrad,
    grouped_wgrad_mm,
    swiglu_backward_rows,
)
from ray_moe.kernels.quack_wgrad import grouped_wgrad_quack
from ray_moe.kernels.routing import PairLayout, pair_layout
from ray_moe.kernels.tiles import act_params


class _ExpertFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot, weight, w13, w2, b13, b2, plan, act):
        R, K = slot.shape
        layout = pair_layout(slot, w13.shape[0])
        needs_grad = any(ctx.needs_input_grad)
        a, h13 = gate_up_swiglu(x, layout, K, w13, save_preact=needs_grad, cfg=plan.gate_up, act=act, b13=b13)
        y = down_scaled(a, layout, K, weight, w2, cfg=plan.down, b2=b2)
        del a
        out = gather_sum(y, layout, K)
        if needs_grad:
            ctx.save_for_backward(x, weight, w13, w2, b2, h13, *layout)
        ctx.top_k = K
        ctx.plan = plan
        ctx.act = act
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, w13, w2, b2, h13, *layout_t = ctx.saved_tensors
        layout = PairLayout(*layout_t)
        K, plan = ctx.top_k, ctx.plan
        grad_out = grad_out.contiguous()
        dh13, aw, dw_pos = swiglu_backward_rows(
            grad_out, layout, K, weight, w2, h13, cfg=plan.dact, act=ctx.act, b2=b2
        )
        dx = dw13 = dw2 = dweight = db13 = db2 = None
        if ctx.needs_input_grad[0]:
            dx = gather_sum(dgrad_rows(dh13, layout, K, w13, cfg=plan.dx), layout, K)
        if ctx.needs_input_grad[2]:
            n_valid = layout.offsets[-1]
            pos = layout.pair_pos.long()
            dweight = torch.where(pos < n_valid, dw_pos[pos], 0.0).reshape(weight.shape)
        # TMA reads past offsets[S]: swiglu_backward_rows zeroes ZERO_TAIL rows there
        library = {"grouped_mm": grouped_wgrad_mm, "quack": grouped_wgrad_quack}.get(plan.wgrad)
        if ctx.needs_input_grad[3]:
            dw13 = (library(x, dh13, layout, K, gather_a=True, gather_b=False) if library else
                    grouped_wgrad(x, dh13, layout, K, gather_a=True, gather_b=False, role="wgrad13",
                                  cfg=plan.wgrad13, dual=plan.dual_wgrad13))
        if ctx.needs_input_grad[4]:
            dw2 = (library(aw, grad_out, layout, K, gather_a=False, gather_b=True) if library else
                   grouped_wgrad(aw, grad_out, layout, K, gather_a=False, gather_b=True, role="wgrad2",
                                 cfg=plan.wgrad2))
        if ctx.needs_input_grad[5]:
            db13 = group_sum(dh13, layout, K, gather=False)
        if ctx.needs_input_grad[6]:
            db2 = group_sum(grad_out, layout, K, gather=True, scale=weight)
        return dx, None, dweight, dw13, dw2, db13, db2, None, None


def expert_ffn_triton(
    x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    plan: KernelPlan | None = None, act=None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted gated experts over received rows, fused Triton kernels (sync-free, graph-capturable).

    Args:
        x: [R, H] float32 or bfloat16 token rows.
        slot: int32/int64 [R, K] local slot per (row, k), -1 where that k is not for this rank.
        weight: float32 [R, K] routing weights (0 where slot is -1).
        w13: [S, H, 2I] gate|up weights (x.dtype); w2: [S, I, H] (x.dtype).
        plan: tiles per GEMM (None → :func:`default_plan` for x's dtype and device).
        act: the gated activation: None (silu(gate) · up) or an object with ``kind`` (swiglu |
            clamped_swiglu), ``alpha``, ``limit`` (:class:`ray_moe.model.experts.ExpertActivation`).
        b13: [S, 2I], b2: [S, H] optional biases (x.dtype), both or neither.
    Returns:
        [R, H] in x.dtype: sum_k weight[r,k] * (act(x[r] @ w13_s + b13_s) @ w2_s + b2_s) over valid k.
        Differentiable w.r.t. x, weight, w13, w2, b13, b2 (slots with no pairs get exactly zero
        weight and bias grads).
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
    if (b13 is None) != (b2 is None):
        raise ValueError("expert biases come in pairs: pass both b13 and b2, or neither")
    if b13 is not None and (tuple(b13.shape) != (w13.shape[0], w13.shape[2]) or tuple(b2.shape) != (w2.shape[0], x.shape[1])
                            or b13.dtype != x.dtype or b2.dtype != x.dtype):
        raise ValueError(f"expected b13 [S, 2I] and b2 [S, H] in {x.dtype}; got {tuple(b13.shape)} {b13.dtype}, "
                         f"{tuple(b2.shape)} {b2.dtype}")
    devices = {t.device for t in (x, slot, weight, w13, w2, *(() if b13 is None else (b13, b2)))}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    plan = plan or default_plan(x.dtype, x.device)
    act_params(act)  # an unknown activation fails here, before any launch
    if b13 is not None:
        b13, b2 = b13.contiguous(), b2.contiguous()
    return _ExpertFFN.apply(x.contiguous(), slot.contiguous(), weight.contiguous(), w13, w2, b13, b2, plan, act)
