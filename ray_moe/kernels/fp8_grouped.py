"""Block-scaled FP8 grouped GEMMs of the SwiGLU experts (DeepSeek-V3's recipe, Hopper).

Operands are E4M3 with float32 scales (:mod:`ray_moe.kernels.fp8_quant`): activations and
gradients in 1×128 tiles, weights in 128×128 blocks. Both operands of every ``tl.dot`` are
K-major (Hopper's FP8 tensor cores read only that form), so the weights come as the FP8 copy
whose rows are the output columns: ``bt [S, N, KD]`` (the weight cache keeps both orientations,
:mod:`ray_moe.kernels.fp8_expert_ffn`).

Promotion: the contraction runs in chunks of 128 (one scale tile); each chunk's dot starts from
zero and its float32 result is multiplied by ``a_scale[row, chunk] * b_scale[col block, chunk]``
and added into the float32 accumulator, so the tensor cores' limited-precision accumulation
spans at most 128 products (DeepSeek-V3 §3.3.2)::

    acc[p, n] = Σ_kb ( Σ_{k in kb} a_q[row(p), k] b_q[n, k] ) · a_s[row(p), kb] · b_s[n // 128, kb]

The row GEMMs promote in one of three forms (``Fp8GemmConfig.promote``): ``outer`` multiplies
each chunk's result by the outer product of the two scale vectors (any column tile); ``row``
(column tiles within one 128-column weight block, where B's scale is one number per tile and
chunk) by the per-row product ``a_s · b_s``, one FMA an element and the same float32 values as
``outer``; ``acc`` keeps the accumulator in units of the current chunk's row scale ``S_kb`` and
lets each dot accumulate into it in place, ``acc ← dot(a, b, acc · S_kb-1 / S_kb)``, times
``S_last`` at the end: no second [BLOCK_M, BLOCK_N] float32 tile of registers per dot (so
128-row SwiGLU tiles and 256-column tiles fit), one rounding of the ratio per chunk more than
the other forms (float32 round-off), and finite only while a row's partial sum stays below
2^128 times its current chunk's scale (always, for scales within 10^30 of each other along a row).
Within one program the scaling never runs beside the tensor cores: Triton 3.9 waits for each
wgmma right after issuing it (``warp_group_dot_wait`` with 0 pending) whenever its result feeds
anything but the next dot, also when a loop step issues two chunks' dots before promoting either
or promotes the previous step's product (checked in the sm_90 TTGIR, 2026-12-07); only several
programs per SM overlap one's promotion with another's dot (the one-warpgroup candidates).

Kernels (grouped by slot over a :class:`~ray_moe.kernels.routing.PairLayout`, the same
ragged-tile schedule as the bf16 pointer kernels: the grid is fixed by shapes, each program
finds its group from the device-side offsets, nothing waits on the host):

``_fp8_rows_kernel``: out[p] = epilogue(acc[p]) for the positions p of each group, A rows gathered
    through ``sorted_pair // K`` (x, grad_out) or taken by position (act, dh13). Epilogues:
    PLAIN (bf16 out: G of the SwiGLU backward, dX rows), SCALE (× routing weight: the
    down-projection), SWIGLU (gate and up accumulators; g|u saved rounded to the activations'
    dtype, act = silu(g)·u computed from the rounded values and written as the down-projection's
    FP8 input with its 1×128 scales: the tile is 128 columns wide, so its row amax is the tile's;
    or, ``one_dot``, gate and up as one [BLOCK_M, 256] accumulator of one dot per chunk).
    Schedule: one program per possible tile (the grid fixed by shapes, past the last tile a
    program returns), or ``persistent``: p programs per SM walking the tiles.
``_fp8_wgrad_kernel``: dW[s, m, n] = Σ_{p in group s} A[p, m] B[p, n] from the transposed,
    position-tiled operands of :func:`~ray_moe.kernels.fp8_quant.quantize_cols` (``at [M, ·]``,
    ``bt [N, ·]``, each group in its own zero-padded 128-position tiles: the chunks are the tiles
    the scales belong to, and nothing is masked). Empty groups store 0.

Tiles (:class:`Fp8GemmConfig`) per GEMM role (:data:`FP8_ROLES`): :func:`fp8_config` reads the
measured table :data:`FP8_TILES` (what ``bench layer --sections fp8 --fp8-sweep`` prints) and
falls back to the role's default; every launcher also takes an explicit ``cfg``, and
:func:`fp8_candidates` lists what the sweep times.

Each launcher has a float32 reference computing the same quantised math (dequantise, then a
float32 matmul); outputs are in ``out_dtype`` (bf16 on the GPU path, the activations' dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from ray_moe.kernels.fp8_quant import (
    FP8_DTYPE,
    TILE,
    dequantize_blocks,
    dequantize_rows,
    interpreting,
    quantize_rows_reference,
    tile_scale,
    to_e4m3,
)
from ray_moe.kernels.grouped_tma import _group_of, _group_table
from ray_moe.kernels.routing import PairLayout
from ray_moe.kernels.tiles import EPI_PLAIN, EPI_SCALE, EPI_SWIGLU, swizzle


@triton.jit
def _load_a_chunk(a_ptr, a_desc, a_row, row_ok, row_start, kb, KD, stride_am, A_DESC: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """A's [BLOCK_M, 128] FP8 chunk ``kb``: through the descriptor (A by position) or gathered rows."""
    if A_DESC:
        a = a_desc.load([row_start, kb * 128])
    else:
        k = kb * 128 + tl.arange(0, 128)
        a = tl.load(a_ptr + a_row[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & (k < KD)[None, :],
                    other=0.0)
    return a


PROMOTE_OUTER: tl.constexpr = tl.constexpr(0)
PROMOTE_ROW: tl.constexpr = tl.constexpr(1)
PROMOTE_ACC: tl.constexpr = tl.constexpr(2)
PROMOTIONS = ("outer", "row", "acc")  # Fp8GemmConfig.promote → the constexpr's value (its index)


@triton.jit
def _chunk_scale(sa, bs_ptrs, bs_ptr0, col_ok, kb, stride_bsk, PROMOTE: tl.constexpr):
    """The factor of chunk ``kb``'s dot in the row or outer form: ``(a_s · b_s)[:, None]`` with B's
    one scale of the tile at ``bs_ptr0`` (row), or ``a_s[:, None] · b_s[None, :]`` per column from
    ``bs_ptrs`` (outer). ``sa`` [BLOCK_M]: A's scales of the chunk."""
    if PROMOTE == PROMOTE_OUTER:
        sb = tl.load(bs_ptrs + kb * stride_bsk, mask=col_ok, other=0.0)
        f = sa[:, None] * sb[None, :]
    else:
        f = (sa * tl.load(bs_ptr0 + kb * stride_bsk))[:, None]
    return f


@triton.jit
def _promote_acc(acc, s_prev, a, b, sa, bs_ptr0, kb, stride_bsk):
    """Chunk ``kb`` in the acc form: ``acc`` is in units of ``s_prev`` (per row); rescaled to this
    chunk's ``s = a_s · b_s`` and the dot accumulated into it in place. Returns (acc, s)."""
    s = sa * tl.load(bs_ptr0 + kb * stride_bsk)
    acc = tl.dot(a, tl.trans(b), acc * tl.div_rn(s_prev, s)[:, None], out_dtype=tl.float32)
    return acc, s


@triton.jit
def _load_b_chunk(b_ptr, b_desc, g64, b_row0, col0, n0, rn, col_ok, kb, KD, stride_bg, stride_bn,
                  B_DESC: tl.constexpr):
    """B's [BLOCK_N, 128] FP8 chunk ``kb`` of the columns ``col0 + rn`` (``rn`` = n0 + arange):
    ``col0`` = 0, or ``half`` for the up half. Chunks past KD read zeros (masks; a descriptor's
    out-of-bounds box)."""
    if B_DESC:
        b = b_desc.load([b_row0 + col0 + n0, kb * 128])
    else:
        k = kb * 128 + tl.arange(0, 128)
        b = tl.load(b_ptr + g64 * stride_bg + (col0 + rn)[:, None].to(tl.int64) * stride_bn + k[None, :],
                    mask=col_ok[:, None] & (k < KD)[None, :], other=0.0)
    return b


@triton.jit
def _fp8_rows_tile(
    tile_m, pid_n, g, starts, ends, tiles, cum,
    a_ptr, a_desc, as_ptr, b_ptr, b_desc, bs_ptr, out_ptr, out_s_ptr, aux_ptr, weight_ptr, sorted_pair_ptr,
    N, KD, half, b_group_rows,
    stride_am, stride_asm, stride_bg, stride_bn, stride_bsg, stride_bsn, stride_bsk, stride_om, stride_osm, stride_xm,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, EPILOGUE: tl.constexpr, SAVE_AUX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, A_DESC: tl.constexpr, B_DESC: tl.constexpr,
    ONE_DOT: tl.constexpr, PROMOTE: tl.constexpr, EXACT_CAST: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile of row tile ``tile_m`` (its group from the table of
    :func:`~ray_moe.kernels.grouped_tma._group_table`) and column tile ``pid_n``."""
    group, row_start, row_end = _group_of(tile_m, g, starts, ends, tiles, cum, BLOCK_M)
    rm = row_start + tl.arange(0, BLOCK_M)
    row_ok = rm < row_end
    n0 = pid_n * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    col_ok = rn < N
    rk = tl.arange(0, 128)
    if GATHER_A or EPILOGUE == EPI_SCALE:
        pair = tl.load(sorted_pair_ptr + rm, mask=row_ok, other=0)
    else:
        pair = rm  # not read
    if GATHER_A:
        a_row = (pair // TOP_K).to(tl.int64)
    else:
        a_row = rm.to(tl.int64)
    if EPILOGUE == EPI_SCALE:
        row_w = tl.load(weight_ptr + pair, mask=row_ok, other=0.0)
    g64 = group.to(tl.int64)
    as_ptrs = as_ptr + a_row * stride_asm
    b_row0 = group * b_group_rows
    if ONE_DOT:
        # gate rows n0.. and up rows half + n0.. of bt as one [2·BLOCK_N, 128] operand: one
        # [BLOCK_M, 2·BLOCK_N] dot per chunk (the bf16 up-projection's winning form, 2026-11-26)
        c2 = tl.arange(0, 2 * BLOCK_N)
        n2 = n0 + c2 % BLOCK_N
        b2_row = tl.where(c2 < BLOCK_N, n2, half + n2)
        b2_ok = n2 < N
        b2_ptrs = b_ptr + g64 * stride_bg + b2_row[:, None].to(tl.int64) * stride_bn + rk[None, :]
        bs2_ptrs = bs_ptr + g64 * stride_bsg + (b2_row // 128) * stride_bsn
        acc2 = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(KD, 128)):
            a = _load_a_chunk(a_ptr, a_desc, a_row, row_ok, row_start, kb, KD, stride_am, A_DESC, BLOCK_M)
            b2 = tl.load(b2_ptrs + kb * 128, mask=b2_ok[:, None] & ((kb * 128 + rk) < KD)[None, :], other=0.0)
            sa = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
            sb2 = tl.load(bs2_ptrs + kb * stride_bsk, mask=b2_ok, other=0.0)
            acc2 += tl.dot(a, tl.trans(b2), out_dtype=tl.float32) * (sa[:, None] * sb2[None, :])
        acc, acc_up = tl.split(tl.permute(tl.reshape(acc2, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
    else:
        bs_ptrs = bs_ptr + g64 * stride_bsg + (rn // 128) * stride_bsn
        bs_up_ptrs = bs_ptr + g64 * stride_bsg + ((half + rn) // 128) * stride_bsn
        # (row, acc) the tile's one weight block: BLOCK_N divides 128 and half is a multiple of it
        bs_ptr0 = bs_ptr + g64 * stride_bsg + (n0 // 128) * stride_bsn
        bs_up_ptr0 = bs_ptr + g64 * stride_bsg + ((half + n0) // 128) * stride_bsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # rows past the group get A scale 1 (their dots are 0, or finite rows of the next group
        # through A's descriptor; never stored): the acc form divides by the scales
        s_prev = tl.load(as_ptrs, mask=row_ok, other=1.0)
        s_prev_up = s_prev * tl.load(bs_up_ptr0)
        s_prev = s_prev * tl.load(bs_ptr0)
        for kb in range(0, tl.cdiv(KD, 128)):
            a = _load_a_chunk(a_ptr, a_desc, a_row, row_ok, row_start, kb, KD, stride_am, A_DESC, BLOCK_M)
            b = _load_b_chunk(b_ptr, b_desc, g64, b_row0, 0, n0, rn, col_ok, kb, KD, stride_bg, stride_bn, B_DESC)
            if EPILOGUE == EPI_SWIGLU:
                b_up = _load_b_chunk(b_ptr, b_desc, g64, b_row0, half, n0, rn, col_ok, kb, KD, stride_bg, stride_bn,
                                     B_DESC)
            sa = tl.load(as_ptrs + kb, mask=row_ok, other=1.0)
            if PROMOTE == PROMOTE_ACC:
                acc, s_prev = _promote_acc(acc, s_prev, a, b, sa, bs_ptr0, kb, stride_bsk)
                if EPILOGUE == EPI_SWIGLU:
                    acc_up, s_prev_up = _promote_acc(acc_up, s_prev_up, a, b_up, sa, bs_up_ptr0, kb, stride_bsk)
            else:
                acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * _chunk_scale(sa, bs_ptrs, bs_ptr0, col_ok, kb,
                                                                                   stride_bsk, PROMOTE)
                if EPILOGUE == EPI_SWIGLU:
                    acc_up += tl.dot(a, tl.trans(b_up), out_dtype=tl.float32) * _chunk_scale(
                        sa, bs_up_ptrs, bs_up_ptr0, col_ok, kb, stride_bsk, PROMOTE)
        if PROMOTE == PROMOTE_ACC:
            acc = acc * s_prev[:, None]
            acc_up = acc_up * s_prev_up[:, None]

    rm64 = rm.to(tl.int64)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if EPILOGUE == EPI_PLAIN:
        tl.store(out_ptr + rm64[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    if EPILOGUE == EPI_SCALE:
        tl.store(out_ptr + rm64[:, None] * stride_om + rn[None, :], (acc * row_w[:, None]).to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    if EPILOGUE == EPI_SWIGLU:
        gate = acc.to(aux_ptr.dtype.element_ty)
        up = acc_up.to(aux_ptr.dtype.element_ty)
        if SAVE_AUX:
            aux_ptrs = aux_ptr + rm64[:, None] * stride_xm + rn[None, :]
            tl.store(aux_ptrs, gate, mask=out_mask)
            tl.store(aux_ptrs + half, up, mask=out_mask)
        gate = gate.to(tl.float32)
        act = gate * tl.sigmoid(gate) * up.to(tl.float32)  # [BLOCK_M, 128]: one scale tile per row
        scale = tile_scale(tl.max(tl.abs(act), axis=1))
        tl.store(out_ptr + rm64[:, None] * stride_om + rn[None, :], to_e4m3(act, scale[:, None], EXACT_CAST),
                 mask=out_mask)
        tl.store(out_s_ptr + rm64 * stride_osm + pid_n, scale, mask=row_ok)


@triton.jit
def _fp8_rows_kernel(
    a_ptr, a_desc, as_ptr, b_ptr, b_desc, bs_ptr, out_ptr, out_s_ptr, aux_ptr, weight_ptr, starts_ptr, ends_ptr,
    sorted_pair_ptr, n_groups, max_m_tiles, num_progs, N, KD, half, b_group_rows,
    stride_am, stride_asm, stride_bg, stride_bn, stride_bsg, stride_bsn, stride_bsk, stride_om, stride_osm, stride_xm,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, EPILOGUE: tl.constexpr, SAVE_AUX: tl.constexpr,
    GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    A_DESC: tl.constexpr, B_DESC: tl.constexpr, ONE_DOT: tl.constexpr, PROMOTE: tl.constexpr,
    PERSISTENT: tl.constexpr, EXACT_CAST: tl.constexpr,
):
    """See the module docstring. B tile of group s, columns n: rows ``s, n`` of ``bt`` (and
    ``half + n`` for the up half); its scales ``bs[s, n // 128, kb]`` through the given strides.
    ``B_DESC``: B through a TMA descriptor over ``bt`` viewed [S * b_group_rows, KD] (a tile past
    the group's last column reads the next group's rows: finite, and its columns are not stored);
    ``A_DESC`` (A by position): A through a descriptor over [P, KD] (rows past the group reach only
    output rows the masked stores drop). ``ONE_DOT`` (SWIGLU): gate and up as one operand
    (pointer loads). ``PERSISTENT``: ``num_progs`` programs walk the tiles (the total from the
    device-side offsets); else one program per possible tile, past the last one returning."""
    g, starts, ends, tiles, cum = _group_table(starts_ptr, ends_ptr, n_groups, BLOCK_M, GROUPS_PAD)
    total_m = tl.sum(tiles, axis=0)
    num_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), total_m * num_n, num_progs):
            tile_m, pid_n = swizzle(tile, total_m, num_n, GROUP_M)
            _fp8_rows_tile(tile_m, pid_n, g, starts, ends, tiles, cum, a_ptr, a_desc, as_ptr, b_ptr, b_desc, bs_ptr,
                           out_ptr, out_s_ptr, aux_ptr, weight_ptr, sorted_pair_ptr, N, KD, half, b_group_rows,
                           stride_am, stride_asm, stride_bg, stride_bn, stride_bsg, stride_bsn, stride_bsk, stride_om,
                           stride_osm, stride_xm, TOP_K, GATHER_A, EPILOGUE, SAVE_AUX, BLOCK_M, BLOCK_N, A_DESC,
                           B_DESC, ONE_DOT, PROMOTE, EXACT_CAST)
    else:
        tile_m, pid_n = swizzle(tl.program_id(0), max_m_tiles, num_n, GROUP_M)
        if tile_m < total_m:
            _fp8_rows_tile(tile_m, pid_n, g, starts, ends, tiles, cum, a_ptr, a_desc, as_ptr, b_ptr, b_desc, bs_ptr,
                           out_ptr, out_s_ptr, aux_ptr, weight_ptr, sorted_pair_ptr, N, KD, half, b_group_rows,
                           stride_am, stride_asm, stride_bg, stride_bn, stride_bsg, stride_bsn, stride_bsk, stride_om,
                           stride_osm, stride_xm, TOP_K, GATHER_A, EPILOGUE, SAVE_AUX, BLOCK_M, BLOCK_N, A_DESC,
                           B_DESC, ONE_DOT, PROMOTE, EXACT_CAST)


@triton.jit
def _fp8_wgrad_kernel(
    at_ptr, at_desc, ats_ptr, bt_ptr, bt_desc, bts_ptr, out_ptr, tiles_ptr, M, N,
    stride_at, stride_ats, stride_bt, stride_bts, stride_og, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, DESC: tl.constexpr,
):
    """See the module docstring: one program per (group, m tile, n tile), over the group's own
    128-position tiles ``[tiles[s], tiles[s + 1])`` (zero-padded at the group's end, so no masks).
    ``DESC``: both operands through TMA descriptors ([M | N, positions], tiles [BLOCK_M | BLOCK_N, 128])."""
    group = tl.program_id(1)
    pid_m, pid_n = swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    t0 = tl.load(tiles_ptr + group)
    t1 = tl.load(tiles_ptr + group + 1)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    rp = tl.arange(0, 128)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(t0, t1):
        c0 = t * 128
        if DESC:
            a = at_desc.load([m0, c0])
            b = bt_desc.load([n0, c0])
        else:
            a = tl.load(at_ptr + rm64[:, None] * stride_at + (c0 + rp)[None, :], mask=m_ok[:, None], other=0.0)
            b = tl.load(bt_ptr + rn64[:, None] * stride_bt + (c0 + rp)[None, :], mask=n_ok[:, None], other=0.0)
        sa = tl.load(ats_ptr + rm64 * stride_ats + t, mask=m_ok, other=0.0)
        sb = tl.load(bts_ptr + rn64 * stride_bts + t, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * (sa[:, None] * sb[None, :])
    out_ptrs = out_ptr + group.to(tl.int64) * stride_og + rm64[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _check_fp8(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} must be {FP8_DTYPE}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (K-major), got strides {t.stride()}")


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tiles and schedule of one FP8 GEMM launch (BLOCK_K is always 128: one promotion chunk,
    one scale tile).

    ``block_n``: the row GEMMs' column tile; the SwiGLU form's must be 128 (its act tile is one
    1×128 scale tile). ``persistent`` (row GEMMs): 0, one program per possible tile; p > 0, p
    programs per SM walking the tiles. ``one_dot`` (gate_up): gate and up columns as one
    [2·128, 128] operand of one dot (pointer loads), instead of two dots into two accumulators.
    ``promote`` (row GEMMs; the wgrad kernel's two scale vectors are always an outer product):
    ``row`` or ``acc`` (tiles within one weight block, block_n <= 128) or ``outer`` (any tiles;
    the one-dot form's), see the module docstring. ``maxnreg`` (0: ptxas's choice, 255 a thread
    here): a register cap so that more programs share an SM (65536 registers: 168 lets three
    4-warp programs in), paid for in spills.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    persistent: int = 0
    one_dot: bool = False
    promote: str = "row"
    maxnreg: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp8GemmConfig.{name} must be a power of two >= 16, got {v}")
        if self.persistent < 0 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad Fp8GemmConfig {self}")
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"Fp8GemmConfig.maxnreg must be 0 (the compiler's choice) or 24..255, got {self.maxnreg}")
        if self.promote not in PROMOTIONS:
            raise ValueError(f"Fp8GemmConfig.promote must be one of {', '.join(PROMOTIONS)}, got {self.promote!r}")
        if self.promote != "outer" and (self.block_n > TILE or self.one_dot):
            raise ValueError(f"Fp8GemmConfig.promote={self.promote!r} needs a column tile within one weight block "
                             f"(block_n <= {TILE}, not one_dot); got block_n={self.block_n}, one_dot={self.one_dot}")

    @property
    def launch_options(self) -> dict:
        """Triton launch options: warps, stages and (if set) the register cap."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return {**opts, "maxnreg": self.maxnreg} if self.maxnreg else opts

    @property
    def name(self) -> str:
        extra = (f" persistent×{self.persistent}" if self.persistent else "") + (" one-dot" if self.one_dot else "") \
            + (f" r{self.maxnreg}" if self.maxnreg else "")
        tiles = f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages} g{self.group_m}"
        return f"{tiles} {self.promote}{extra}"


# the GEMM roles of the FP8 experts: up + SwiGLU, down, G = grad_out·w2ᵀ, dX rows, the weight gradients
FP8_ROLES = ("gate_up", "down", "dact", "dx", "wgrad")

_F = Fp8GemmConfig
# Hopper defaults: the first-choice tiles of the 2026-12-07 run (promoted per row since: the same
# float32 values, one FMA an element instead of two operations). SwiGLU form: two accumulators and
# two chunk products fit 255 registers at 64 rows and 8 warps (ptxas for sm_90a: 128 rows spilled
# 740 bytes); wgrad 128x128, 4 stages: 243 registers, no spills, 128 KB of shared memory.
_HOPPER_DEFAULT = MappingProxyType({
    "gate_up": _F(64, 128, 8, 4), "down": _F(128, 128, 8, 3), "dact": _F(128, 128, 8, 3),
    "dx": _F(128, 128, 8, 3), "wgrad": _F(128, 128, 8, 4),
})
# Measured winners per (role, GEMM dims): row GEMMs (role, N, KD), wgrad (role, M, N), from
# ``bench layer --sections fp8 --fp8-sweep`` on an H100 (it prints these lines). Empty: defaults.
FP8_TILES: Mapping[tuple[str, int, int], Fp8GemmConfig] = MappingProxyType({})


def fp8_candidates(role: str) -> tuple[Fp8GemmConfig, ...]:
    """The configs ``--fp8-sweep`` times for ``role`` on Hopper, the default first.

    Row GEMMs: the default tiles at other stage counts; 64-row tiles at one warpgroup or two (two
    or three programs per SM: one program's promotion runs while another's dot does, as the scale
    after every chunk makes each wgmma wait; at 4 warps capped at 168 registers, three; down, G
    and dX at 8 warps take 105-110 registers); the ``acc`` promotion (no second tile of
    registers: 115-128, two programs per SM, and 128-row SwiGLU tiles fit); the ``outer`` form
    (what the ``row`` one replaced); persistent schedules; 256-column tiles and the one-dot
    SwiGLU form. wgrad: tiles and stages. (Registers: ptxas for sm_90a, docs/KERNELS.md.)
    """
    if role not in FP8_ROLES:
        raise ValueError(f"unknown FP8 GEMM role {role!r}; known: {', '.join(FP8_ROLES)}")
    if role == "gate_up":
        more = (_F(64, 128, 8, 3), _F(64, 128, 4, 4), _F(64, 128, 4, 3), _F(64, 128, 8, 4, promote="acc"),
                _F(128, 128, 8, 3, promote="acc"), _F(128, 128, 8, 4, promote="acc"), _F(64, 128, 8, 4, persistent=1),
                _F(64, 128, 8, 4, promote="outer"), _F(64, 128, 8, 4, one_dot=True, promote="outer"))
    elif role == "wgrad":
        more = (_F(128, 128, 8, 3), _F(128, 128, 8, 5), _F(64, 128, 4, 4), _F(64, 128, 4, 3, maxnreg=168),
                _F(128, 64, 4, 4), _F(64, 64, 4, 4), _F(128, 128, 8, 4, group_m=16))
    else:
        more = (_F(128, 128, 8, 4), _F(64, 128, 8, 3), _F(64, 128, 4, 3), _F(64, 128, 4, 4),
                _F(64, 128, 4, 3, maxnreg=168), _F(128, 128, 8, 3, promote="acc"),
                _F(128, 128, 8, 4, promote="acc"), _F(128, 128, 8, 3, persistent=1),
                _F(64, 128, 4, 3, persistent=2), _F(128, 128, 8, 3, promote="outer"),
                _F(64, 256, 8, 3, promote="outer"))
    return (_HOPPER_DEFAULT[role],) + more


def fp8_config(role: str, dims: tuple[int, int], device: torch.device,
               tiles: Mapping[tuple[str, int, int], Fp8GemmConfig] = FP8_TILES) -> Fp8GemmConfig:
    """The config a launch uses when none is given: ``tiles`` (:data:`FP8_TILES`; a sweep passes
    its winners) for ``(role, *dims)``, else the role's Hopper default; small tiles under the
    interpreter (CPU tensors). ``dims``: (N, KD) of a row GEMM, (M, N) of a weight gradient."""
    if role not in FP8_ROLES:
        raise ValueError(f"unknown FP8 GEMM role {role!r}; known: {', '.join(FP8_ROLES)}")
    if device.type != "cuda":
        return _F(16, 128, 4, 1)
    return tiles.get((role, *dims)) or _HOPPER_DEFAULT[role]


def _descriptors_ok(*tensors: torch.Tensor) -> bool:
    from ray_moe.kernels.grouped_tma import tma_ok

    return tma_ok(*tensors)


def _launch_rows(*, a, a_s, bt, bt_s, out, layout: PairLayout, top_k: int, gather_a: bool, epilogue: int,
                 n_cols: int, kd: int, role: str, half: int = 0, out_s=None, aux=None, save_aux: bool = False,
                 weight=None, tma: bool | None = None, cfg: Fp8GemmConfig | None = None) -> None:
    """``tma``: B (and A when taken by position) through TMA descriptors; None: where possible.
    ``cfg``: tiles and schedule (None: :func:`fp8_config`); its ``one_dot`` form loads B through
    pointers."""
    _check_fp8(a=a, bt=bt)
    S, b_rows, _ = bt.shape
    if layout.offsets.numel() != S + 1:
        raise ValueError(f"layout has {layout.offsets.numel() - 1} groups, weights have {S} slots")
    if a_s.dtype != torch.float32 or bt_s.dtype != torch.float32:
        raise TypeError("FP8 scales must be float32")
    cfg = cfg or fp8_config(role, (n_cols, kd), a.device)
    one_dot = cfg.one_dot and epilogue == EPI_SWIGLU.value
    if epilogue == EPI_SWIGLU.value and cfg.block_n != TILE:
        raise ValueError(f"the SwiGLU form needs block_n = {TILE} (one act scale tile), got {cfg.name}")
    n_pos = layout.sorted_pair.numel()
    if n_pos == 0:
        return
    block_m, block_n = cfg.block_m, cfg.block_n
    b2 = bt.reshape(S * b_rows, bt.shape[2]) if bt.is_contiguous() else None
    if tma is None:
        tma = b2 is not None and b2.shape[0] > 0 and _descriptors_ok(b2)
    b_desc_ok = tma and not one_dot
    a_desc_ok = tma and not gather_a and _descriptors_ok(a)
    from ray_moe.kernels.grouped_tma import descriptor, num_programs

    b_desc = descriptor(b2, (block_n, 128)) if b_desc_ok else bt
    a_desc = descriptor(a, (block_m, 128)) if a_desc_ok else a
    max_m_tiles = triton.cdiv(n_pos, block_m) + S
    tiles = max_m_tiles * triton.cdiv(n_cols, block_n)
    progs = min(tiles, cfg.persistent * num_programs(a.device)) if cfg.persistent else tiles
    dummy = out
    _fp8_rows_kernel[(progs,)](
        a, a_desc, a_s, bt, b_desc, bt_s, out, dummy if out_s is None else out_s, dummy if aux is None else aux,
        dummy if weight is None else weight, layout.offsets[:-1], layout.offsets[1:], layout.sorted_pair,
        S, max_m_tiles, progs, n_cols, kd, half, b_rows,
        a.stride(0), a_s.stride(0), bt.stride(0), bt.stride(1), bt_s.stride(0), bt_s.stride(1), bt_s.stride(2),
        out.stride(0), 0 if out_s is None else out_s.stride(0), 0 if aux is None else aux.stride(0),
        TOP_K=top_k, GATHER_A=gather_a, EPILOGUE=epilogue, SAVE_AUX=save_aux,
        GROUPS_PAD=triton.next_power_of_2(S), BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=cfg.group_m,
        A_DESC=a_desc_ok, B_DESC=b_desc_ok, ONE_DOT=one_dot, PROMOTE=PROMOTIONS.index(cfg.promote),
        PERSISTENT=cfg.persistent > 0,
        EXACT_CAST=interpreting(), **cfg.launch_options,
    )


def fp8_gate_up(
    xq: torch.Tensor, xs: torch.Tensor, w13t: torch.Tensor, w13t_s: torch.Tensor, layout: PairLayout, top_k: int,
    out_dtype: torch.dtype, save_preact: bool = True, tma: bool | None = None, cfg: Fp8GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Up-projection + SwiGLU, its output quantised for the down-projection.

    Args:
        xq, xs: x [R, H] in 1×128 tiles (:func:`~ray_moe.kernels.fp8_quant.quantize_rows`).
        w13t, w13t_s: w13 [S, H, 2I] as its K-major FP8 copy [S, 2I, H] and block scales
            [S, 2I/128, cdiv(H, 128)] (any strides: the transpose of the blocks' scale is a view).
        out_dtype: h13's dtype (g|u are rounded to it before the activation, as backward reads them).
        cfg: tiles (None: :func:`fp8_config` for role gate_up, dims (I, H)).
    Returns:
        act_q float8_e4m3fn [P, I], act_s float32 [P, I/128], h13 [P, 2I] out_dtype (or None);
        P = R * top_k, rows past offsets[S] unset. Needs I % 128 == 0.
    """
    S, I2, H = w13t.shape
    I = I2 // 2
    if I % TILE or xq.shape[1] != H:
        raise ValueError(f"fp8_gate_up needs w13t [S, 2I, H={xq.shape[1]}] with I a multiple of 128, "
                         f"got {tuple(w13t.shape)}")
    P = xq.shape[0] * top_k
    act_q = torch.empty(P, I, dtype=FP8_DTYPE, device=xq.device)
    act_s = torch.empty(P, I // TILE, dtype=torch.float32, device=xq.device)
    h13 = torch.empty(P if save_preact else 1, I2, dtype=out_dtype, device=xq.device)
    _launch_rows(a=xq, a_s=xs, bt=w13t, bt_s=w13t_s, out=act_q, out_s=act_s, aux=h13, save_aux=save_preact,
                 layout=layout, top_k=top_k, gather_a=True, epilogue=EPI_SWIGLU.value, n_cols=I, kd=H, half=I,
                 role="gate_up", tma=tma, cfg=cfg)
    return act_q, act_s, h13 if save_preact else None


def fp8_down(
    act_q: torch.Tensor, act_s: torch.Tensor, w2t: torch.Tensor, w2t_s: torch.Tensor, layout: PairLayout,
    top_k: int, weight: torch.Tensor, out_dtype: torch.dtype, tma: bool | None = None,
    cfg: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """y[p] = weight[pair(p)] · (act[p] @ w2_s): act [P, I] FP8 (1×128), w2 [S, I, H] as its
    K-major copy w2t [S, H, I] with scales [S, cdiv(H, 128), I/128]. Returns y [P, H] out_dtype.
    cfg: None → :func:`fp8_config` for role down, dims (H, I)."""
    S, H, I = w2t.shape
    if act_q.shape[1] != I or weight.dtype != torch.float32 or weight.numel() != act_q.shape[0]:
        raise ValueError(f"fp8_down: act [P, I={I}] and float32 weight [P] expected, got {tuple(act_q.shape)}, "
                         f"{weight.dtype} {tuple(weight.shape)}")
    y = torch.empty(act_q.shape[0], H, dtype=out_dtype, device=act_q.device)
    _launch_rows(a=act_q, a_s=act_s, bt=w2t, bt_s=w2t_s, out=y, weight=weight.contiguous(), layout=layout,
                 top_k=top_k, gather_a=False, epilogue=EPI_SCALE.value, n_cols=H, kd=I, role="down", tma=tma, cfg=cfg)
    return y


def fp8_rows(
    a_q: torch.Tensor, a_s: torch.Tensor, bt: torch.Tensor, bt_s: torch.Tensor, layout: PairLayout, top_k: int,
    gather_a: bool, out_dtype: torch.dtype, tma: bool | None = None, cfg: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """out[p] = A[row(p)] @ B_s with B_s given K-major as ``bt[s]`` [N, KD] (block scales
    [S, cdiv(N, 128), cdiv(KD, 128)]); A [R or P, KD] FP8 in 1×128 tiles. The backward's
    G = grad_out[row] @ w2_sᵀ (bt = the w2 copy [S, I, H]; role dact, A gathered) and dX rows
    dh13 @ w13_sᵀ (bt = w13 [S, H, 2I]; role dx). Returns [P, N] out_dtype, rows past
    offsets[S] unset. cfg: None → :func:`fp8_config` for the role, dims (N, KD)."""
    S, N, KD = bt.shape
    if a_q.shape[1] != KD:
        raise ValueError(f"fp8_rows: A has {a_q.shape[1]} columns, B's contraction is {KD}")
    P = layout.sorted_pair.numel()
    out = torch.empty(P, N, dtype=out_dtype, device=a_q.device)
    _launch_rows(a=a_q, a_s=a_s, bt=bt, bt_s=bt_s, out=out, layout=layout, top_k=top_k, gather_a=gather_a,
                 epilogue=EPI_PLAIN.value, n_cols=N, kd=KD, role="dact" if gather_a else "dx", tma=tma, cfg=cfg)
    return out


def fp8_wgrad(
    at: torch.Tensor, at_s: torch.Tensor, bt: torch.Tensor, bt_s: torch.Tensor, tiles: torch.Tensor,
    out_dtype: torch.dtype, tma: bool | None = None, cfg: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """dW[s] = Σ_{p in group s} A[p]ᵀ B[p] from the operands of
    :func:`~ray_moe.kernels.fp8_quant.quantize_cols`: at [M, 128 · n_tiles], bt [N, 128 · n_tiles]
    FP8, scales [M | N, n_tiles]; ``tiles`` int32 [S + 1] (:func:`~ray_moe.kernels.fp8_quant.group_tiles`).
    ``tma``: both operands through descriptors (None: where possible). cfg: None →
    :func:`fp8_config` for role wgrad, dims (M, N). Returns [S, M, N] out_dtype (0 for empty groups)."""
    _check_fp8(at=at, bt=bt)
    M, N = at.shape[0], bt.shape[0]
    S = tiles.numel() - 1
    out = torch.empty(S, M, N, dtype=out_dtype, device=at.device)
    if S == 0 or M == 0 or N == 0:
        return out
    cfg = cfg or fp8_config("wgrad", (M, N), at.device)
    block_m, block_n = cfg.block_m, cfg.block_n
    if tma is None:
        tma = at.shape[1] > 0 and _descriptors_ok(at, bt)
    if tma:
        from ray_moe.kernels.grouped_tma import descriptor

        at_desc, bt_desc = descriptor(at, (block_m, 128)), descriptor(bt, (block_n, 128))
    else:
        at_desc, bt_desc = at, bt
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), S)
    _fp8_wgrad_kernel[grid](
        at, at_desc, at_s, bt, bt_desc, bt_s, out, tiles, M, N, at.stride(0), at_s.stride(0), bt.stride(0),
        bt_s.stride(0), out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=cfg.group_m,
        DESC=tma, **cfg.launch_options,
    )
    return out


# ---------------------------------------------------------------------------------------------
# float32 references of the same quantised math (valid positions only; host loops over groups)
# ---------------------------------------------------------------------------------------------


def _rows_acc_reference(a_q, a_s, bt, bt_s, layout, top_k, gather_a) -> torch.Tensor:
    """float32 [P, N]: dequantised A rows of each group @ dequantised B_sᵀ; 0 past offsets[S]."""
    a = dequantize_rows(a_q, a_s)
    b = dequantize_blocks(bt, bt_s)  # [S, N, KD]
    out = torch.zeros(layout.sorted_pair.numel(), bt.shape[1], dtype=torch.float32, device=a_q.device)
    offsets = layout.offsets.tolist()
    for s in range(len(offsets) - 1):
        lo, hi = offsets[s], offsets[s + 1]
        idx = layout.sorted_pair[lo:hi].long() // top_k if gather_a else torch.arange(lo, hi, device=a.device)
        out[lo:hi] = a[idx] @ b[s].T
    return out


def fp8_gate_up_reference(xq, xs, w13t, w13t_s, layout, top_k, out_dtype, save_preact=True, tma=None, cfg=None):
    """Reference of :func:`fp8_gate_up` (rows past offsets[S]: zeros)."""
    h13 = _rows_acc_reference(xq, xs, w13t, w13t_s, layout, top_k, True).to(out_dtype)
    gate, up = h13.float().chunk(2, dim=1)
    act_q, act_s = quantize_rows_reference(torch.nn.functional.silu(gate) * up)
    return act_q, act_s, h13 if save_preact else None


def fp8_down_reference(act_q, act_s, w2t, w2t_s, layout, top_k, weight, out_dtype, tma=None, cfg=None):
    """Reference of :func:`fp8_down`."""
    acc = _rows_acc_reference(act_q, act_s, w2t, w2t_s, layout, top_k, False)
    n_valid = int(layout.offsets[-1])
    w = torch.zeros(acc.shape[0], dtype=torch.float32, device=acc.device)
    w[:n_valid] = weight.reshape(-1).float()[layout.sorted_pair[:n_valid].long()]
    return (acc * w[:, None]).to(out_dtype)


def fp8_rows_reference(a_q, a_s, bt, bt_s, layout, top_k, gather_a, out_dtype, tma=None, cfg=None):
    """Reference of :func:`fp8_rows`."""
    return _rows_acc_reference(a_q, a_s, bt, bt_s, layout, top_k, gather_a).to(out_dtype)


def fp8_wgrad_reference(at, at_s, bt, bt_s, tiles, out_dtype, tma=None, cfg=None):
    """Reference of :func:`fp8_wgrad`."""
    a, b = dequantize_rows(at, at_s), dequantize_rows(bt, bt_s)
    t = [v * TILE for v in tiles.tolist()]
    out = torch.zeros(len(t) - 1, at.shape[0], bt.shape[0], dtype=torch.float32, device=at.device)
    for s in range(len(t) - 1):
        out[s] = a[:, t[s]:t[s + 1]] @ b[:, t[s]:t[s + 1]].T
    return out.to(out_dtype)
