"""``expert_ffn_fp8``: the SwiGLU experts with every GEMM in block-scaled FP8 (DeepSeek-V3's recipe).

Recipe (E4M3 everywhere, float32 scales, float32 accumulation promoted every 128 of K):

    forward   x → 1×128 tiles ─┐
              w13 (128×128) ───┴→ gate|up + SwiGLU (g|u saved in x.dtype; act written FP8, 1×128)
              act ─┐ w2 (128×128) ─┴→ down-projection × routing weight → gather_sum (x.dtype)
    backward  grad_out → 1×128 tiles; G = grad_out[row] @ w2ᵀ (FP8) → dSwiGLU, its outputs written
              only quantised (one kernel, fp8_swiglu): dh13 in 1×128 tiles and 128×1 tiles, aw in 128×1
              dX rows = dh13 @ w13ᵀ (FP8) → gather_sum
              dW13 = xᵀ dh13, dW2 = awᵀ grad_out: both operands in 1×128 tiles along positions
              (the contraction), i.e. 128×1 tiles of the row matrices (DeepSeek-V3's backward tiles)

Saved for backward: the routing weights, g|u [P, 2I] in x.dtype (the dSwiGLU recomputes act from
it), the pair layout, and x as its FP8 rows and 1×128 scales, the copy the up-projection read
(made here, or received from the wire): H + 4·H/128 bytes a row instead of 2·H. dW13 reads their
values, dequantised and requantised along the tokens in one pass (DeepSeek-V3 caches a Linear's
input in FP8 the same way and re-tiles it 1×128 → 128×1 in backward), so x reaches dW13 through two
E4M3 roundings; g|u stays in x.dtype: the up-projection's epilogue writes it (an FP8 copy would be
a pass of its own).

The weights' FP8 copies (both orientations, one set of block scales) come from an
:class:`Fp8WeightCache`, made once per parameter version: once per step after the update, not once
per GEMM or per micro-batch (under CUDA-graph capture once per captured forward, so that a replay
after an update reads the new weights).

Two implementations of the same math (:class:`Fp8Ops`): the Triton kernels
(:mod:`~ray_moe.kernels.fp8_quant`, :mod:`~ray_moe.kernels.fp8_grouped`,
:mod:`~ray_moe.kernels.fp8_swiglu`) on CUDA, and the torch references (quantise → dequantise →
float32 matmul, host loops over groups) elsewhere: the CPU path that emulates the numerics, so that
layer parity runs in CI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ray_moe.kernels import fp8_grouped as G
from ray_moe.kernels import fp8_quant as Q
from ray_moe.kernels import fp8_swiglu as S
from ray_moe.kernels.gather_sum import gather_sum, gather_sum_reference
from ray_moe.kernels.routing import PairLayout, pair_layout, pair_layout_reference


class Fp8Weights(NamedTuple):
    """FP8 copies of one layer's expert weights. w13 [S, H, 2I] and w2 [S, I, H] as E4M3 in their
    own layout (the backward's K-major form) and transposed (``w13t`` [S, 2I, H], ``w2t`` [S, H, I]:
    the forward's), with float32 scales per 128×128 block of the own layout."""

    w13: torch.Tensor
    w13t: torch.Tensor
    w13_s: torch.Tensor  # [S, cdiv(H, 128), 2I/128]
    w2: torch.Tensor
    w2t: torch.Tensor
    w2_s: torch.Tensor  # [S, I/128, cdiv(H, 128)]


@dataclass(frozen=True)
class Fp8Ops:
    """One implementation of every step of the FP8 experts (same signatures as the Triton launchers)."""

    quantize_rows: Callable
    quantize_cols: Callable
    quantize_blocks: Callable
    gate_up: Callable
    down: Callable
    rows: Callable
    wgrad: Callable
    swiglu_bwd: Callable  # the SwiGLU backward with its outputs quantised (fp8_swiglu)
    gather_sum: Callable
    pair_layout: Callable


TRITON_OPS = Fp8Ops(Q.quantize_rows, Q.quantize_cols, Q.quantize_blocks, G.fp8_gate_up, G.fp8_down, G.fp8_rows,
                    G.fp8_wgrad, S.swiglu_bwd_fp8, gather_sum, pair_layout)
REFERENCE_OPS = Fp8Ops(Q.quantize_rows_reference, Q.quantize_cols_reference, Q.quantize_blocks_reference,
                       G.fp8_gate_up_reference, G.fp8_down_reference, G.fp8_rows_reference, G.fp8_wgrad_reference,
                       S.swiglu_bwd_fp8_reference, gather_sum_reference, pair_layout_reference)


def default_ops(device: torch.device) -> Fp8Ops:
    """The Triton kernels on CUDA, the emulating references elsewhere."""
    return TRITON_OPS if device.type == "cuda" else REFERENCE_OPS


def quantize_expert_weights(w13: torch.Tensor, w2: torch.Tensor, ops: Fp8Ops | None = None) -> Fp8Weights:
    """:class:`Fp8Weights` of w13 [S, H, 2I] and w2 [S, I, H] (detached; no autograd)."""
    ops = ops or default_ops(w13.device)
    with torch.no_grad():
        q13, q13t, s13 = ops.quantize_blocks(w13.detach())
        q2, q2t, s2 = ops.quantize_blocks(w2.detach())
    return Fp8Weights(q13, q13t, s13, q2, q2t, s2)


class Fp8WeightCache:
    """A layer's :class:`Fp8Weights`, remade when w13 or w2 changes.

    The key is each parameter's storage and in-place version counter (``_version``: the
    optimizer's update bumps it), so every micro-batch and recomputation of a step reuses one
    quantisation. While a CUDA graph is being captured the copies are made inside the capture
    every time (a replay after an update must quantise the new values) and not kept.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weights: Fp8Weights | None = None
        self.quantizations = 0  # how many times the copies were made (tests, benchmarks)

    @staticmethod
    def _key_of(*params: torch.Tensor) -> tuple:
        return tuple((p.data_ptr(), p._version, p.shape, p.dtype, p.device) for p in params)

    def get(self, w13: torch.Tensor, w2: torch.Tensor, ops: Fp8Ops | None = None) -> Fp8Weights:
        """The FP8 copies of (w13, w2), quantised now only if either changed since the last call."""
        capturing = w13.is_cuda and torch.cuda.is_current_stream_capturing()
        key = self._key_of(w13, w2)
        if capturing or key != self._key or self._weights is None:
            weights = quantize_expert_weights(w13, w2, ops)
            self.quantizations += 1
            if capturing:
                return weights
            self._key, self._weights = key, weights
        return self._weights


class _ExpertFFNFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot, weight, w13, w2, fw: Fp8Weights, ops: Fp8Ops, x_fp8=None):
        R, K = slot.shape
        layout = ops.pair_layout(slot, w13.shape[0])
        needs_grad = any(ctx.needs_input_grad)
        xq, xs = ops.quantize_rows(x) if x_fp8 is None else x_fp8
        act_q, act_s, h13 = ops.gate_up(xq, xs, fw.w13t, fw.w13_s.transpose(1, 2), layout, K, x.dtype,
                                        save_preact=needs_grad)
        y = ops.down(act_q, act_s, fw.w2t, fw.w2_s.transpose(1, 2), layout, K, weight, x.dtype)
        del act_q, act_s
        out = ops.gather_sum(y, layout, K)
        if needs_grad:
            # x is kept as the FP8 rows and scales the up-projection read (H + 4·H/128 bytes a row
            # instead of 2·H; with rows from the wire x is only a stand-in): dW13 reads their values
            ctx.save_for_backward(weight, h13, xq, xs, *layout)
        ctx.fw, ctx.ops, ctx.top_k, ctx.x_dtype = fw, ops, K, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, h13, xq, xs, *layout_t = ctx.saved_tensors
        dtype = ctx.x_dtype
        layout = PairLayout(*layout_t)
        fw, ops, K = ctx.fw, ctx.ops, ctx.top_k
        grad_out = grad_out.contiguous()
        gq, gs = ops.quantize_rows(grad_out)
        g = ops.rows(gq, gs, fw.w2, fw.w2_s, layout, K, True, dtype)  # [P, I] = grad_out[row] @ w2_sᵀ
        need_dx, need_dw13, need_dw2 = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        sb = ops.swiglu_bwd(g, h13, weight, layout, rows=need_dx, cols13=need_dw13, cols_aw=need_dw2)
        del g
        dx = dweight = dw13 = dw2 = None
        if need_dx:
            dx = ops.gather_sum(ops.rows(*sb.dh13_rows, fw.w13, fw.w13_s, layout, K, False, dtype), layout, K)
        if ctx.needs_input_grad[2]:
            pos = layout.pair_pos.long()
            dweight = torch.where(pos < layout.offsets[-1], sb.dw_pos[pos], 0.0).reshape(weight.shape)
        tiles = Q.group_tiles(layout.offsets)
        if need_dw13:
            # x's FP8 values (dequantised to x.dtype on load) are the x of xᵀ dh13, requantised along
            # the tokens: DeepSeek-V3's 1×128 → 128×1 re-tiling of a cached FP8 Linear input
            dw13 = ops.wgrad(*ops.quantize_cols(xq, layout, K, True, xs, dtype), *sb.dh13_cols, tiles, dtype)
        if need_dw2:
            dw2 = ops.wgrad(*sb.aw_cols, *ops.quantize_cols(grad_out, layout, K, True), tiles, dtype)
        return dx, None, dweight, dw13, dw2, None, None, None


def expert_ffn_fp8(
    x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    cache: Fp8WeightCache | None = None, ops: Fp8Ops | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Weighted SwiGLU experts over received rows, every GEMM in block-scaled FP8.

    Args:
        x: [R, H] float32 or bfloat16 rows. slot: int [R, K] local slot per (row, k), -1 where not
            here. weight: float32 [R, K] routing weights. w13 [S, H, 2I], w2 [S, I, H] in x.dtype;
            I a multiple of 128 (the SwiGLU epilogue quantises whole 128-column tiles).
        cache: the layer's :class:`Fp8WeightCache` (None: quantise the weights in this call).
        ops: :data:`TRITON_OPS` or :data:`REFERENCE_OPS` (None: :func:`default_ops` for x's device).
        x_fp8: the rows already quantised (FP8 rows from the wire: q float8_e4m3fn [R, H] and scale
            float32 [R, cdiv(H, 128)], row-strided views allowed, :func:`~ray_moe.kernels.fp8_quant.
            packed_views`): the up-projection reads them as its A operand (no dequantised copy) and
            x is then only the rows' stand-in (its dtype and shape; the gradient w.r.t. it is dX);
            the weight gradient reads their values (dequantised in backward).
    Returns:
        [R, H] in x.dtype, differentiable w.r.t. x, weight, w13, w2 (gradients in x.dtype through the
        same FP8 recipe; slots with no pairs get exactly zero weight gradients). Sync-free on CUDA.
    """
    if x.dim() != 2 or slot.dim() != 2 or weight.shape != slot.shape or slot.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [R, H], slot [R, K], weight [R, K]; got x {tuple(x.shape)}, "
                         f"slot {tuple(slot.shape)}, weight {tuple(weight.shape)}")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] != x.shape[1] or w13.shape[2] != 2 * w2.shape[1] \
            or w2.shape[2] != x.shape[1] or w2.shape[0] != w13.shape[0]:
        raise ValueError(f"expected w13 [S, H, 2I] and w2 [S, I, H] with H={x.shape[1]}; got {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    if w2.shape[1] % Q.TILE:
        raise ValueError(f"FP8 experts need an expert width I that is a multiple of {Q.TILE}, got {w2.shape[1]}")
    if weight.dtype != torch.float32:
        raise TypeError(f"weight must be float32, got {weight.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"x, w13, w2 must share one dtype in (float32, bfloat16); got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise RuntimeError(f"FP8 experts need FP8 tensor cores (sm_89 or newer; Hopper's are the tuned ones), "
                           f"this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}")
    ops = ops or default_ops(x.device)
    fw = cache.get(w13, w2, ops) if cache is not None else quantize_expert_weights(w13, w2, ops)
    if x_fp8 is not None and (x_fp8[0].shape != x.shape or x_fp8[0].dtype != Q.FP8_DTYPE):
        raise ValueError(f"x_fp8 must be float8_e4m3fn rows of x's shape {tuple(x.shape)}, got "
                         f"{x_fp8[0].dtype} {tuple(x_fp8[0].shape)}")
    return _ExpertFFNFp8.apply(x if x_fp8 is not None else x.contiguous(), slot.contiguous(), weight.contiguous(),
                               w13, w2, fw, ops, x_fp8)
