"""Per-group column sums over the pair layout: the expert biases' gradients.

``group_sum``: out[s, n] = Σ_{p in group s} scale(p) · src[row(p), n], with ``row(p)`` the
position itself (db13 = the per-slot sum of dh13's rows) or the pair's input row (db2 = the
per-slot sum of the grad_out rows scaled by the routing weight). One program per (column tile,
group) runs over its group's positions in order, float32 accumulation: deterministic (no
atomics), sync-free (the group bounds are read on the device; the grid depends on shapes only),
and an expert with no pairs gets exactly zero. Its pure-torch reference is the tests'
(tests/references.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ray_moe.kernels.routing import PairLayout


@triton.jit
def _group_sum_kernel(
    src_ptr, scale_ptr, offsets_ptr, sorted_pair_ptr, out_ptr, N, stride_src, stride_out,
    TOP_K: tl.constexpr, GATHER: tl.constexpr, SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    group = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    start = tl.load(offsets_ptr + group)
    end = tl.load(offsets_ptr + group + 1)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for p0 in range(start, end, BLOCK_R):
        rp = p0 + tl.arange(0, BLOCK_R)
        ok = rp < end
        if GATHER or SCALE:
            pair = tl.load(sorted_pair_ptr + rp, mask=ok, other=0)
        if GATHER:
            row = (pair // TOP_K).to(tl.int64)
        else:
            row = rp.to(tl.int64)
        v = tl.load(src_ptr + row[:, None] * stride_src + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        if SCALE:
            v *= tl.load(scale_ptr + pair, mask=ok, other=0.0)[:, None]
        acc += v
    tl.store(out_ptr + group.to(tl.int64) * stride_out + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=col_ok)


def group_sum(
    src: torch.Tensor, layout: PairLayout, top_k: int, gather: bool, scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-slot sums of rows, out[s] = Σ_{p in group s} scale[pair(p)] · src[row(p)].

    Args:
        src: [P = R*K, N] by position (``gather=False``) or [R, N] token rows gathered through each
            pair's row (``gather=True``); float32 / bfloat16 / float16, row-contiguous.
        layout: the pair layout of slot [R, top_k]; scale: optional float32 [R, K] (routing weights).
    Returns:
        [S, N] in src.dtype (float32 accumulation); exactly zero for slots with no pairs.
        Positions past offsets[S] are never read.
    """
    if src.dim() != 2 or src.stride(1) != 1:
        raise ValueError(f"src must be a row-contiguous matrix, got shape {tuple(src.shape)} strides {src.stride()}")
    if scale is not None and (scale.dtype != torch.float32 or scale.numel() != layout.sorted_pair.numel()):
        raise ValueError(f"scale must be float32 with {layout.sorted_pair.numel()} entries, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    S, N = layout.offsets.numel() - 1, src.shape[1]
    out = torch.empty(S, N, dtype=src.dtype, device=src.device)
    if S == 0 or N == 0:
        return out
    block_n = min(128, triton.next_power_of_2(N))
    block_r = max(1, 4096 // block_n) if src.is_cuda else 16
    _group_sum_kernel[(triton.cdiv(N, block_n), S)](
        src, src if scale is None else scale.contiguous(), layout.offsets, layout.sorted_pair, out, N,
        src.stride(0), out.stride(0),
        TOP_K=top_k, GATHER=gather, SCALE=scale is not None, BLOCK_R=block_r, BLOCK_N=block_n,
    )
    return out
