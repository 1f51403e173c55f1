"""Hopper variants of the grouped expert GEMMs: TMA tensor descriptors for every operand that is
not gathered, and a persistent schedule whose flattened tile loop overlaps one tile's epilogue
with the next tile's loads.

Same contracts as the pointer kernels of :mod:`ray_moe.kernels.grouped_swiglu` (which launch
these when a :class:`~ray_moe.kernels.grouped_swiglu.GemmConfig` asks for ``tma``):

``_rows_tma_kernel``: out[p, n] = epilogue(sum_k A[row(p), k] * B_s[k, n]) over the positions
    p of group s. B (the weights) always comes through a 2-D descriptor over the stacked expert
    matrices ([S*rows, cols]); A through a descriptor when it is indexed by position (act, dh13)
    or through pointer loads gathered by ``sorted_pair`` (x, grad_out: Hopper's TMA has no row
    gather). A descriptor tile may run past its group (rows of the next group, or zeros past
    the tensor): those rows only reach output rows that the masked stores drop. A descriptor
    tile must never run past its expert along the contraction, so the N-major B form (gate_up,
    down) needs KD % BLOCK_K == 0; the launcher checks it.
    Schedule: ``PERSISTENT`` runs min(tiles, NUM_PROGS) programs that walk the tiles
    (total computed on the device from the group offsets, so nothing waits on the host);
    ``FLATTEN`` lets Triton's pipeliner flatten the tile and k loops into one, so the next
    tile's loads are in flight during this tile's epilogue. Without ``PERSISTENT`` the grid is
    the pointer kernel's (one program per possible tile, early exit).
    Epilogues: PLAIN, SCALE, SWIGLU (two accumulators, gate and up tiles of the same columns).

``_wgrad_tma_kernel``: dW_s[m, n] = sum_{p in group s} A[rowA(p), m] * B[rowB(p), n] with exactly
    one side gathered (pointer loads, masked to zero outside the group); the side indexed by
    position comes through a descriptor. Its rows past the group are multiplied by those zeros,
    so they must be finite: the caller guarantees that rows in [offsets[S], P) are written
    (``swiglu_backward_rows`` writes zeros there) and the descriptor gives zeros past P.

Descriptors are built on the host per call (:class:`triton.tools.tensor_descriptor.TensorDescriptor`,
passed to the kernel by value): no device allocation, no sync, CUDA-graph capturable.
Requirements (checked by :func:`tma_ok`): 16-byte aligned bases and row strides, rows of
at least 16 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ray_moe.kernels.tiles import (
    EPI_SCALE,
    EPI_SWIGLU,
    load_row_scale,
    store_forward_epilogue,
    swizzle,
)


def _descriptor_cls():
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor


def tma_available() -> bool:
    """Whether this Triton has host-side tensor descriptors (Triton >= 3.3)."""
    try:
        _descriptor_cls()
    except ImportError:
        return False
    return True


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Every tensor can back a 2-D descriptor: at least one row (a descriptor's dimensions are
    positive: a call with no rows has none), row-contiguous, 16-byte aligned base and row
    stride, and (on CUDA) a Hopper or newer GPU. The CPU interpreter emulates descriptors."""
    if not tma_available():
        return False
    for t in tensors:
        if t.dim() != 2 or t.shape[0] == 0 or t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
        if t.shape[1] * t.element_size() < 16:
            return False
        if t.is_cuda and torch.cuda.get_device_capability(t.device)[0] < 9:
            return False
    return True


def descriptor(t: torch.Tensor, block: tuple[int, int]):
    """A 2-D tensor descriptor over ``t`` ([rows, cols], row-contiguous) with tile ``block``."""
    return _descriptor_cls()(t, list(t.shape), list(t.stride()), list(block))


def num_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM on CUDA, a few under the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@triton.jit
def _group_table(starts_ptr, ends_ptr, n_groups, BLOCK_M: tl.constexpr, GROUPS_PAD: tl.constexpr):
    """Per-group starts, ends, row-tile counts and their inclusive prefix sum (read once)."""
    g = tl.arange(0, GROUPS_PAD)
    g_ok = g < n_groups
    starts = tl.load(starts_ptr + g, mask=g_ok, other=0)
    ends = tl.load(ends_ptr + g, mask=g_ok, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, axis=0)
    return g, starts, ends, tiles, cum


@triton.jit
def _group_of(tile_m, g, starts, ends, tiles, cum, BLOCK_M: tl.constexpr):
    """(group, first position of this row tile, group end) of the global row tile ``tile_m``."""
    group = tl.sum((cum <= tile_m).to(tl.int32), axis=0)
    mine = g == group
    first_tile = tl.sum(tl.where(mine, cum - tiles, 0), axis=0)
    start = tl.sum(tl.where(mine, starts, 0), axis=0)
    end = tl.sum(tl.where(mine, ends, 0), axis=0)
    return group, start + (tile_m - first_tile) * BLOCK_M, end


@triton.jit
def _rows_tile(
    tile_m, pid_n, g, starts, ends, tiles, cum,
    a_ptr, a_desc, b_desc, out_ptr, aux_ptr, weight_ptr, bias_ptr, sorted_pair_ptr,
    N, KD, half, b_group_rows, stride_am, stride_om, stride_xm, stride_bias,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, B_KMAJOR: tl.constexpr, EPILOGUE: tl.constexpr,
    SAVE_AUX: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile: main loop over the contraction, then the epilogue."""
    group, row_start, row_end = _group_of(tile_m, g, starts, ends, tiles, cum, BLOCK_M)
    rm = row_start + tl.arange(0, BLOCK_M)
    row_ok = rm < row_end
    n0 = pid_n * BLOCK_N
    rk = tl.arange(0, BLOCK_K)
    if GATHER_A:
        pair = tl.load(sorted_pair_ptr + rm, mask=row_ok, other=0)
        a_row = (pair // TOP_K).to(tl.int64)
        a_rows = a_ptr + a_row[:, None] * stride_am
    b_row0 = group * b_group_rows
    if EPILOGUE == EPI_SCALE:
        pair_e = tl.load(sorted_pair_ptr + rm, mask=row_ok, other=0)
    else:
        pair_e = rm  # not read
    row_scale = load_row_scale(pair_e, row_ok, weight_ptr, EPILOGUE, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KD, BLOCK_K):
        if GATHER_A:
            if EVEN_K:
                a = tl.load(a_rows + (k0 + rk)[None, :], mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_rows + (k0 + rk)[None, :], mask=row_ok[:, None] & ((k0 + rk) < KD)[None, :], other=0.0)
        else:
            a = a_desc.load([row_start, k0])
        if B_KMAJOR:
            b = b_desc.load([b_row0 + n0, k0])
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
        else:
            b = b_desc.load([b_row0 + k0, n0])
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if EPILOGUE == EPI_SWIGLU:
                b_up = b_desc.load([b_row0 + k0, half + n0])
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)

    rn = n0 + tl.arange(0, BLOCK_N)
    out_mask = row_ok[:, None] & (rn < N)[None, :]
    rm64 = rm.to(tl.int64)
    out_ptrs = out_ptr + rm64[:, None] * stride_om + rn[None, :]
    store_forward_epilogue(acc, acc_up, out_ptrs, out_mask, rm64, rn, row_scale, aux_ptr, stride_xm, half, EPILOGUE,
                           SAVE_AUX, bias_ptr, group, stride_bias, N, HAS_BIAS, ACT, ALPHA, LIMIT)


@triton.jit
def _rows_tma_kernel(
    a_ptr, a_desc, b_desc, out_ptr, aux_ptr, weight_ptr, bias_ptr, starts_ptr, ends_ptr, sorted_pair_ptr,
    n_groups, max_m_tiles, N, KD, half, b_group_rows,
    stride_am, stride_om, stride_xm, stride_bias,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, B_KMAJOR: tl.constexpr, EPILOGUE: tl.constexpr,
    SAVE_AUX: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUPS_PAD: tl.constexpr,
    PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0, ALPHA: tl.constexpr = 0.0, LIMIT: tl.constexpr = 0.0,
):
    """See the module docstring. B tile of group s: N-major form rows ``s*b_group_rows + k``,
    columns ``n`` (and ``half + n`` for the up half); K-major form (``B_KMAJOR``) rows
    ``s*b_group_rows + n``, columns ``k``, transposed in the dot."""
    g, starts, ends, tiles, cum = _group_table(starts_ptr, ends_ptr, n_groups, BLOCK_M, GROUPS_PAD)
    total_m = tl.sum(tiles, axis=0)
    num_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), total_m * num_n, NUM_PROGS, flatten=FLATTEN):
            tile_m, pid_n = swizzle(tile, total_m, num_n, GROUP_M)
            _rows_tile(tile_m, pid_n, g, starts, ends, tiles, cum, a_ptr, a_desc, b_desc, out_ptr, aux_ptr,
                       weight_ptr, bias_ptr, sorted_pair_ptr, N, KD, half, b_group_rows, stride_am, stride_om,
                       stride_xm, stride_bias, TOP_K, GATHER_A, B_KMAJOR, EPILOGUE, SAVE_AUX, EVEN_K, DOT_PRECISION,
                       BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS, ACT, ALPHA, LIMIT)
    else:
        tile_m, pid_n = swizzle(tl.program_id(0), max_m_tiles, num_n, GROUP_M)
        if tile_m < total_m:
            _rows_tile(tile_m, pid_n, g, starts, ends, tiles, cum, a_ptr, a_desc, b_desc, out_ptr, aux_ptr,
                       weight_ptr, bias_ptr, sorted_pair_ptr, N, KD, half, b_group_rows, stride_am, stride_om,
                       stride_xm, stride_bias, TOP_K, GATHER_A, B_KMAJOR, EPILOGUE, SAVE_AUX, EVEN_K, DOT_PRECISION,
                       BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS, ACT, ALPHA, LIMIT)


def launch_rows_tma(
    *, a: torch.Tensor, b: torch.Tensor, b_kmajor: bool, out: torch.Tensor, starts: torch.Tensor,
    ends: torch.Tensor, sorted_pair: torch.Tensor, top_k: int, gather_a: bool, epilogue: int, n_cols: int, kd: int, half: int,
    cfg, dot_precision: str, aux: torch.Tensor | None = None, weight: torch.Tensor | None = None,
    save_aux: bool = False, bias: torch.Tensor | None = None, act: tuple[int, float, float] = (0, 0.0, 0.0),
) -> None:
    """Launch :func:`_rows_tma_kernel`. ``b``: the stacked weights [S, rows, cols], contiguous,
    whose 2-D view [S*rows, cols] backs B's descriptor (``b_kmajor``: rows index n, else k).
    Group g is positions [starts[g], ends[g]) (int32), computed with b[g]. ``bias``: [S, cols]
    rows added in the epilogue; ``act``: (ACT, ALPHA, LIMIT) of ``tiles.act_params``. Caller checks
    :func:`rows_tma_ok` first."""
    n_pos = sorted_pair.numel()
    n_groups = ends.numel()
    S, rows, cols = b.shape
    b2 = b.view(S * rows, cols)
    b_block = (cfg.block_n, cfg.block_k) if b_kmajor else (cfg.block_k, cfg.block_n)
    b_desc = descriptor(b2, b_block)
    a_desc = a if gather_a else descriptor(a, (cfg.block_m, cfg.block_k))
    max_m_tiles = triton.cdiv(n_pos, cfg.block_m) + n_groups
    num_n = triton.cdiv(n_cols, cfg.block_n)
    progs = num_programs(a.device)
    grid = (min(progs, max_m_tiles * num_n) if cfg.persistent else max_m_tiles * num_n,)
    dummy = out
    _rows_tma_kernel[grid](
        a, a_desc, b_desc, out, dummy if aux is None else aux, dummy if weight is None else weight,
        dummy if bias is None else bias, starts, ends, sorted_pair, n_groups, max_m_tiles, n_cols, kd, half, rows,
        a.stride(0), out.stride(0), 0 if aux is None else aux.stride(0), 0 if bias is None else bias.stride(0),
        TOP_K=top_k, GATHER_A=gather_a, B_KMAJOR=b_kmajor, EPILOGUE=epilogue, SAVE_AUX=save_aux,
        EVEN_K=kd % cfg.block_k == 0, DOT_PRECISION=dot_precision, GROUPS_PAD=triton.next_power_of_2(n_groups),
        PERSISTENT=cfg.persistent, FLATTEN=cfg.persistent and cfg.flatten, NUM_PROGS=progs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        HAS_BIAS=bias is not None, ACT=act[0], ALPHA=act[1], LIMIT=act[2],
    )


def rows_tma_ok(a: torch.Tensor, b: torch.Tensor, b_kmajor: bool, gather_a: bool, kd: int, cfg) -> bool:
    """Whether :func:`launch_rows_tma` can run this GEMM: descriptors possible for B's 2-D view
    (and A when not gathered), and (N-major B) no contraction tile crossing an expert."""
    S, rows, cols = b.shape
    if not b.is_contiguous() or S * rows == 0:
        return False
    if not b_kmajor and kd % cfg.block_k:
        return False
    return tma_ok(b.view(S * rows, cols), *(() if gather_a else (a,)))


@triton.jit
def _wgrad_tma_kernel(
    a_ptr, a_desc, b_ptr, b_desc, out_ptr, offsets_ptr, sorted_pair_ptr, M, N, half,
    stride_am, stride_bm, stride_og, stride_om,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, DUAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[s, m, n] = sum_{p in group s} A[rowA(p), m] * B[rowB(p), n]; GATHER_A: A gathered
    (pointers) and B by position (descriptor, tile [BLOCK_K, BLOCK_N]); else A by position
    (descriptor, tile [BLOCK_K, BLOCK_M], transposed) and B gathered. DUAL (GATHER_A only): also
    the columns ``half + n`` of B into a second accumulator sharing the A tile."""
    group = tl.program_id(1)
    pid_m, pid_n = swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    start = tl.load(offsets_ptr + group)
    end = tl.load(offsets_ptr + group + 1)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for p0 in range(start, end, BLOCK_K):
        rp = p0 + tl.arange(0, BLOCK_K)
        p_ok = rp < end
        row = (tl.load(sorted_pair_ptr + rp, mask=p_ok, other=0) // TOP_K).to(tl.int64)
        if GATHER_A:
            a = tl.load(a_ptr + row[None, :] * stride_am + rm[:, None], mask=m_ok[:, None] & p_ok[None, :], other=0.0)
            b = b_desc.load([p0, n0])
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if DUAL:
                b_up = b_desc.load([p0, half + n0])
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        else:
            a = a_desc.load([p0, m0])
            b = tl.load(b_ptr + row[:, None] * stride_bm + rn[None, :], mask=p_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a.T, b, acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + group.to(tl.int64) * stride_og + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    if DUAL:
        tl.store(out_ptrs + half, acc_up.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def launch_wgrad_tma(
    *, a_src: torch.Tensor, b_src: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor,
    sorted_pair: torch.Tensor, top_k: int, gather_a: bool, dual: bool, n_cols: int, cfg, dot_precision: str,
) -> None:
    """Launch :func:`_wgrad_tma_kernel` (one side gathered, the other through a descriptor whose
    rows must all be finite). Caller checks :func:`tma_ok` on the position-indexed side."""
    S = offsets.numel() - 1
    M = a_src.shape[1]
    if gather_a:
        a_desc, b_desc = a_src, descriptor(b_src, (cfg.block_k, cfg.block_n))
    else:
        a_desc, b_desc = descriptor(a_src, (cfg.block_k, cfg.block_m)), b_src
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(n_cols, cfg.block_n), S)
    _wgrad_tma_kernel[grid](
        a_src, a_desc, b_src, b_desc, out, offsets, sorted_pair, M, n_cols, n_cols,
        a_src.stride(0), b_src.stride(0), out.stride(0), out.stride(1),
        TOP_K=top_k, GATHER_A=gather_a, DUAL=dual, DOT_PRECISION=dot_precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
