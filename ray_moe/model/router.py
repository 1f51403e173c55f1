"""Routers: token → (weights, logical expert ids), the pair every MoE layer hands to placement.

Every router variant ends in the same ``(weights float32 [T, K], ids int64 [T, K])`` pair, so
placement, dispatch, experts and combine are the same for all of them. The variants
(:class:`Routing`):

- softmax top-k, renormalised (the byte model, Mixtral, Qwen3-MoE with ``norm_topk_prob``) or not
  (Qwen3-MoE without it);
- sigmoid scores (DeepSeek-V3, GLM-4.5): the choice uses scores + a balancing bias (aux-loss-free
  balancing, :func:`balancing_bias_step`), optionally limited to the ``topk_group`` best of
  ``n_group`` expert groups (a group scores the sum of its best two); the weights are the
  unbiased scores of the chosen experts, optionally renormalised, times ``scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """How router logits become (weights, ids).

    scoring: softmax | sigmoid. normalize: renormalise the K chosen weights to sum 1 (HF's
    ``norm_topk_prob``). n_group / topk_group: group-limited choice. scale: multiplies the weights
    (``routed_scaling_factor``). bias: the choice adds a per-expert balancing bias (sigmoid only).
    """

    scoring: str = "softmax"
    normalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0
    bias: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"routing scoring {self.scoring!r} is not one of softmax, sigmoid")
        if self.bias and self.scoring != "sigmoid":
            raise ValueError("a balancing bias needs sigmoid scoring")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"need 1 <= topk_group={self.topk_group} <= n_group={self.n_group}")

    @property
    def plain_softmax(self) -> bool:
        """Softmax, renormalised, unscaled, ungrouped: what the fused Triton kernel computes."""
        return self.scoring == "softmax" and self.normalize and self.scale == 1.0 and self.n_group == 1


SOFTMAX = Routing()


def route(
    x: torch.Tensor, router_w: torch.Tensor, top_k: int, fused: bool = False, need_probs: bool = True,
    routing: Routing = SOFTMAX, score_bias: torch.Tensor | None = None, logit_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Top-k routing of ``routing``'s kind (default: softmax, renormalised).

    Args:
        x: [T, H] tokens (any float dtype).
        router_w: [H, E] router weights (kept in float32).
        top_k: K.
        fused: on CUDA, use the fused Triton top-k softmax where the routing is plain softmax
            (same function, one kernel).
        need_probs: also return per-expert probabilities (for the auxiliary load-balancing loss).
        routing: the variant.
        score_bias: float32 [E], the balancing bias (routing.bias); None for no bias.
        logit_bias: float32 [E], a learned bias added to the logits (gpt-oss's router; its softmax
            over the top-k logits is the renormalised softmax top-k); None for none.
    Returns:
        weights: float32 [T, K]; differentiable w.r.t. x and router_w.
        expert_ids: int64 [T, K] logical expert ids.
        probs: float32 [T, E] (softmax, or the sigmoid scores normalised per token), or None when
            not needed on the fused path.
    """
    logits = router_logits(x, router_w)
    if logit_bias is not None:
        logits = logits + logit_bias
    if routing.scoring == "sigmoid":
        return _route_sigmoid(logits, top_k, routing, score_bias)
    if fused and logits.is_cuda and routing.plain_softmax:
        from ray_moe.kernels import topk_softmax

        weights, ids = topk_softmax(logits, top_k)
        return weights, ids, torch.softmax(logits, dim=-1) if need_probs else None
    probs = torch.softmax(logits, dim=-1)
    top_p, top_i = torch.topk(probs, top_k, dim=-1)
    weights = top_p / top_p.sum(-1, keepdim=True) if routing.normalize else top_p
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return weights, top_i, probs


def _route_sigmoid(
    logits: torch.Tensor, top_k: int, routing: Routing, score_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid scores; choice over scores + bias within the best groups; weights from the scores."""
    T, E = logits.shape
    scores = logits.sigmoid()
    choice = scores.detach()
    if score_bias is not None:
        choice = choice + score_bias
    if routing.n_group > 1:
        G = routing.n_group
        grouped = choice.view(T, G, E // G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, routing.topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return weights, ids, scores / scores.sum(-1, keepdim=True)


@torch.no_grad()
def balancing_bias_step(bias: torch.Tensor, tokens: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's aux-loss-free balancing, in place: an expert that got more than the mean load
    has its bias lowered by ``rate``, one that got less has it raised (equal: unchanged).

    bias: float32 [E]; tokens: float32 [E], the global (all ranks') tokens per expert of the step.
    """
    bias += rate * torch.sign(tokens.mean() - tokens)


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
