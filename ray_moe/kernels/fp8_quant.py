"""FP8 (E4M3) quantisation of the routed experts' operands, DeepSeek-V3's fine-grained scaling.

Three tilings, each a Triton kernel with its torch reference below it (the reference defines the
numerics; the kernels reproduce them bit for bit on the GPU):

- :func:`quantize_rows`: activations and gradients that are the *left* operand of a row GEMM
  (x, grad_out, dh13): one float32 scale per row and per 128 columns (1×128 tiles).
- :func:`quantize_cols`: the operands of the weight-gradient GEMMs, whose contraction runs over
  positions: the rows of group order (gathered through ``sorted_pair // K`` or taken by
  position) written *transposed*, one scale per column and per 128 positions (DeepSeek-V3's
  128×1 tiles of the backward), so that both wgrad operands are K-major as Hopper's FP8 tensor
  cores need. Each group starts a new 128-position tile (its last tile zero-padded): a tile
  never mixes two experts' rows, and the weight-gradient GEMM needs no masks
  (:func:`group_tiles` says where each group's tiles are).
- :func:`quantize_blocks`: the expert weights [S, R, C]: one scale per 128×128 block; the kernel
  writes the FP8 copy and its transpose [S, C, R] in one pass (the forward GEMMs read w13 / w2
  K-major as ``[S, N, K]``, the backward ones the other way round).

Numerics of one tile t (the reference's, exactly)::

    amax  = max |v| over t (float32)
    scale = amax / 448  if amax > 0 else 1          (448: E4M3's largest finite value;
                                                     correctly rounded division on every device)
    q     = e4m3( clamp(v / scale, -448, 448) )     (round to nearest even)
    v ≈ q * scale

Triton's interpreter rounds float32 → float8e4nv wrongly (it is exact only for values already
on the E4M3 grid): under ``TRITON_INTERPRET=1`` the kernels round onto the grid first
(:func:`e4m3_round`) and the cast is then exact; on the GPU the hardware cast does it
(``cvt.rn.satfinite``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ray_moe.kernels.grouped_swiglu import _tile_of_groups
from ray_moe.kernels.routing import PairLayout

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128  # 1×128 tiles, 128×128 blocks


def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (kernels then round onto E4M3 themselves)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def e4m3_round(v):
    """``v`` (float32, |v| <= 448) rounded to nearest even on the E4M3 grid, still float32:
    steps of 2^(e-3) for a value of exponent e >= -6, 2^-9 below (subnormals)."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    step = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    y = tl.abs(v) * inv_step
    r = ((y + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: float32 addition rounds y < 2^22 to nearest even
    return tl.where(bits < 0, -r, r)  # the sign bit kept: what underflows to zero stays -0, as the cast does


@triton.jit
def bf16_round(v, EXACT_CAST: tl.constexpr):
    """``v`` (float32) rounded to nearest even on bfloat16's grid, still float32 (what storing it
    as bfloat16 and reading it back gives). The interpreter truncates float32 → bfloat16, so there
    (EXACT_CAST) the rounding is done on the bits; finite values only."""
    if EXACT_CAST:
        bits = v.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def to_e4m3(v, scale, EXACT_CAST: tl.constexpr):
    """``v / scale`` clamped to ±448 and cast to float8e4nv (``scale`` broadcastable to v)."""
    q = tl.minimum(tl.maximum(tl.div_rn(v, scale), -448.0), 448.0)  # div_rn: torch's division, not div.full
    if EXACT_CAST:
        q = e4m3_round(q)
    return q.to(tl.float8e4nv)


@triton.jit
def tile_scale(amax):
    """amax / 448, or 1 where the tile is all zeros."""
    return tl.where(amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, C, stride_xm, stride_qm, stride_sm,
                          BLOCK_R: tl.constexpr, EXACT_CAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    r64 = rows.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < C)[None, :]
    v = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tile_scale(tl.max(tl.abs(v), axis=1))
    tl.store(q_ptr + r64[:, None] * stride_qm + cols[None, :], to_e4m3(v, scale[:, None], EXACT_CAST), mask=mask)
    tl.store(s_ptr + r64 * stride_sm + tl.program_id(1), scale, mask=rows < M)


def quantize_rows(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """1×128-tile quantisation of the rows of ``x``.

    Args: x [M, C] float32/bfloat16, row-contiguous. out: (q, scale) to write, row-strided views
        allowed (e.g. :func:`packed_views` of one wire row buffer); None: new tensors.
    Returns: q [M, C] float8_e4m3fn and scale float32 [M, cdiv(C, 128)] (x ≈ q * scale per tile).
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be a row-contiguous matrix, got shape {tuple(x.shape)} strides {x.stride()}")
    M, C = x.shape
    if out is not None:
        q, s = out
    else:
        q = torch.empty(M, C, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty(M, triton.cdiv(C, TILE), dtype=torch.float32, device=x.device)
    if M and C:
        block_r = 16
        _quantize_rows_kernel[(triton.cdiv(M, block_r), triton.cdiv(C, TILE))](
            x, q, s, M, C, x.stride(0), q.stride(0), s.stride(0), BLOCK_R=block_r, EXACT_CAST=interpreting(),
            num_warps=4)
    return q, s


@triton.jit
def _quantize_cols_kernel(src_ptr, srcs_ptr, qt_ptr, st_ptr, sorted_pair_ptr, starts_ptr, ends_ptr, n_groups, C,
                          stride_src, stride_srcs, stride_qt, stride_st, TOP_K: tl.constexpr, GATHER: tl.constexpr,
                          SCALED: tl.constexpr, ROUND_BF16: tl.constexpr, GROUPS_PAD: tl.constexpr,
                          BLOCK_C: tl.constexpr, EXACT_CAST: tl.constexpr):
    """Tile t = program 0 of the groups' 128-position tiles (its group found from the offsets on
    the device, as the row GEMMs find theirs); programs past the last tile return. SCALED: src is
    FP8 rows with 1×128 scales (srcs), dequantised on load (then rounded to bf16 if ROUND_BF16)."""
    t = tl.program_id(0)
    group, row_start, row_end, total = _tile_of_groups(starts_ptr, ends_ptr, n_groups, t, 128, GROUPS_PAD)
    if t >= total:
        return
    pos = row_start + tl.arange(0, 128)
    ok = pos < row_end
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if GATHER:
        row = (tl.load(sorted_pair_ptr + pos, mask=ok, other=0) // TOP_K).to(tl.int64)
    else:
        row = pos.to(tl.int64)
    c_ok = cols < C
    v = tl.load(src_ptr + row[:, None] * stride_src + cols[None, :], mask=ok[:, None] & c_ok[None, :],
                other=0.0).to(tl.float32)  # [128 positions, BLOCK_C]
    if SCALED:  # (BLOCK_C divides 128: the block lies in one 1x128 tile of each row)
        s = tl.load(srcs_ptr + row * stride_srcs + (tl.program_id(1) * BLOCK_C) // 128, mask=ok, other=0.0)
        v = v * s[:, None]
        if ROUND_BF16:
            v = bf16_round(v, EXACT_CAST)
    scale = tile_scale(tl.max(tl.abs(v), axis=0))  # [BLOCK_C]
    q = to_e4m3(v, scale[None, :], EXACT_CAST)
    c64 = cols.to(tl.int64)
    tl.store(qt_ptr + c64[None, :] * stride_qt + (t * 128 + tl.arange(0, 128))[:, None], q, mask=c_ok[None, :])
    tl.store(st_ptr + c64 * stride_st + t, scale, mask=c_ok)


def group_tiles(offsets: torch.Tensor) -> torch.Tensor:
    """int32 [S + 1]: group s's 128-position tiles of :func:`quantize_cols`' layout are
    ``[tiles[s], tiles[s + 1])`` (cdiv of its size by 128 each; torch ops, sync-free)."""
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
    return torch.cat([offsets.new_zeros(1), ((counts + TILE - 1) // TILE).cumsum(0).to(offsets.dtype)])


def col_tiles(n_pos: int, n_groups: int) -> int:
    """Tiles :func:`quantize_cols` allocates for ``n_pos`` positions in ``n_groups`` groups: every
    group may add one partial tile."""
    return triton.cdiv(n_pos, TILE) + n_groups


def quantize_cols(src: torch.Tensor, layout: PairLayout, top_k: int, gather: bool,
                  scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-ordered rows of ``src``, transposed and quantised in 1×128 tiles along positions, each
    group starting a new tile.

    Args:
        src: [R, C] rows (``gather``: position p reads row ``sorted_pair[p] // top_k``) or
            [P, C] positions (P = R * top_k), float32/bfloat16, row-contiguous; or, with ``scale``,
            FP8 rows (float8_e4m3fn, row-strided views allowed) whose values are
            ``dequantize_rows(src, scale).to(dtype)``, made on load (no dequantised copy).
        layout: the PairLayout of the [R, top_k] slots (S groups).
        scale: float32 [rows, cdiv(C, 128)], src's 1×128 scales (:func:`quantize_rows`' output).
        dtype: with ``scale``, what the dequantised values are rounded to (float32 or bfloat16).
    Returns:
        qt float8_e4m3fn [C, 128 · n_tiles] and scale float32 [C, n_tiles], n_tiles =
        :func:`col_tiles` (P, S): the j-th position of group s is column
        ``128 · tiles[s] + j`` (``tiles`` = :func:`group_tiles`), zeros up to the group's last tile's
        end, qt[c, ·] · scale[c, tile] ≈ src[row(p), c]. Columns past ``128 · tiles[S]`` are unset.
    """
    if src.dim() != 2 or src.stride(1) != 1:
        raise ValueError(f"src must be a row-contiguous matrix, got shape {tuple(src.shape)} strides {src.stride()}")
    if (scale is not None) != (src.dtype == FP8_DTYPE) or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"an FP8 src needs its row scales and any other src none, and dtype is float32 or "
                         f"bfloat16; got src {src.dtype}, scale {'given' if scale is not None else 'none'}, {dtype}")
    P = layout.sorted_pair.numel()
    S = layout.offsets.numel() - 1
    C = src.shape[1]
    n_tiles = col_tiles(P, S)
    qt = torch.empty(C, n_tiles * TILE, dtype=FP8_DTYPE, device=src.device)
    st = torch.empty(C, n_tiles, dtype=torch.float32, device=src.device)
    if P and C and S:
        block_c = 64
        _quantize_cols_kernel[(n_tiles, triton.cdiv(C, block_c))](
            src, scale, qt, st, layout.sorted_pair, layout.offsets[:-1], layout.offsets[1:], S, C, src.stride(0),
            scale.stride(0) if scale is not None else 0, qt.stride(0), st.stride(0), TOP_K=top_k, GATHER=gather,
            SCALED=scale is not None, ROUND_BF16=dtype == torch.bfloat16, GROUPS_PAD=triton.next_power_of_2(S),
            BLOCK_C=block_c, EXACT_CAST=interpreting(), num_warps=4)
    return qt, st


@triton.jit
def _quantize_blocks_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, R, C, stride_wg, stride_wr, stride_qg, stride_qtg,
                            stride_sg, stride_sr, EXACT_CAST: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * 128 + tl.arange(0, 128)
    cols = tl.program_id(2) * 128 + tl.arange(0, 128)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    v = tl.load(w_ptr + g * stride_wg + rows[:, None].to(tl.int64) * stride_wr + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = tile_scale(tl.max(tl.max(tl.abs(v), axis=1), axis=0))
    q = to_e4m3(v, scale, EXACT_CAST)
    tl.store(q_ptr + g * stride_qg + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=mask)
    tl.store(qt_ptr + g * stride_qtg + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=mask)
    tl.store(s_ptr + g * stride_sg + tl.program_id(1) * stride_sr + tl.program_id(2), scale)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """128×128-block quantisation of stacked expert weights.

    Args: w [S, R, C] float32/bfloat16 (rows contiguous).
    Returns: q float8_e4m3fn [S, R, C], its transpose qt [S, C, R] (contiguous), and scale float32
        [S, cdiv(R, 128), cdiv(C, 128)]: w[s, r, c] ≈ q[s, r, c] * scale[s, r // 128, c // 128].
    """
    if w.dim() != 3 or w.stride(2) != 1:
        raise ValueError(f"w must be [S, R, C] with contiguous rows, got shape {tuple(w.shape)} strides {w.stride()}")
    S, R, C = w.shape
    q = torch.empty(S, R, C, dtype=FP8_DTYPE, device=w.device)
    qt = torch.empty(S, C, R, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(S, triton.cdiv(R, TILE), triton.cdiv(C, TILE), dtype=torch.float32, device=w.device)
    if S and R and C:
        _quantize_blocks_kernel[(S, triton.cdiv(R, TILE), triton.cdiv(C, TILE))](
            w, q, qt, s, R, C, w.stride(0), w.stride(1), q.stride(0), qt.stride(0), s.stride(0), s.stride(1),
            EXACT_CAST=interpreting(), num_warps=8)
    return q, qt, s


# ---------------------------------------------------------------------------------------------
# torch references (the numerics' definition) and dequantisation
# ---------------------------------------------------------------------------------------------


def _quantize_tiles(v: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` float32 with its tiles along ``dims`` already split out (size-1 elsewhere in the scale)."""
    amax = v.abs().amax(dim=dims, keepdim=True)
    # a tensor divisor, not the Python scalar: CUDA's torch multiplies by a scalar divisor's
    # float32 reciprocal (amax * fl(1/448) is one rounding off amax / 448 for some amax), the
    # CPU divides; a tensor divisor is divided, correctly rounded, on every device, as the
    # kernels' ``tl.div_rn`` does (ATen's div_true_kernel_cuda: "if the second operand is a CPU
    # scalar, compute a * reciprocal(b)")
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (v / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _pad_to(t: torch.Tensor, dim: int, mult: int) -> torch.Tensor:
    pad = (-t.shape[dim]) % mult
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def quantize_rows_reference(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`quantize_rows`."""
    M, C = x.shape
    n = triton.cdiv(C, TILE)  # (explicit sizes: a reshape to -1 is ambiguous with no rows)
    v = _pad_to(x.float(), 1, TILE).reshape(M, n, TILE)
    q, scale = _quantize_tiles(v, (2,))
    q, scale = q.reshape(M, n * TILE)[:, :C].contiguous(), scale.reshape(M, n)
    if out is None:
        return q, scale
    out[0].copy_(q)
    out[1].copy_(scale)
    return out


# ---------------------------------------------------------------- FP8 rows on the wire
def wire_row_bytes(hidden: int) -> int:
    """Bytes of one packed FP8 row: H E4M3 bytes, then cdiv(H, 128) float32 scales (H + 4·H/128)."""
    return hidden + 4 * triton.cdiv(hidden, TILE)


def packed_views(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [R, H], scale float32 [R, cdiv(H, 128)]): views into packed rows (uint8
    [R, :func:`wire_row_bytes`]), row stride the packed width; no copy. Needs H % 4 == 0 (the
    scales' alignment)."""
    if hidden % 4 or packed.dim() != 2 or packed.shape[1] != wire_row_bytes(hidden) or packed.dtype != torch.uint8:
        raise ValueError(f"expected uint8 rows of {wire_row_bytes(hidden)} bytes for H={hidden} (H % 4 == 0), "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    return packed[:, :hidden].view(FP8_DTYPE), packed[:, hidden:].view(torch.float32)


def pack_rows(x: torch.Tensor, quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] = quantize_rows
              ) -> torch.Tensor:
    """x [T, H] (float32/bfloat16, H % 4 == 0) → uint8 [T, H + 4·cdiv(H, 128)]: each row's 1×128
    quantisation (``quantize``: :func:`quantize_rows` or its reference) written straight into
    the wire rows, E4M3 bytes then the float32 scales (what the dispatch sends for FP8 experts)."""
    packed = torch.empty(x.shape[0], wire_row_bytes(x.shape[1]), dtype=torch.uint8, device=x.device)
    quantize(x.contiguous(), out=packed_views(packed, x.shape[1]))
    return packed


def quantize_cols_reference(src: torch.Tensor, layout: PairLayout, top_k: int, gather: bool,
                            scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`quantize_cols` (the columns past ``128 · tiles[S]`` are zeros here)."""
    if scale is not None:
        src = dequantize_rows(src, scale).to(dtype)
    P = layout.sorted_pair.numel()
    S = layout.offsets.numel() - 1
    n_tiles = col_tiles(P, S)
    offsets, tiles = layout.offsets.tolist(), group_tiles(layout.offsets).tolist()
    rows = torch.zeros(n_tiles * TILE, src.shape[1], dtype=torch.float32, device=src.device)
    for s in range(S):
        lo, hi = offsets[s], offsets[s + 1]
        idx = layout.sorted_pair[lo:hi].long() // top_k if gather else torch.arange(lo, hi, device=src.device)
        rows[tiles[s] * TILE: tiles[s] * TILE + hi - lo] = src[idx].float()
    C = src.shape[1]
    q, scale = _quantize_tiles(rows.t().reshape(C, n_tiles, TILE), (2,))
    return q.reshape(C, n_tiles * TILE), scale.reshape(C, n_tiles)


def quantize_blocks_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of :func:`quantize_blocks`."""
    S, R, C = w.shape
    v = _pad_to(_pad_to(w.float(), 1, TILE), 2, TILE)
    rb, cb = v.shape[1] // TILE, v.shape[2] // TILE
    q, scale = _quantize_tiles(v.reshape(S, rb, TILE, cb, TILE), (2, 4))
    q = q.reshape(S, rb * TILE, cb * TILE)[:, :R, :C].contiguous()
    return q, q.transpose(1, 2).contiguous(), scale.reshape(S, rb, cb)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [M, C] from 1×128 tiles (``quantize_rows``'s output; also ``quantize_cols``')."""
    return q.float() * scale.repeat_interleave(TILE, dim=1)[:, : q.shape[1]]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [S, R, C] from 128×128 blocks (``quantize_blocks``' q and scale)."""
    S, R, C = q.shape
    full = scale.repeat_interleave(TILE, dim=1).repeat_interleave(TILE, dim=2)
    return q.float() * full[:, :R, :C]
