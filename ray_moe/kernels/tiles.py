"""What the grouped row GEMMs share: the pointer kernels of :mod:`ray_moe.kernels.grouped_swiglu`
and the Hopper descriptor kernels of :mod:`ray_moe.kernels.grouped_tma` use the same epilogue
codes, the same tile order and the same forward epilogues (inlined into each kernel by Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

EPI_PLAIN: tl.constexpr = tl.constexpr(0)  # out = acc
EPI_SCALE: tl.constexpr = tl.constexpr(1)  # out = acc * routing weight of the row's pair
EPI_SWIGLU: tl.constexpr = tl.constexpr(2)  # out = silu(gate) * up (two accumulators)

# rows past the last group (offsets[S]) that the SwiGLU backward kernel zeroes in dh13 and aw: a
# weight-gradient tile along positions starts inside a group, so it reads at most its block
# size minus one rows past offsets[S] (GemmConfig's blocks stay within it)
ZERO_TAIL = 1024


@triton.jit
def swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row tiles sweep all column tiles before the next rows (L2 reuse of
    the A rows). → (row tile, column tile) of program ``pid``."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def load_row_scale(pair, row_ok, weight_ptr, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr):
    """EPI_SCALE's per-row routing weights, float32 [BLOCK_M]: ``weight[pair]`` (``pair`` [BLOCK_M]
    int: the rows' pair indices, ``row_ok`` their mask); zeros (never read) for other epilogues.
    Called before the main loop: loaded in the epilogue, these two dependent loads stalled
    every tile's store (the scaled down-projection read 5.4-6.4 % slower than the plain one on
    an H100, in a noisy run; 0-2.3 % after the move: measured 2026-11-27)."""
    if EPILOGUE == EPI_SCALE:
        row_scale = tl.load(weight_ptr + pair, mask=row_ok, other=0.0)
    else:
        row_scale = tl.zeros([BLOCK_M], dtype=tl.float32)
    return row_scale


@triton.jit
def store_forward_epilogue(
    acc, acc_up, out_ptrs, out_mask, rm64, rn, row_scale, aux_ptr, stride_xm, half,
    EPILOGUE: tl.constexpr, SAVE_AUX: tl.constexpr,
):
    """Store a finished float32 tile ``acc`` [BLOCK_M, BLOCK_N] at ``out_ptrs`` (``out_mask``)
    after the forward epilogue.

    EPI_PLAIN: acc. EPI_SCALE: acc · row_scale per row (``row_scale`` float32 [BLOCK_M]: the
    rows' routing weights, from :func:`load_row_scale` before the main loop). EPI_SWIGLU:
    silu(acc) · acc_up (gate and up tiles of the same columns); with ``SAVE_AUX`` the two
    pre-activations go first to rows ``rm64`` (int64 [BLOCK_M]) and columns ``rn`` /
    ``half + rn`` of ``aux`` (row stride ``stride_xm``), rounded to aux's dtype, and the
    activation is computed from the rounded values so that backward recomputes exactly it.
    """
    if EPILOGUE == EPI_PLAIN:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)
    if EPILOGUE == EPI_SCALE:
        tl.store(out_ptrs, (acc * row_scale[:, None]).to(out_ptrs.dtype.element_ty), mask=out_mask)
    if EPILOGUE == EPI_SWIGLU:
        if SAVE_AUX:
            aux_ptrs = aux_ptr + rm64[:, None] * stride_xm + rn[None, :]
            tl.store(aux_ptrs, acc.to(aux_ptr.dtype.element_ty), mask=out_mask)
            tl.store(aux_ptrs + half, acc_up.to(aux_ptr.dtype.element_ty), mask=out_mask)
            acc = acc.to(aux_ptr.dtype.element_ty).to(tl.float32)
            acc_up = acc_up.to(aux_ptr.dtype.element_ty).to(tl.float32)
        act = acc * tl.sigmoid(acc) * acc_up
        tl.store(out_ptrs, act.to(out_ptrs.dtype.element_ty), mask=out_mask)
