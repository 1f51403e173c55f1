"""What the grouped row GEMMs share: the pointer kernels of :mod:`ray_moe.kernels.grouped_swiglu`
and the Hopper descriptor kernels of :mod:`ray_moe.kernels.grouped_tma` use the same epilogue
codes, the same tile order and the same forward epilogues (inlined into each kernel by Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

EPI_PLAIN: tl.constexpr = tl.constexpr(0)  # out = acc
EPI_SCALE: tl.constexpr = tl.constexpr(1)  # out = acc * routing weight of the row's pair
EPI_SWIGLU: tl.constexpr = tl.constexpr(2)  # out = act(gate, up) (two accumulators)

# the gated activation of EPI_SWIGLU and of the SwiGLU backward (constexpr ACT)
ACT_SWIGLU: tl.constexpr = tl.constexpr(0)  # silu(gate) · up
ACT_CLAMPED: tl.constexpr = tl.constexpr(1)  # gpt-oss: gate clamped above at LIMIT, up to ±LIMIT, then (up + 1) · gate · σ(ALPHA · gate)


def act_params(act) -> tuple[int, float, float]:
    """(ACT, ALPHA, LIMIT) constexprs of an activation: None or an object with ``kind``
    (swiglu | clamped_swiglu), ``alpha`` and ``limit`` (``ray_moe.model.experts.ExpertActivation``).
    Plain SwiGLU always gives (ACT_SWIGLU, 0.0, 0.0): one specialisation whatever its unused fields."""
    if act is None or act.kind == "swiglu":
        return ACT_SWIGLU.value, 0.0, 0.0
    if act.kind == "clamped_swiglu":
        return ACT_CLAMPED.value, float(act.alpha), float(act.limit)
    raise ValueError(f"activation {act.kind!r} is not one of swiglu, clamped_swiglu")

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
def gated_act(gate, up, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """The gated activation of float32 gate / up tiles (ACT_SWIGLU or ACT_CLAMPED)."""
    if ACT == ACT_CLAMPED:
        g = tl.minimum(gate, LIMIT)
        u = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        out = (u + 1.0) * (g * tl.sigmoid(ALPHA * g))
    else:
        out = gate * tl.sigmoid(gate) * up
    return out


@triton.jit
def store_forward_epilogue(
    acc, acc_up, out_ptrs, out_mask, rm64, rn, row_scale, aux_ptr, stride_xm, half,
    EPILOGUE: tl.constexpr, SAVE_AUX: tl.constexpr,
    bias_ptr, group, stride_bias, n_cols, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):
    """Store a finished float32 tile ``acc`` [BLOCK_M, BLOCK_N] at ``out_ptrs`` (``out_mask``)
    after the forward epilogue.

    EPI_PLAIN: acc. EPI_SCALE: acc · row_scale per row (``row_scale`` float32 [BLOCK_M]: the
    rows' routing weights, from :func:`load_row_scale` before the main loop). EPI_SWIGLU:
    act(acc, acc_up) (gate and up tiles of the same columns; :func:`gated_act`); with
    ``SAVE_AUX`` the two pre-activations go first to rows ``rm64`` (int64 [BLOCK_M]) and columns
    ``rn`` / ``half + rn`` of ``aux`` (row stride ``stride_xm``), rounded to aux's dtype, and the
    activation is computed from the rounded values so that backward recomputes exactly it.
    HAS_BIAS: the group's bias row ``bias[group]`` (row stride ``stride_bias``, columns below
    ``n_cols``) is added to the
    accumulator first: columns ``rn`` (SCALE, before the routing weight) or ``rn`` / ``half + rn``
    (SWIGLU's gate / up, before the saved pre-activations).
    """
    if HAS_BIAS:
        col_ok = rn < n_cols
        bias_row = bias_ptr + group.to(tl.int64) * stride_bias + rn
        acc += tl.load(bias_row, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE == EPI_SWIGLU:
            acc_up += tl.load(bias_row + half, mask=col_ok, other=0.0).to(tl.float32)[None, :]
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
        act = gated_act(acc, acc_up, ACT, ALPHA, LIMIT)
        tl.store(out_ptrs, act.to(out_ptrs.dtype.element_ty), mask=out_mask)
