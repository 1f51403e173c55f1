"""What the grouped row GEMMs share: the pointer kernels of :mod:`ray_moe.kernels.grouped_swiglu`
and the Hopper descriptor kernels of :mod:`ray_moe.kernels.grouped_tma` use the same epilogue
codes, the same tile order, the same forward and SwiGLU-backward epilogues and the same zero
tail past the last group (inlined into each kernel by Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

EPI_PLAIN: tl.constexpr = tl.constexpr(0)  # out = acc
EPI_SCALE: tl.constexpr = tl.constexpr(1)  # out = acc * routing weight of the row's pair
EPI_SWIGLU: tl.constexpr = tl.constexpr(2)  # out = silu(gate) * up (two accumulators)
EPI_SWIGLU_BWD: tl.constexpr = tl.constexpr(3)  # dSwiGLU: store_swiglu_bwd_epilogue

# rows past the last group (offsets[S]) that the SwiGLU backward zeroes in dh13 and aw: a
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
    """EPI_SCALE's and EPI_SWIGLU_BWD's per-row routing weights, float32 [BLOCK_M]: ``weight[pair]`` (``pair`` [BLOCK_M]
    int: the rows' pair indices, ``row_ok`` their mask); zeros (never read) for other epilogues.
    Called before the main loop: loaded in the epilogue, these two dependent loads stalled
    every tile's store (the scaled down-projection read 5.4-6.4 % slower than the plain one on
    an H100, in a noisy run; 0-2.3 % after the move: docs/BENCHMARKS.md, session 26)."""
    if EPILOGUE == EPI_SCALE or EPILOGUE == EPI_SWIGLU_BWD:
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


@triton.jit
def _halves(t, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Columns [0, WIDTH/2) and [WIDTH/2, WIDTH) of ``t`` [BLOCK_M, WIDTH] as two tensors (the
    split dimension is the column index's top bit, held in each thread's own registers in the
    MMA accumulator layout, so no data moves)."""
    return tl.split(tl.permute(tl.reshape(t, [BLOCK_M, 2, WIDTH // 2]), (0, 2, 1)))


@triton.jit
def _swiglu_bwd_chunk(g, rm64, row_ok, cn, N, row_w, out_ptr, stride_om, out2_ptr, stride_o2m, aux_ptr, stride_xm,
                      half):
    """The SwiGLU backward of G's columns ``cn`` (int [C]) for rows ``rm64`` (int64 [BLOCK_M]):
    ``g`` float32 [BLOCK_M, C]. Stores d(gate) | d(up) and weight · a; returns sum_c a · g per row."""
    mask = row_ok[:, None] & (cn < N)[None, :]
    h_ptrs = aux_ptr + rm64[:, None] * stride_xm + cn[None, :]
    gate = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    act = silu * up
    d_act = g * row_w[:, None]
    out_ptrs = out_ptr + rm64[:, None] * stride_om + cn[None, :]
    tl.store(out_ptrs, (d_act * up * sig * (1.0 + gate * (1.0 - sig))).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + half, (d_act * silu).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out2_ptr + rm64[:, None] * stride_o2m + cn[None, :], (act * row_w[:, None]).to(out2_ptr.dtype.element_ty),
             mask=mask)
    return tl.sum(act * g, axis=1)


@triton.jit
def _swiglu_bwd_slices(t, c0, rm64, row_ok, N, row_w, out_ptr, stride_om, out2_ptr, stride_o2m, aux_ptr, stride_xm, half,
                       CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """:func:`_swiglu_bwd_chunk` over ``t`` [BLOCK_M, WIDTH] (columns ``c0 + [0, WIDTH)``) cut in
    CHUNKS equal slices by halving (recursion on the constexpr CHUNKS)."""
    if CHUNKS == 1:
        dw = _swiglu_bwd_chunk(t, rm64, row_ok, c0 + tl.arange(0, WIDTH), N, row_w, out_ptr, stride_om, out2_ptr,
                               stride_o2m, aux_ptr, stride_xm, half)
    else:
        left, right = _halves(t, BLOCK_M, WIDTH)
        dw = _swiglu_bwd_slices(left, c0, rm64, row_ok, N, row_w, out_ptr, stride_om, out2_ptr, stride_o2m, aux_ptr,
                                stride_xm, half, CHUNKS // 2, BLOCK_M, WIDTH // 2)
        dw += _swiglu_bwd_slices(right, c0 + WIDTH // 2, rm64, row_ok, N, row_w, out_ptr, stride_om, out2_ptr,
                                 stride_o2m, aux_ptr, stride_xm, half, CHUNKS // 2, BLOCK_M, WIDTH // 2)
    return dw


@triton.jit
def store_swiglu_bwd_epilogue(
    acc, rm64, row_ok, n0, N, row_w, out_ptr, stride_om, out2_ptr, stride_o2m, aux_ptr, stride_xm, half,
    dw_ptr, pid_n, n_pos,
    CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """EPI_SWIGLU_BWD on a finished float32 tile ``acc`` [BLOCK_M, BLOCK_N] = G's rows ``rm64``
    (int64 [BLOCK_M], ``row_ok`` their mask), columns ``n0 + [0, BLOCK_N)`` (< N valid).

    Reads g | u from ``aux`` (h13 [P, 2I], row stride ``stride_xm``, up at column ``half`` = I),
    stores ``out`` = dh13 [P, 2I] = weight · (dG · u · silu'(g) | dG · silu(g)) and ``out2`` =
    aw [P, I] = weight · a (their dtypes), ``row_w`` float32 [BLOCK_M] the rows' routing weights
    (:func:`load_row_scale`), and ``dw[pid_n, p]`` (float32 [num column tiles, n_pos]) =
    sum over this tile's columns of a · G. ``CHUNKS`` (1, 2, 4 or 8): the tile is processed in that
    many column slices, so that g and u of one slice, not of the whole tile, are live beside
    the accumulator (128×256 fp32 is already 128 registers a thread at 8 warps).
    """
    dw = _swiglu_bwd_slices(acc, n0, rm64, row_ok, N, row_w, out_ptr, stride_om, out2_ptr, stride_o2m, aux_ptr,
                            stride_xm, half, CHUNKS, BLOCK_M, BLOCK_N)
    tl.store(dw_ptr + pid_n.to(tl.int64) * n_pos + rm64, dw, mask=row_ok)


@triton.jit
def store_zero_tail(
    t, num_n, n_valid, n_pos, N, out_ptr, stride_om, out2_ptr, stride_o2m, half,
    ZERO_TAIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Tail tile ``t`` of cdiv(min(ZERO_TAIL, n_pos), BLOCK_M) · num_n: zeros in rows [n_valid, n_valid +
    ZERO_TAIL) ∩ [0, n_pos) of dh13 (``out``, both halves) and aw (``out2``), so that a
    weight-gradient descriptor tile reading past the last group multiplies finite values."""
    rm = n_valid + (t // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (t % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = ((rm < n_pos) & (rm < n_valid + ZERO_TAIL))[:, None] & (rn < N)[None, :]
    rm64 = rm.to(tl.int64)
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rm64[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, zero, mask=mask)
    tl.store(out_ptrs + half, zero, mask=mask)
    tl.store(out2_ptr + rm64[:, None] * stride_o2m + rn[None, :], zero.to(out2_ptr.dtype.element_ty), mask=mask)
