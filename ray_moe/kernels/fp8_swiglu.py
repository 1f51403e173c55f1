"""The FP8 experts' SwiGLU backward, fused with the quantisations of what it makes.

Between the FP8 GEMMs G = grad_out·w2ᵀ and dX rows = dh13·w13ᵀ the SwiGLU backward makes
dh13 [P, 2I] and aw = weight·act [P, I]. The recipe uses them only quantised: dh13 in 1×128 row
tiles (dX's A operand) and in 128-position column tiles (dW13's B operand), aw in column tiles
(dW2's A operand). :func:`swiglu_bwd_fp8` makes all three from G and g|u in one kernel, so dh13
and aw never reach memory in x.dtype (the unfused path wrote them and read them three times).

Numerics: the unfused path's. Each value is rounded to G's dtype first (what storing dh13 and aw
did), then quantised as :func:`~ray_moe.kernels.fp8_quant.quantize_rows` and
:func:`~ray_moe.kernels.fp8_quant.quantize_cols` do; the outputs use their layouts.

Kernel: one program per 128-position tile of one group (``quantize_cols``' tiles, found from the
offsets on the device), looping over the expert width in 128-column blocks, each made
:data:`SUB_ROWS` positions at a time. A first pass writes the row tiles (a row's 128 columns are
in registers), the routing weight's gradient per column block and the columns' running |max|; a
second pass, reading G and g|u again (from L2: the block was just read), quantises with the
columns' scales. The routing weight's gradient is summed over the column blocks afterwards (one
writer per value, no atomics).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ray_moe.kernels import fp8_quant as Q
from ray_moe.kernels.fp8_quant import bf16_round, tile_scale, to_e4m3
from ray_moe.kernels.grouped_swiglu import _tile_of_groups
from ray_moe.kernels.routing import PairLayout


# positions a program holds at once: [16, 128] float32 tiles at 8 warps fit 128 registers, two
# programs an SM (ptxas 13.4 for sm_90a: 126 registers, no spills, with the 16-divisible sizes the
# JIT specialises on; [32, 128] needs 204)
SUB_ROWS = 16


class SwigluBwdFp8(NamedTuple):
    """What the FP8 experts' backward needs from the SwiGLU backward (None: not asked for).

    dh13_rows: (q float8_e4m3fn [P, 2I], scale float32 [P, 2I/128]) as ``quantize_rows(dh13)``;
        rows past ``offsets[S]`` unset. dh13_cols and aw_cols: (qt, st) as ``quantize_cols(dh13)``
        / ``quantize_cols(aw)`` (positions taken in place). dw_pos: float32 [P], <act, G> per
        position, 0 past ``offsets[S]``.
    """

    dh13_rows: tuple[torch.Tensor, torch.Tensor] | None
    dh13_cols: tuple[torch.Tensor, torch.Tensor] | None
    aw_cols: tuple[torch.Tensor, torch.Tensor] | None
    dw_pos: torch.Tensor


@triton.jit
def _swiglu_bwd_values(g_ptr, h13_ptr, weight_ptr, sorted_pair_ptr, pos, ok, cols, I, ROUND_BF16: tl.constexpr,
                       EXACT_CAST: tl.constexpr):
    """[SUB positions, 128 columns] of (a·G before the sum, aw, dgate, dup), the last three rounded
    as storing them in G's dtype would; rows where ``ok`` is false are zeros. Float32, in the plain
    SwiGLU backward kernel's order of operations."""
    p64 = pos.to(tl.int64)
    pair = tl.load(sorted_pair_ptr + pos, mask=ok, other=0)
    w = tl.load(weight_ptr + pair, mask=ok, other=0.0)
    g = tl.load(g_ptr + p64[:, None] * I + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    gate = tl.load(h13_ptr + p64[:, None] * (2 * I) + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    up = tl.load(h13_ptr + p64[:, None] * (2 * I) + I + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    act = silu * up
    d_act = g * w[:, None]
    d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = d_act * silu
    aw = act * w[:, None]
    if ROUND_BF16:
        aw, d_gate, d_up = bf16_round(aw, EXACT_CAST), bf16_round(d_gate, EXACT_CAST), bf16_round(d_up, EXACT_CAST)
    return act * g, aw, d_gate, d_up


@triton.jit
def _store_rows(v, pos, ok, cols, kb, q_ptr, s_ptr, stride_q, stride_s, EXACT_CAST: tl.constexpr):
    """v [SUB, 128 columns]: one 1×128 tile a row, to q at (pos, cols) and its scale at (pos, kb)."""
    p64 = pos.to(tl.int64)
    rs = tile_scale(tl.max(tl.abs(v), axis=1))
    tl.store(q_ptr + p64[:, None] * stride_q + cols[None, :], to_e4m3(v, rs[:, None], EXACT_CAST), mask=ok[:, None])
    tl.store(s_ptr + p64 * stride_s + kb, rs, mask=ok)


@triton.jit
def _store_cols(v, scale, cols, tpos, qt_ptr, stride_qt, EXACT_CAST: tl.constexpr):
    """v [SUB, 128 columns] quantised with its columns' scales [128], stored transposed at (cols, tpos)."""
    tl.store(qt_ptr + cols.to(tl.int64)[None, :] * stride_qt + tpos[:, None], to_e4m3(v, scale[None, :], EXACT_CAST))


@triton.jit
def _swiglu_bwd_fp8_kernel(
    g_ptr, h13_ptr, weight_ptr, sorted_pair_ptr, starts_ptr, ends_ptr, n_groups, I,
    dq_ptr, ds_ptr, d13t_ptr, s13t_ptr, awt_ptr, sawt_ptr, dw_ptr,
    stride_dq, stride_ds, stride_d13t, stride_s13t, stride_awt, stride_sawt, stride_dw,
    ROWS: tl.constexpr, COLS13: tl.constexpr, COLS_AW: tl.constexpr, ROUND_BF16: tl.constexpr,
    SUB: tl.constexpr, GROUPS_PAD: tl.constexpr, EXACT_CAST: tl.constexpr,
):
    """Program t: tile t of the groups' 128-position tiles (programs past the last one return).
    Per position p of it, from G [P, I] and h13 = g|u [P, 2I]: dh13 = w · (G·u·silu'(g) | G·silu(g)),
    aw = w · a, and <a, G> over column block c to dw_parts[c, p] (a = silu(g)·u). Each 128-column
    block is made SUB positions at a time (registers): once for the row tiles, dw and the columns'
    running |max| (elementwise, reduced across the positions once per block), and once more, when
    column tiles are asked for, to quantise with the columns' scales."""
    t = tl.program_id(0)
    _group, row_start, row_end, total = _tile_of_groups(starts_ptr, ends_ptr, n_groups, t, 128, GROUPS_PAD)
    if t >= total:
        return
    lane = tl.arange(0, 128)
    sub = tl.arange(0, SUB)
    for c0 in range(0, I, 128):
        cols = tl.max_contiguous(tl.multiple_of(c0 + lane, 128), 128)  # (so that loads and stores vectorise)
        kb = c0 // 128
        m_g = tl.zeros([SUB, 128], dtype=tl.float32)
        m_u = tl.zeros([SUB, 128], dtype=tl.float32)
        m_a = tl.zeros([SUB, 128], dtype=tl.float32)
        for r0 in range(0, 128, SUB):
            pos = row_start + r0 + sub
            ok = pos < row_end
            ag, aw, d_gate, d_up = _swiglu_bwd_values(g_ptr, h13_ptr, weight_ptr, sorted_pair_ptr, pos, ok, cols, I,
                                                      ROUND_BF16, EXACT_CAST)
            tl.store(dw_ptr + kb.to(tl.int64) * stride_dw + pos, tl.sum(ag, axis=1), mask=ok)
            if ROWS:
                _store_rows(d_gate, pos, ok, cols, kb, dq_ptr, ds_ptr, stride_dq, stride_ds, EXACT_CAST)
                _store_rows(d_up, pos, ok, I + cols, kb + I // 128, dq_ptr, ds_ptr, stride_dq, stride_ds, EXACT_CAST)
            m_g = tl.maximum(m_g, tl.abs(d_gate))
            m_u = tl.maximum(m_u, tl.abs(d_up))
            m_a = tl.maximum(m_a, tl.abs(aw))
        if COLS13 or COLS_AW:
            s_g = tile_scale(tl.max(m_g, axis=0))
            s_u = tile_scale(tl.max(m_u, axis=0))
            s_a = tile_scale(tl.max(m_a, axis=0))
            for r0 in range(0, 128, SUB):
                pos = row_start + r0 + sub
                tpos = t * 128 + r0 + sub
                _, aw, d_gate, d_up = _swiglu_bwd_values(g_ptr, h13_ptr, weight_ptr, sorted_pair_ptr, pos,
                                                         pos < row_end, cols, I, ROUND_BF16, EXACT_CAST)
                if COLS13:
                    _store_cols(d_gate, s_g, cols, tpos, d13t_ptr, stride_d13t, EXACT_CAST)
                    _store_cols(d_up, s_u, I + cols, tpos, d13t_ptr, stride_d13t, EXACT_CAST)
                if COLS_AW:
                    _store_cols(aw, s_a, cols, tpos, awt_ptr, stride_awt, EXACT_CAST)
            if COLS13:
                tl.store(s13t_ptr + cols.to(tl.int64) * stride_s13t + t, s_g)
                tl.store(s13t_ptr + (I + cols).to(tl.int64) * stride_s13t + t, s_u)
            if COLS_AW:
                tl.store(sawt_ptr + cols.to(tl.int64) * stride_sawt + t, s_a)


def _check(g: torch.Tensor, h13: torch.Tensor, weight: torch.Tensor, layout: PairLayout) -> None:
    P, I = g.shape
    if g.dim() != 2 or h13.shape != (P, 2 * I) or g.dtype != h13.dtype or not g.is_contiguous() \
            or not h13.is_contiguous():
        raise ValueError(f"expected contiguous G [P, I] and h13 [P, 2I] of one dtype, got {g.dtype} "
                         f"{tuple(g.shape)} and {h13.dtype} {tuple(h13.shape)}")
    if I % Q.TILE:
        raise ValueError(f"the expert width I must be a multiple of {Q.TILE}, got {I}")
    if weight.dtype != torch.float32 or layout.sorted_pair.numel() != P:
        raise ValueError(f"expected float32 routing weights and a layout of {P} pairs")


def swiglu_bwd_fp8(g: torch.Tensor, h13: torch.Tensor, weight: torch.Tensor, layout: PairLayout,
                   rows: bool = True, cols13: bool = True, cols_aw: bool = True) -> SwigluBwdFp8:
    """The SwiGLU backward on G with its outputs quantised as the FP8 backward's GEMMs read them.

    Args:
        g: G = grad_out[row] @ w2_sᵀ [P, I] (float32 or bfloat16, contiguous; I % 128 == 0).
        h13: g|u [P, 2I] saved by the up-projection, G's dtype.
        weight: float32 [R, K] routing weights; layout: the PairLayout of the [R, K] slots (S groups).
        rows, cols13, cols_aw: which of dh13's row tiles, dh13's column tiles and aw's column tiles
            to make (the ones dX, dW13 and dW2 need).
    Returns: :class:`SwigluBwdFp8`. Sync-free.
    """
    _check(g, h13, weight, layout)
    P, I = g.shape
    S = layout.offsets.numel() - 1
    n_tiles = Q.col_tiles(P, S)
    dev = g.device
    dq = torch.empty(P, 2 * I, dtype=Q.FP8_DTYPE, device=dev) if rows else None
    ds = torch.empty(P, 2 * I // Q.TILE, dtype=torch.float32, device=dev) if rows else None
    d13t = torch.empty(2 * I, n_tiles * Q.TILE, dtype=Q.FP8_DTYPE, device=dev) if cols13 else None
    s13t = torch.empty(2 * I, n_tiles, dtype=torch.float32, device=dev) if cols13 else None
    awt = torch.empty(I, n_tiles * Q.TILE, dtype=Q.FP8_DTYPE, device=dev) if cols_aw else None
    sawt = torch.empty(I, n_tiles, dtype=torch.float32, device=dev) if cols_aw else None
    # <a, G> per 128-column block (summed below: one writer per value, no atomics), 0 past offsets[S]
    dw_parts = torch.zeros(I // Q.TILE, P, dtype=torch.float32, device=dev)
    if P and I and S:
        def stride(t: torch.Tensor | None) -> int:
            return t.stride(0) if t is not None else 0

        _swiglu_bwd_fp8_kernel[(n_tiles,)](
            g, h13, weight.contiguous(), layout.sorted_pair, layout.offsets[:-1], layout.offsets[1:], S, I,
            dq, ds, d13t, s13t, awt, sawt, dw_parts,
            stride(dq), stride(ds), stride(d13t), stride(s13t), stride(awt), stride(sawt), dw_parts.stride(0),
            ROWS=rows, COLS13=cols13, COLS_AW=cols_aw, ROUND_BF16=g.dtype == torch.bfloat16,
            SUB=64 if Q.interpreting() else SUB_ROWS,  # (the interpreter: fewer, larger slices)
            GROUPS_PAD=triton.next_power_of_2(S), EXACT_CAST=Q.interpreting(), num_warps=8, maxnreg=128)
    return SwigluBwdFp8((dq, ds) if rows else None, (d13t, s13t) if cols13 else None,
                        (awt, sawt) if cols_aw else None, dw_parts.sum(0))


# ---------------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------------


def swiglu_bwd_reference(g: torch.Tensor, h13: torch.Tensor, weight: torch.Tensor, layout: PairLayout
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From G [P, I] and h13 = g|u [P, 2I]: dh13 = w · (dG·u·silu'(g) | dG·silu(g)), aw = w · a,
    dw_pos = <a, G> (float32; 0 past offsets[S], as are dh13 and aw there). Dtypes: G's."""
    P, I = g.shape
    n_valid = int(layout.offsets[-1])
    w = torch.zeros(P, dtype=torch.float32, device=g.device)
    w[:n_valid] = weight.reshape(-1).float()[layout.sorted_pair[:n_valid].long()]
    valid = (torch.arange(P, device=g.device) < n_valid)[:, None]
    gf = torch.where(valid, g.float(), 0.0)
    gate, up = torch.where(valid, h13.float(), 0.0).chunk(2, dim=1)
    sig = torch.sigmoid(gate)
    act = gate * sig * up
    d_act = gf * w[:, None]
    dh13 = torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * gate * sig], dim=1)
    return dh13.to(g.dtype), (act * w[:, None]).to(g.dtype), (act * gf).sum(1)


def swiglu_bwd_fp8_reference(g: torch.Tensor, h13: torch.Tensor, weight: torch.Tensor, layout: PairLayout,
                             rows: bool = True, cols13: bool = True, cols_aw: bool = True) -> SwigluBwdFp8:
    """Reference of :func:`swiglu_bwd_fp8`: :func:`swiglu_bwd_reference`, then the quantisations'
    references."""
    _check(g, h13, weight, layout)
    dh13, aw, dw_pos = swiglu_bwd_reference(g, h13, weight, layout)
    return SwigluBwdFp8(Q.quantize_rows_reference(dh13) if rows else None,
                        Q.quantize_cols_reference(dh13, layout, 1, False) if cols13 else None,
                        Q.quantize_cols_reference(aw, layout, 1, False) if cols_aw else None, dw_pos)
