"""Gathers over a PairLayout: the weighted combine (:func:`gather_sum`) and the pair rows
(:func:`gather_pair_rows`).

Weighted combine, gather form: out[r] = sum_k src[pair_pos[r*K + k]] over the valid pairs of row r.

This replaces ``index_add`` scatter: each output row is written once, by one program, in a
fixed order over k (deterministic). The per-pair weights were already applied by the kernel that
produced ``src`` (the down GEMM's epilogue; the dX GEMM's operand), so this is a plain sum.
A pair is valid when its position is below ``offsets[S]``; positions past it are never read.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ray_moe.kernels.routing import PairLayout


@triton.jit
def _gather_sum_kernel(
    src_ptr, pair_pos_ptr, n_valid_ptr, out_ptr, n_rows, n_cols, stride_src, stride_out,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    n_valid = tl.load(n_valid_ptr)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pos = tl.load(pair_pos_ptr + rows * TOP_K + k, mask=row_ok, other=0)
        ok = row_ok & (pos < n_valid)
        v = tl.load(
            src_ptr + pos[:, None].to(tl.int64) * stride_src + cols[None, :],
            mask=ok[:, None] & col_ok[None, :], other=0.0,
        )
        acc += v.to(tl.float32)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :],
    )


def _check_rows(src: torch.Tensor) -> None:
    if src.dim() != 2 or src.stride(1) != 1:
        raise ValueError(f"src must be a row-contiguous matrix, got shape {tuple(src.shape)} strides {src.stride()}")


def _launch_rows(kernel, src: torch.Tensor, index: torch.Tensor, layout: PairLayout, n_rows: int, top_k: int,
                 block_c: int, tile: int) -> torch.Tensor:
    """Either kernel of this module into a new [n_rows, C] output (src's dtype and columns), in
    tiles of ``tile`` elements at most ``block_c`` wide (the kernels share the argument list)."""
    C = src.shape[1]
    out = torch.empty(n_rows, C, dtype=src.dtype, device=src.device)
    if n_rows == 0 or C == 0:
        return out
    block_c = min(block_c, triton.next_power_of_2(C))
    block_r = max(1, tile // block_c)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(C, block_c))
    kernel[grid](src, index, layout.offsets[-1:], out, n_rows, C, src.stride(0), out.stride(0),
                 TOP_K=top_k, BLOCK_R=block_r, BLOCK_C=block_c)
    return out


def gather_sum(src: torch.Tensor, layout: PairLayout, top_k: int) -> torch.Tensor:
    """Sum each row's valid pairs.

    Args:
        src: [R*K, C] float32 or bfloat16, one row per position (rows past offsets[S] may be unset).
        layout: the PairLayout of the slots ([R, K] flattened).
        top_k: K.
    Returns:
        [R, C] in src.dtype; rows with no valid pair are 0.
    """
    _check_rows(src)
    n_pairs = layout.pair_pos.numel()
    if n_pairs % top_k != 0 or src.shape[0] != n_pairs:
        raise ValueError(f"src has {src.shape[0]} rows and the layout {n_pairs} pairs; top_k={top_k} must divide it")
    if src.device != layout.pair_pos.device:
        raise ValueError(f"src on {src.device}, layout on {layout.pair_pos.device}")
    return _launch_rows(_gather_sum_kernel, src, layout.pair_pos, layout, n_pairs // top_k, top_k,
                        block_c=256, tile=2048)


@triton.jit
def _gather_pair_rows_kernel(
    src_ptr, sorted_pair_ptr, n_valid_ptr, out_ptr, n_pos, n_cols, stride_src, stride_out,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pos = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (pos < n_pos) & (pos < tl.load(n_valid_ptr))
    row = tl.load(sorted_pair_ptr + pos, mask=ok, other=0) // TOP_K
    mask = ok[:, None] & (cols[None, :] < n_cols)
    v = tl.load(src_ptr + row[:, None].to(tl.int64) * stride_src + cols[None, :], mask=mask)
    tl.store(out_ptr + pos[:, None].to(tl.int64) * stride_out + cols[None, :], v, mask=mask)


def gather_pair_rows(src: torch.Tensor, layout: PairLayout, top_k: int) -> torch.Tensor:
    """Each valid pair's source row, in position order: out[p] = src[sorted_pair[p] // K] for
    p < offsets[S] (a device value: no host sync).

    Positions past offsets[S] are left unset and cost nothing. ``src[sorted_pair // K]`` would copy
    every one of the R*K positions: an EP rank receives one row per token and destination, so
    about half its positions are empty, and that copy took 2x a rank's own compute's
    (``bench layer --ep-profile``, H200 x2).

    Args:
        src: [R, C] any dtype, row-contiguous.
        layout: the PairLayout of the slots ([R, K] flattened).
        top_k: K.
    Returns:
        [R*K, C] in src.dtype; rows from offsets[S] on unset (on the CPU without Triton's
        interpreter: a torch gather of every position).
    """
    _check_rows(src)
    n_pos = layout.sorted_pair.numel()
    if n_pos != src.shape[0] * top_k:
        raise ValueError(f"src has {src.shape[0]} rows and the layout {n_pos} positions; expected rows x top_k={top_k}")
    if not src.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":  # the CPU path: every position
        return src[layout.sorted_pair.long() // top_k]
    return _launch_rows(_gather_pair_rows_kernel, src, layout.sorted_pair, layout, n_pos, top_k,
                        block_c=1024, tile=4096)


def gather_sum_reference(src: torch.Tensor, layout: PairLayout, top_k: int) -> torch.Tensor:
    """Pure-torch reference of :func:`gather_sum` (float32 accumulation)."""
    n_valid = int(layout.offsets[-1])
    pos = layout.pair_pos.long().reshape(-1, top_k)
    valid = pos < n_valid
    rows = src.float()[pos.clamp(max=max(n_valid - 1, 0)).reshape(-1)].reshape(*pos.shape, -1) if n_valid else None
    if rows is None:
        return torch.zeros(pos.shape[0], src.shape[1], dtype=src.dtype, device=src.device)
    return (rows * valid.unsqueeze(-1)).sum(1).to(src.dtype)
