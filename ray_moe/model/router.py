"""Routers: token → (weights, logical expert ids), the pair every MoE layer hands to placement.

Every router variant ends in the same ``(weights float32 [T, K], ids int64 [T, K])`` pair, so
placement, dispatch, experts and combine are the same for all of them.
"""

from __future__ import annotations

import torch


def route(
    x: torch.Tensor, router_w: torch.Tensor, top_k: int, fused: bool = False, need_probs: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Softmax top-k routing with renormalised weights.

    Args:
        x: [T, H] tokens (any float dtype).
        router_w: [H, E] router weights (kept in float32).
        top_k: K.
        fused: on CUDA, use the fused Triton top-k softmax (same function, one kernel).
        need_probs: also return the full softmax (for the auxiliary load-balancing loss).
    Returns:
        weights: float32 [T, K], rows sum to 1; differentiable w.r.t. x and router_w.
        expert_ids: int64 [T, K] logical expert ids.
        probs: float32 [T, E] full softmax, or None when not needed on the fused path.
    """
    logits = router_logits(x, router_w)
    if fused and logits.is_cuda:
        from ray_moe.kernels import topk_softmax

        weights, ids = topk_softmax(logits, top_k)
        return weights, ids, torch.softmax(logits, dim=-1) if need_probs else None
    probs = torch.softmax(logits, dim=-1)
    top_p, top_i = torch.topk(probs, top_k, dim=-1)
    weights = top_p / top_p.sum(-1, keepdim=True)
    return weights, top_i, probs


def router_logits(x: torch.Tensor, router_w: torch.Tensor) -> torch.Tensor:
    """float32 logits [T, E] = x [T, H] @ router_w [H, E] (float32 weights).

    On CUDA with bf16 tokens (and a torch with ``mm(..., out_dtype=)``): :class:`SplitRouterLogits`,
    tensor-core GEMMs against the router weight split into two bf16 parts (~16 significant bits,
    relative error ~1e-5), with no float32 copy of x (saved for backward by the plain form: 4 bytes
    per element of x). Elsewhere: ``x.float() @ router_w.float()``.
    """
    split_ok = hasattr(torch.ops.aten.mm, "dtype")  # aten::mm.dtype: bf16 x bf16 -> float32 out
    if split_ok and x.is_cuda and x.dtype == torch.bfloat16 and router_w.dtype == torch.float32:
        return SplitRouterLogits.apply(x, router_w)
    return x.float() @ router_w.float()


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 operands with float32 accumulation and output (tensor cores on CUDA)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # the same products (exact in float32) for CPU tests


def _split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 t → (hi, lo) bf16 with hi + lo == t to ~16 significant bits."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


class SplitRouterLogits(torch.autograd.Function):
    """Router logits from bf16 tokens and float32 weights in bf16 tensor-core GEMMs.

    The weight is split w = hi + lo (bf16 each, ~16 significant bits together) and the tokens
    are exact in bf16, so ``x @ [hi | lo]`` with float32 accumulation gives the product to ~1e-5
    relative (float32 would be ~1e-7), at bf16 GEMM speed. Backward splits the float32 logit gradient the same way:
    dW = xᵀ @ [g_hi | g_lo] (float32 out), dx = [g_hi | g_lo | g_hi] @ [hi | hi | lo]ᵀ (bf16 out,
    float32 accumulation). Saves x (already kept by the layer) and the two bf16 weight halves.

    x: bf16 [T, H]; w: float32 [H, E] → float32 [T, E].
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        E = w.shape[1]
        hi, lo = _split_bf16(w)
        both = _mm_f32(x, torch.cat([hi, lo], dim=1))
        ctx.save_for_backward(x, hi, lo)
        return both[:, :E] + both[:, E:]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, hi, lo = ctx.saved_tensors
        E = hi.shape[1]
        g_hi, g_lo = _split_bf16(grad.float().contiguous())
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(torch.cat([g_hi, g_lo, g_hi], dim=1), torch.cat([hi, hi, lo], dim=1).t()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            both = _mm_f32(x.t(), torch.cat([g_hi, g_lo], dim=1))
            dw = both[:, :E] + both[:, E:]
        return dx, dw


def load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Switch-style auxiliary loss E * sum_e f_e * P_e (1.0 at perfect balance).

    probs: float32 [T, E]; expert_ids: int64 [T, K]. Returns a float32 scalar.
    """
    T, E = probs.shape
    counts = torch.zeros(E, device=probs.device, dtype=torch.float32)
    counts.scatter_add_(0, expert_ids.flatten(), torch.ones_like(expert_ids.flatten(), dtype=torch.float32))
    frac = counts / max(expert_ids.numel(), 1)
    return E * (frac * probs.mean(0)).sum()
