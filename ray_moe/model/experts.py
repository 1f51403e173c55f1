"""The expert side of an MoE layer: SwiGLU experts over (row, k) pairs grouped by slot, and the
single-process oracle.

Weight layout (shared by every implementation and by checkpoints):
    w13: [S, H, 2I]  gate in ``[..., :I]``, up in ``[..., I:]`` (split, not interleaved)
    w2:  [S, I, H]
    b13: [S, 2I], b2: [S, H]  optional biases (gpt-oss), in the same layout
    expert(x) = act(x @ w13 + b13) @ w2 + b2, act (:class:`ExpertActivation`) = silu(gate) * up,
    or gpt-oss's clamped (up + 1) · gate · σ(α · gate)

``expert_ffn`` is the expert side of a layer. Its input is what a rank received from dispatch:
rows ``x [R, H]``, and per row up to K (slot, weight) pairs (slot -1 = that k went elsewhere).
It returns one weighted partial sum per row, ``[R, H]``, ready for combine. Implementations:

- ``loop``: per-slot matmuls (host reads group sizes); exact in fp32; the CPU path.
- ``grouped_mm``: ``torch._grouped_mm`` over pairs sorted by slot; sync-free and
  CUDA-graph-friendly (fixed R*K capacity; padding pairs sort last and are masked).
- ``triton``: the fused kernels in :mod:`ray_moe.kernels` (when present); biases and the clamped
  activation in their epilogues, the bias gradients by a per-slot sum over the pair layout.

``precision="fp8"`` (``moe.expert_precision``) runs every GEMM in block-scaled FP8 instead,
whatever the implementation: :mod:`ray_moe.kernels.fp8_expert_ffn` (Triton on CUDA, its torch
references emulating the numerics elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ray_moe.model.router import route


EXPERT_PRECISIONS = ("bf16", "fp8")  # bf16: the weights' dtype; fp8: kernels.fp8_expert_ffn


def fp8_weight_cache():
    """A new :class:`~ray_moe.kernels.fp8_expert_ffn.Fp8WeightCache` (one per layer)."""
    from ray_moe.kernels.fp8_expert_ffn import Fp8WeightCache

    return Fp8WeightCache()


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """[N, 2I] gate|up → [N, I]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ExpertActivation:
    """The experts' gated activation, [N, 2I] gate|up → [N, I]: ``swiglu`` (silu(gate) · up) or
    ``clamped_swiglu`` (gpt-oss: gate clamped above at ``limit``, up to ±``limit``, then
    (up + 1) · gate · σ(``alpha`` · gate), in transformers' order of operations)."""

    kind: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ("swiglu", "clamped_swiglu"):
            raise ValueError(f"expert activation {self.kind!r} is not one of swiglu, clamped_swiglu")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return swiglu(h)
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SWIGLU = ExpertActivation()


def expert_ffn(
    x: torch.Tensor,
    slot: torch.Tensor,
    weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    impl: str = "auto",
    wgrad: str = "triton",
    act: ExpertActivation = SWIGLU,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    precision: str = "bf16",
    fp8_cache=None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Weighted SwiGLU experts over received rows.

    Args:
        x: [R, H] received token rows (float32 or bfloat16).
        slot: int [R, K] local expert slot per (row, k); -1 where that k is not for this rank.
        weight: float32 [R, K] routing weights (0 where slot is -1).
        w13: [S, H, 2I] gate|up weights of the S local slots; w2: [S, I, H].
        impl: auto | loop | grouped_mm | triton (auto: triton on Hopper bf16, else loop; MoELayer
            goes further and measures per shape, see ray_moe.model.expert_choice).
        wgrad: with triton, who computes the weight gradients: triton | grouped_mm | quack.
        act: the gated activation (:class:`ExpertActivation`); b13 [S, 2I], b2 [S, H]: optional
            biases of the up (gate|up) and down projections (both or neither).
        precision: bf16 (the weights' dtype, as above) or fp8 (:data:`EXPERT_PRECISIONS`): every GEMM
            in block-scaled FP8, Triton on CUDA and the emulating torch references elsewhere, whatever
            ``impl`` says (:func:`~ray_moe.kernels.fp8_expert_ffn.expert_ffn_fp8`; needs I % 128 == 0).
        fp8_cache: with fp8, the layer's FP8 weight cache (None: the weights are quantised per call).
        x_fp8: with fp8, the rows already quantised (FP8 rows from the wire; x is then their
            stand-in): see :func:`~ray_moe.kernels.fp8_expert_ffn.expert_ffn_fp8`.
    Returns:
        [R, H] in x.dtype: sum_k weight[r, k] * expert_{slot[r, k]}(x[r]); rows with no valid k are 0.
        Differentiable w.r.t. x, weight, w13, w2 (and b13, b2). Every impl runs the biases and
        either activation (Triton: in the GEMM epilogues and the dSwiGLU kernel).
    """
    if precision not in EXPERT_PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(EXPERT_PRECISIONS)}")
    if precision == "fp8":
        from ray_moe.kernels.fp8_expert_ffn import expert_ffn_fp8

        if b13 is not None or act != SWIGLU:
            raise ValueError("FP8 experts run SwiGLU without biases; these experts have biases or another activation")
        return expert_ffn_fp8(x, slot, weight, w13, w2, cache=fp8_cache, x_fp8=x_fp8)
    impl = resolve_impl(impl, x)
    if (b13 is None) != (b2 is None):
        raise ValueError("expert biases come in pairs: pass both b13 and b2, or neither")
    if wgrad not in ("triton", "grouped_mm", "quack"):  # kernels.grouped_swiglu.WGRAD_BACKENDS
        raise ValueError(f"wgrad {wgrad!r} is not one of triton, grouped_mm, quack")
    if impl == "loop":
        return _expert_ffn_loop(x, slot, weight, w13, w2, act, b13, b2)
    if impl == "grouped_mm":
        return _expert_ffn_grouped_mm(x, slot, weight, w13, w2, act, b13, b2)
    if impl == "triton":
        from dataclasses import replace

        from ray_moe.kernels import expert_ffn_triton
        from ray_moe.kernels.grouped_swiglu import default_plan

        plan = None if wgrad == "triton" else replace(default_plan(x.dtype, x.device), wgrad=wgrad)
        return expert_ffn_triton(x, slot, weight, w13, w2, plan=plan, act=act, b13=b13, b2=b2)
    raise ValueError(f"expert impl {impl!r} is not one of auto, loop, grouped_mm, triton")


def resolve_impl(impl: str, x: torch.Tensor) -> str:
    """auto → the Triton kernels on CUDA with bf16 on Hopper or newer (they beat the
    grouped_mm path end to end, docs/RESULTS.md#expert-tflops), loop elsewhere."""
    if impl != "auto":
        return impl
    if x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9:
        return "triton"
    return "loop"


def _expert_ffn_loop(x, slot, weight, w13, w2, act=SWIGLU, b13=None, b2=None):
    R, K = slot.shape
    out = torch.zeros_like(x)
    flat_slot = slot.reshape(-1)
    for s in torch.unique(flat_slot[flat_slot >= 0]).tolist():
        pair = (flat_slot == s).nonzero().squeeze(1)
        rows = pair // K
        up = x[rows] @ w13[s]
        if b13 is not None:
            up = up + b13[s]
        h = act(up) @ w2[s]
        if b2 is not None:
            h = h + b2[s]
        w = weight.reshape(-1)[pair].to(h.dtype).unsqueeze(1)
        out = out.index_add(0, rows, h * w)
    if not out.requires_grad and torch.is_grad_enabled():
        # No pair landed here. Keep the output on the autograd graph anyway: the transports'
        # backward passes are collectives, and every rank must reach them.
        tied = x.sum() + weight.sum() + w13.sum() + w2.sum()
        if b13 is not None:
            tied = tied + b13.sum() + b2.sum()
        out = out + 0 * tied.to(out.dtype)
    return out


def _expert_ffn_grouped_mm(x, slot, weight, w13, w2, act=SWIGLU, b13=None, b2=None):
    R, K = slot.shape
    S = w13.shape[0]
    key = torch.where(slot >= 0, slot, S).reshape(-1).long()  # padding pairs sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(S + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = counts[:S].cumsum(0, dtype=torch.int32)
    rows = order // K
    valid = (key[order] < S).unsqueeze(1)
    # Rows past the last group are never written by _grouped_mm: mask them in both directions.
    xs = torch.where(valid, x[rows], 0)
    h = torch._grouped_mm(xs, w13, offs=offs)
    sorted_slot = key[order].clamp(max=S - 1)  # a padding pair's bias row is masked below
    if b13 is not None:
        h = h + b13[sorted_slot]
    h = torch.where(valid, h, 0)
    y = torch._grouped_mm(act(h), w2, offs=offs)
    if b2 is not None:
        y = y + b2[sorted_slot]
    y = torch.where(valid, y, 0)
    w = weight.reshape(-1)[order].to(y.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add(0, rows, y * w)


def reference_moe(
    x: torch.Tensor,
    router_w: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The single-process oracle: all E experts, no communication, one loop per expert.

    Args: x [T, H]; router_w [H, E]; w13 [E, H, 2I]; w2 [E, I, H].
    Returns: (out [T, H] in x.dtype, routing weights float32 [T, K], expert ids int64 [T, K]).
    """
    weights, ids, _ = route(x, router_w, top_k)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, k = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = swiglu(x[tok] @ w13[e]) @ w2[e]
        out = out.index_add(0, tok, h * weights[tok, k].to(h.dtype).unsqueeze(1))
    return out, weights, ids
