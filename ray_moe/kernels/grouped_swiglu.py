"""Grouped GEMMs of the SwiGLU experts over pairs grouped by slot (see routing.pair_layout).

Two kernels, each parameterised by constexprs rather than copied:

``_grouped_rows_kernel``: out[p, n] = epilogue(sum_k A[row(p), k] * B_s[k, n]) for the positions p
    of group s. ``row(p)`` is ``sorted_pair[p] // K`` (the input row of the pair: the gather is
    fused into the A loads) or p itself (a per-position tensor). Tiles are scheduled over the
    ragged groups on the device: every program reads the group offsets, finds its group from
    the cumulative tile counts, and exits if its tile is past the last one. The grid is fixed
    by shapes alone (cdiv(R*K, BLOCK_M) + S row tiles), so nothing waits on the host.
    Epilogues:
      PLAIN       store acc                                      (dX rows)
      SCALE       store acc * weight[pair]                       (down GEMM, forward)
      SWIGLU      two accumulators gate|up; store silu(g)*u, and g|u when saving pre-activations
``_grouped_wgrad_kernel``: dW_s[m, n] = sum_{p in group s} A[rowA(p), m] * B[rowB(p), n] with
    either side gathered; one program per (group, m tile, n tile), full contraction in registers,
    so an empty group stores exactly zero.
``_swiglu_bwd_rows_kernel``: the SwiGLU backward per position from G = grad_out[row] @ w2_s^T
    (a PLAIN row GEMM): d(g|u), weight * a (for dW2) and the router-weight gradient.

Each launcher checks shapes, dtypes and devices; each has a pure-torch reference below it.
Weight layout: w13 [S, H, 2I] (gate = [..., :I], up = [..., I:]), w2 [S, I, H].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ray_moe.kernels.empty_groups import zero_empty_groups
from ray_moe.kernels.gather_sum import gather_pair_rows
from ray_moe.kernels.routing import PairLayout
from ray_moe.kernels.tiles import (
    EPI_PLAIN,
    EPI_SCALE,
    EPI_SWIGLU,
    ACT_CLAMPED,
    ZERO_TAIL,
    act_params,
    load_row_scale,
    store_forward_epilogue,
    swizzle,
)


# the grouped GEMMs of one expert_ffn call, each a KernelPlan field with its own tiles
GEMM_ROLES = ("gate_up", "down", "dact", "dx", "wgrad13", "wgrad2")


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipelining of one grouped GEMM launch.

    ``tma``: run the Hopper variant of :mod:`ray_moe.kernels.grouped_tma` (tensor descriptors
    for the operands that are not gathered) where the shapes allow it, else the pointer kernel.
    ``persistent``: (tma only) one program per SM walking the tiles; ``flatten``: let the
    pipeliner overlap a tile's epilogue with the next tile's loads (persistent only).
    ``one_dot``: (gate_up, pointer kernel) the gate and up columns loaded as one
    [block_k, 2·block_n] operand for one dot, so the A tile is read once per step instead of
    twice (SonicMoE's up-projection is one 128×256 tile); where I is not a multiple of 8 or the
    weights' columns are strided, the two dots. The Hopper default since the H100 sweep of 2026-11-26.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False
    persistent: bool = False
    flatten: bool = False
    one_dot: bool = False

    def __post_init__(self) -> None:
        if max(self.block_m, self.block_n, self.block_k) > ZERO_TAIL:
            raise ValueError(f"GemmConfig blocks must be at most {ZERO_TAIL} (ZERO_TAIL), got "
                             f"{self.block_m}x{self.block_n}x{self.block_k}")


def default_config(role: str, dtype: torch.dtype, device: torch.device) -> GemmConfig:
    """Tile choice per GEMM role (gate_up, down, dact, dx, wgrad13, wgrad2).

    Small tiles on the CPU interpreter and for float32 (tests); for bf16/fp16 the best of the
    sweeps (docs/KERNELS.md): pointer kernels before Hopper; on it TMA / persistent ones, and
    the one-dot pointer kernel for the up-projection.
    """
    if device.type != "cuda" or dtype == torch.float32:
        return GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)
    # Hopper: the H100 sweep at T=32768, H=4096, I=1536, E=128, K=8 (2026-11-23),
    # among the variants that also passed the bf16 checks on the GPU. gate_up: the sweep and layer
    # A/B on H100 of 2026-11-26: one 128x256 dot over the gate and up columns (pointer kernel, 4 stages:
    # 192 KB of shared memory) is 6.5-7.3 % faster alone than the TMA persistent two-dot
    # kernel, the expert FFN's forward 3-6 % faster. Older GPUs: the two-dot pointer kernel.
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    flat = dict(tma=hopper, persistent=hopper, flatten=hopper)
    return {
        # gate | up: one [128, 256] accumulator on Hopper, two 128x128 ones before
        "gate_up": GemmConfig(128, 128, 64, 8, 8, 4, one_dot=True) if hopper else GemmConfig(128, 128, 64, 8, 8, 3),
        "down": GemmConfig(128, 256, 64, 8, 8, 3 if hopper else 4, **flat),
        "dact": GemmConfig(128, 256, 64, 8, 8, 3, tma=hopper),  # plain GEMM, then the elementwise kernel
        "dx": GemmConfig(128, 256, 64, 8, 8, 3, **flat),
        "wgrad13": GemmConfig(128, 64, 64, 8, 4, 4, tma=hopper),  # dual accumulators (gate|up): 128x128 per program
        "wgrad2": GemmConfig(128, 128, 64, 8, 8, 5 if hopper else 4, tma=hopper),
    }[role]


@dataclass(frozen=True)
class KernelPlan:
    """Tiles of every GEMM of one expert_ffn call; whether dW13 computes its gate and up halves
    in one program (two accumulators sharing the x^T tile); and whether the weight gradients run in Triton, through ``torch._grouped_mm`` or through quack's
    varlen-K GEMM (``wgrad``, one of :data:`WGRAD_BACKENDS`)."""

    gate_up: GemmConfig
    down: GemmConfig
    dact: GemmConfig
    dx: GemmConfig
    wgrad13: GemmConfig
    wgrad2: GemmConfig
    dual_wgrad13: bool = True
    wgrad: str = "triton"  # triton | grouped_mm | quack: who computes dW13 and dW2 (WGRAD_BACKENDS)


def default_plan(dtype: torch.dtype, device: torch.device) -> KernelPlan:
    """The plan used when none is given: the same kernels on every device and dtype (the CPU
    interpreter and float32 run the GPU's path with small tiles)."""
    return KernelPlan(**{r: default_config(r, dtype, device) for r in GEMM_ROLES})


@triton.jit
def _tile_of_groups(starts_ptr, ends_ptr, n_groups, tile_m, BLOCK_M: tl.constexpr, GROUPS_PAD: tl.constexpr):
    """Map the global row-tile index to (group, first position, group end, number of row tiles).
    Group g is positions [starts[g], ends[g]) (a layout's offsets and offsets + 1, or a subset)."""
    g = tl.arange(0, GROUPS_PAD)
    g_ok = g < n_groups
    starts = tl.load(starts_ptr + g, mask=g_ok, other=0)
    ends = tl.load(ends_ptr + g, mask=g_ok, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    group = tl.sum((cum <= tile_m).to(tl.int32), axis=0)
    mine = g == group
    first_tile = tl.sum(tl.where(mine, cum - tiles, 0), axis=0)
    start = tl.sum(tl.where(mine, starts, 0), axis=0)
    end = tl.sum(tl.where(mine, ends, 0), axis=0)
    return group, start + (tile_m - first_tile) * BLOCK_M, end, total


@triton.jit
def _grouped_rows_kernel(
    a_ptr, b_ptr, out_ptr, aux_ptr, weight_ptr, bias_ptr, starts_ptr, ends_ptr, sorted_pair_ptr,
    n_groups, max_m_tiles, N, KD, half,
    stride_am, stride_bg, stride_bk, stride_bn, stride_om, stride_xm, stride_bias,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, EPILOGUE: tl.constexpr, SAVE_AUX: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUPS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ONE_DOT: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    ACT: tl.constexpr = 0, ALPHA: tl.constexpr = 0.0, LIMIT: tl.constexpr = 0.0,
):
    """See the module docstring. ``half`` = I: column offset of the up half in w13 / h13.
    ONE_DOT (EPI_SWIGLU, unit column stride, half % 8 == 0): gate and up columns as one operand.
    HAS_BIAS / ACT / ALPHA / LIMIT: the epilogue's bias and activation (tiles.store_forward_epilogue)."""
    num_n = tl.cdiv(N, BLOCK_N)
    tile_m, pid_n = swizzle(tl.program_id(0), max_m_tiles, num_n, GROUP_M)
    group, row_start, row_end, total = _tile_of_groups(starts_ptr, ends_ptr, n_groups, tile_m, BLOCK_M, GROUPS_PAD)
    if tile_m >= total:
        return
    rm = row_start + tl.arange(0, BLOCK_M)
    row_ok = rm < row_end
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    if GATHER_A or EPILOGUE == EPI_SCALE:
        pair = tl.load(sorted_pair_ptr + rm, mask=row_ok, other=0)
    else:
        pair = rm  # not read
    row_scale = load_row_scale(pair, row_ok, weight_ptr, EPILOGUE, BLOCK_M)
    if GATHER_A:
        a_row = (pair // TOP_K).to(tl.int64)
    else:
        a_row = rm.to(tl.int64)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + group.to(tl.int64) * stride_bg + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    up_off = half * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ONE_DOT:
        # columns [gate n0 .. n0+BN) | [up half+n0 .. half+n0+BN): two contiguous runs of BLOCK_N
        # that start at multiples of 8, so the loads stay vectorised
        c2 = tl.arange(0, 2 * BLOCK_N)
        n2 = pid_n * BLOCK_N + c2 % BLOCK_N
        col2 = tl.max_contiguous(tl.multiple_of(tl.where(c2 < BLOCK_N, n2, n2 + half), 8), BLOCK_N)
        b2_ptrs = b_ptr + group.to(tl.int64) * stride_bg + rk[:, None] * stride_bk + col2[None, :]
        acc2 = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, KD, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b2 = tl.load(b2_ptrs, mask=(n2 < N)[None, :], other=0.0)
            else:
                k_ok = (k0 + rk) < KD
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b2 = tl.load(b2_ptrs, mask=k_ok[:, None] & (n2 < N)[None, :], other=0.0)
            acc2 = tl.dot(a, b2, acc2, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b2_ptrs += BLOCK_K * stride_bk
        acc, acc_up = tl.split(tl.permute(tl.reshape(acc2, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
    else:
        for k0 in range(0, KD, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + rk) < KD
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if EPILOGUE == EPI_SWIGLU:
                if EVEN_K:
                    b_up = tl.load(b_ptrs + up_off, mask=col_ok[None, :], other=0.0)
                else:
                    b_up = tl.load(b_ptrs + up_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk

    out_mask = row_ok[:, None] & col_ok[None, :]
    rm64 = rm.to(tl.int64)
    out_ptrs = out_ptr + rm64[:, None] * stride_om + rn[None, :]
    store_forward_epilogue(acc, acc_up, out_ptrs, out_mask, rm64, rn, row_scale, aux_ptr, stride_xm, half, EPILOGUE,
                           SAVE_AUX, bias_ptr, group, stride_bias, N, HAS_BIAS, ACT, ALPHA, LIMIT)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, sorted_pair_ptr, M, N, half,
    stride_am, stride_bm, stride_og, stride_om,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, DUAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[s, m, n] = sum over positions p of group s of A[rowA(p), m] * B[rowB(p), n].

    DUAL: N is the width of one half; the program also computes columns ``half + n`` with a
    second accumulator that shares the A tile (dW13's gate and up halves)."""
    group = tl.program_id(1)
    pid_m, pid_n = swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    start = tl.load(offsets_ptr + group)
    end = tl.load(offsets_ptr + group + 1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for p0 in range(start, end, BLOCK_K):
        rp = p0 + tl.arange(0, BLOCK_K)
        p_ok = rp < end
        if GATHER_A or GATHER_B:
            pair = tl.load(sorted_pair_ptr + rp, mask=p_ok, other=0)
        if GATHER_A:
            a_row = (pair // TOP_K).to(tl.int64)
        else:
            a_row = rp.to(tl.int64)
        if GATHER_B:
            b_row = (pair // TOP_K).to(tl.int64)
        else:
            b_row = rp.to(tl.int64)
        a = tl.load(a_ptr + a_row[None, :] * stride_am + rm[:, None], mask=m_ok[:, None] & p_ok[None, :], other=0.0)
        b_ptrs = b_ptr + b_row[:, None] * stride_bm + rn[None, :]
        b = tl.load(b_ptrs, mask=p_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if DUAL:
            b_up = tl.load(b_ptrs + half, mask=p_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + group.to(tl.int64) * stride_og + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    if DUAL:
        tl.store(out_ptrs + half, acc_up.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _swiglu_bwd_rows_kernel(
    g_ptr, h13_ptr, weight_ptr, sorted_pair_ptr, n_valid_ptr, dh13_ptr, aw_ptr, dw_ptr, n_pos, I,
    go_ptr, b2_ptr, offsets_ptr, n_groups, H, stride_go,
    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, ZERO_TAIL: tl.constexpr,
    ACT: tl.constexpr = 0, ALPHA: tl.constexpr = 0.0, LIMIT: tl.constexpr = 0.0,
    HAS_BIAS: tl.constexpr = False, TOP_K: tl.constexpr = 1, GROUPS_PAD: tl.constexpr = 1,
):
    """Per position p < n_valid, from G = grad_out[row] @ w2_s^T [P, I] and h13 = g|u [P, 2I]:
    dh13 = weight * (G * da/dg | G * da/du), aw = weight * a, dw[p] = <a, G> (a = the gated
    activation ACT of g|u: SwiGLU, or the clamped one, whose derivative is zero where a clamp
    holds, as autograd of torch.clamp gives). HAS_BIAS: dw[p] += <grad_out[row], b2[s]> (the
    down bias is inside the routing weight's product; s found from ``offsets``; grad_out [R, H]).
    dw is written for every p < n_pos (0 past n_valid); dh13 and aw up to ZERO_TAIL rows past
    n_valid (zeros there: their loads are masked to 0), which is as far as a weight-gradient
    kernel's descriptor tile reads past the last group. An EP rank has about half its positions
    past n_valid, and zeroing all of them cost 0.26 ms (H200 x2, --ep-profile)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n_valid = tl.load(n_valid_ptr)
    if tl.program_id(0) * BLOCK_R >= n_valid + ZERO_TAIL:  # nothing to write but dw's zeros
        tl.store(dw_ptr + rows, tl.zeros([BLOCK_R], dtype=tl.float32), mask=rows < n_pos)
        return
    ok = rows < n_valid
    pair = tl.load(sorted_pair_ptr + rows, mask=ok, other=0)
    w = tl.load(weight_ptr + pair, mask=ok, other=0.0)
    r64 = rows.to(tl.int64)
    dw = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, I, BLOCK_I):
        cols = c0 + tl.arange(0, BLOCK_I)
        m = ok[:, None] & (cols < I)[None, :]
        st = ((rows < n_pos) & (rows < n_valid + ZERO_TAIL))[:, None] & (cols < I)[None, :]
        g = tl.load(g_ptr + r64[:, None] * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
        gate = tl.load(h13_ptr + r64[:, None] * (2 * I) + cols[None, :], mask=m, other=0.0).to(tl.float32)
        up = tl.load(h13_ptr + r64[:, None] * (2 * I) + I + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if ACT == ACT_CLAMPED:
            gc = tl.minimum(gate, LIMIT)
            uc = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            sig = tl.sigmoid(ALPHA * gc)
            glu = gc * sig
            act = (uc + 1.0) * glu
            dw += tl.sum(act * g, axis=1)
            d_act = g * w[:, None]
            d_gate = tl.where(gate <= LIMIT, d_act * (uc + 1.0) * sig * (1.0 + ALPHA * gc * (1.0 - sig)), 0.0)
            d_up = tl.where((up >= -LIMIT) & (up <= LIMIT), d_act * glu, 0.0)
        else:  # the plain SwiGLU specialisation, in its original order of operations
            sig = tl.sigmoid(gate)
            silu = gate * sig
            act = silu * up
            dw += tl.sum(act * g, axis=1)
            d_act = g * w[:, None]
            d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
            d_up = d_act * silu
        tl.store(dh13_ptr + r64[:, None] * (2 * I) + cols[None, :], d_gate.to(dh13_ptr.dtype.element_ty), mask=st)
        tl.store(dh13_ptr + r64[:, None] * (2 * I) + I + cols[None, :], d_up.to(dh13_ptr.dtype.element_ty), mask=st)
        tl.store(aw_ptr + r64[:, None] * I + cols[None, :], (act * w[:, None]).to(aw_ptr.dtype.element_ty), mask=st)
    if HAS_BIAS:
        gi = tl.arange(0, GROUPS_PAD)
        ends = tl.load(offsets_ptr + 1 + gi, mask=gi < n_groups, other=2147483647)
        group = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)  # valid rows: < n_groups
        grow = (pair // TOP_K).to(tl.int64)
        for h0 in range(0, H, BLOCK_I):
            hc = h0 + tl.arange(0, BLOCK_I)
            mh = ok[:, None] & (hc < H)[None, :]
            go = tl.load(go_ptr + grow[:, None] * stride_go + hc[None, :], mask=mh, other=0.0).to(tl.float32)
            bias = tl.load(b2_ptr + group.to(tl.int64)[:, None] * H + hc[None, :], mask=mh, other=0.0).to(tl.float32)
            dw += tl.sum(go * bias, axis=1)
    tl.store(dw_ptr + rows, dw, mask=rows < n_pos)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(f"{name_a} is on {a.device} but {name_b} on {b.device}")
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} is {a.dtype} but {name_b} is {b.dtype}; use one dtype")


def _check_matrix(name: str, t: torch.Tensor, rows: int | None = None, cols: int | None = None) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be a row-contiguous matrix, got shape {tuple(t.shape)} strides {t.stride()}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got {t.shape[0]}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got {t.shape[1]}")
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _check_bias(name: str, bias: torch.Tensor | None, S: int, cols: int, like: torch.Tensor) -> None:
    if bias is None:
        return
    if tuple(bias.shape) != (S, cols) or bias.stride(1) != 1:
        raise ValueError(f"{name} must be a row-contiguous [{S}, {cols}] bias, got {tuple(bias.shape)} "
                         f"strides {bias.stride()}")
    _check_same(name, bias, "the activations", like)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_rows(
    *, a: torch.Tensor, b: torch.Tensor, b_strides: tuple[int, int, int], out: torch.Tensor,
    layout: PairLayout, top_k: int, gather_a: bool, epilogue: int, n_cols: int, kd: int, half: int,
    cfg: GemmConfig, aux: torch.Tensor | None = None, weight: torch.Tensor | None = None, save_aux: bool = False,
    bias: torch.Tensor | None = None, act: tuple[int, float, float] = (0, 0.0, 0.0),
) -> None:
    """One grouped row GEMM over the layout's groups (group s with b[s]): the Hopper descriptor
    kernel where ``cfg.tma`` asks for it and the shapes allow it, else the pointer kernel.
    ``bias`` [S, cols] (row-contiguous): added per group in the SCALE / SWIGLU epilogues;
    ``act``: (ACT, ALPHA, LIMIT) of :func:`~ray_moe.kernels.tiles.act_params` for SWIGLU."""
    n_pos = layout.sorted_pair.numel()
    starts, ends = layout.offsets, layout.offsets[1:]
    n_groups = ends.numel()
    if n_pos == 0 or n_cols == 0 or n_groups == 0:
        return
    if cfg.tma:
        from ray_moe.kernels import grouped_tma

        b_kmajor = b_strides[1] == 1 and b_strides[2] != 1
        if grouped_tma.rows_tma_ok(a, b, b_kmajor, gather_a, kd, cfg):
            grouped_tma.launch_rows_tma(
                a=a, b=b, b_kmajor=b_kmajor, out=out, starts=starts, ends=ends, sorted_pair=layout.sorted_pair,
                top_k=top_k, gather_a=gather_a, epilogue=epilogue, n_cols=n_cols, kd=kd, half=half, cfg=cfg,
                dot_precision=_dot_precision(a.dtype), aux=aux, weight=weight, save_aux=save_aux, bias=bias, act=act,
            )
            return
    max_m_tiles = triton.cdiv(n_pos, cfg.block_m) + n_groups
    grid = (max_m_tiles * triton.cdiv(n_cols, cfg.block_n),)
    dummy = out
    _grouped_rows_kernel[grid](
        a, b, out, dummy if aux is None else aux, dummy if weight is None else weight, dummy if bias is None else bias,
        starts, ends, layout.sorted_pair, n_groups, max_m_tiles, n_cols, kd, half,
        a.stride(0), b_strides[0], b_strides[1], b_strides[2], out.stride(0), 0 if aux is None else aux.stride(0),
        0 if bias is None else bias.stride(0),
        TOP_K=top_k, GATHER_A=gather_a, EPILOGUE=epilogue, SAVE_AUX=save_aux,
        EVEN_K=kd % cfg.block_k == 0, DOT_PRECISION=_dot_precision(a.dtype),
        GROUPS_PAD=triton.next_power_of_2(n_groups),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ONE_DOT=cfg.one_dot and epilogue == EPI_SWIGLU.value and half % 8 == 0 and b_strides[2] == 1,
        HAS_BIAS=bias is not None, ACT=act[0], ALPHA=act[1], LIMIT=act[2],
    )


def _check_layout(layout: PairLayout, n_slots: int, n_pairs: int, device: torch.device) -> None:
    if layout.offsets.numel() != n_slots + 1:
        raise ValueError(f"layout has {layout.offsets.numel() - 1} groups, weights have {n_slots} slots")
    if layout.sorted_pair.numel() != n_pairs:
        raise ValueError(f"layout has {layout.sorted_pair.numel()} pairs, expected {n_pairs}")
    if layout.sorted_pair.device != device:
        raise ValueError(f"layout on {layout.sorted_pair.device}, tensors on {device}")


def gate_up_swiglu(
    x: torch.Tensor, layout: PairLayout, top_k: int, w13: torch.Tensor,
    save_preact: bool = True, cfg: GemmConfig | None = None, act=None, b13: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """act[p] = act(g, u) with g|u = x[row(p)] @ w13_s (+ b13[s]) for every valid position p.

    Args:
        x: [R, H] float32/bfloat16, row-contiguous. layout: PairLayout of slot [R, top_k].
        w13: [S, H, 2I] same dtype, contiguous.
        save_preact: also return the pre-activations g|u (bias included).
        act: the gated activation (None: silu(g) · u; else ``kind``/``alpha``/``limit`` as
            ``ray_moe.model.experts.ExpertActivation``). b13: optional [S, 2I] bias (x.dtype).
    Returns:
        act [R*K, I] and h13 [R*K, 2I] (or None), x.dtype; rows past offsets[S] are unset.
    """
    _check_matrix("x", x)
    _check_same("x", x, "w13", w13)
    if w13.dim() != 3 or w13.shape[1] != x.shape[1] or w13.shape[2] % 2:
        raise ValueError(f"w13 must be [S, H={x.shape[1]}, 2I], got {tuple(w13.shape)}")
    w13 = w13.contiguous()
    S, H, I2 = w13.shape
    I = I2 // 2
    P = x.shape[0] * top_k
    _check_layout(layout, S, P, x.device)
    _check_bias("b13", b13, S, I2, x)
    cfg = cfg or default_config("gate_up", x.dtype, x.device)
    out = torch.empty(P, I, dtype=x.dtype, device=x.device)
    h13 = torch.empty(P, I2, dtype=x.dtype, device=x.device) if save_preact else None
    _launch_rows(
        a=x, b=w13, b_strides=(w13.stride(0), w13.stride(1), w13.stride(2)), out=out, aux=h13,
        layout=layout, top_k=top_k, gather_a=True, epilogue=EPI_SWIGLU.value, n_cols=I, kd=H, half=I, cfg=cfg,
        save_aux=save_preact, bias=b13, act=act_params(act),
    )
    return out, h13


def down_scaled(
    act: torch.Tensor, layout: PairLayout, top_k: int, weight: torch.Tensor, w2: torch.Tensor,
    cfg: GemmConfig | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[p] = weight[pair(p)] * (act[p] @ w2_s (+ b2[s])).

    Args: act [R*K, I]; weight float32 [R, K] contiguous; w2 [S, I, H] (act's dtype); b2: optional
        [S, H] bias (act's dtype).
    Returns: y [R*K, H] in act.dtype; rows past offsets[S] are unset.
    """
    _check_matrix("act", act)
    _check_same("act", act, "w2", w2)
    if w2.dim() != 3 or w2.shape[1] != act.shape[1]:
        raise ValueError(f"w2 must be [S, I={act.shape[1]}, H], got {tuple(w2.shape)}")
    if weight.dtype != torch.float32 or weight.numel() != act.shape[0]:
        raise ValueError(f"weight must be float32 with {act.shape[0]} entries, got {weight.dtype} {tuple(weight.shape)}")
    w2 = w2.contiguous()
    S, I, H = w2.shape
    _check_layout(layout, S, act.shape[0], act.device)
    _check_bias("b2", b2, S, H, act)
    cfg = cfg or default_config("down", act.dtype, act.device)
    y = torch.empty(act.shape[0], H, dtype=act.dtype, device=act.device)
    _launch_rows(
        a=act, b=w2, b_strides=(w2.stride(0), w2.stride(1), w2.stride(2)), out=y, weight=weight.contiguous(),
        layout=layout, top_k=top_k, gather_a=False, epilogue=EPI_SCALE.value, n_cols=H, kd=I, half=0, cfg=cfg,
        bias=b2,
    )
    return y


def swiglu_backward_rows(
    grad_out: torch.Tensor, layout: PairLayout, top_k: int, weight: torch.Tensor, w2: torch.Tensor,
    h13: torch.Tensor, cfg: GemmConfig | None = None, act=None, b2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward through the down GEMM and the gated activation, per position.

    With G[p] = grad_out[row(p)] @ w2_s^T and a = act(g, u) recomputed from h13:
    dh13[p] = weight * (dg | du), aw[p] = weight * a, and d_weight_pos[p] = <a, G> (+ <grad_out[row],
    b2[s]> with the down bias) (= <grad_out[row], a @ w2_s + b2[s]>, the router-weight gradient).
    Two kernels: the row GEMM stores G in grad_out.dtype (``cfg``'s tiles), then an elementwise
    kernel reads it back.

    Args: grad_out [R, H]; weight float32 [R, K]; w2 [S, I, H]; h13 [R*K, 2I] saved pre-activations;
        act: as :func:`gate_up_swiglu`; b2: the optional down bias [S, H].
    Returns: dh13 [R*K, 2I], aw [R*K, I] (grad_out.dtype), d_weight_pos float32 [R*K]
        (0 past offsets[S]; dh13 / aw rows past it are zero for ZERO_TAIL rows, unset beyond).
    """
    _check_matrix("grad_out", grad_out)
    _check_same("grad_out", grad_out, "w2", w2)
    _check_same("grad_out", grad_out, "h13", h13)
    w2 = w2.contiguous()
    S, I, H = w2.shape
    P = grad_out.shape[0] * top_k
    _check_matrix("h13", h13, rows=P, cols=2 * I)
    if grad_out.shape[1] != H:
        raise ValueError(f"grad_out must have H={H} columns, got {grad_out.shape[1]}")
    _check_layout(layout, S, P, grad_out.device)
    _check_bias("b2", b2, S, H, grad_out)
    cfg = cfg or default_config("dact", grad_out.dtype, grad_out.device)
    dh13 = torch.empty(P, 2 * I, dtype=grad_out.dtype, device=grad_out.device)
    aw = torch.empty(P, I, dtype=grad_out.dtype, device=grad_out.device)
    weight = weight.contiguous()
    w2_t = (w2.stride(0), w2.stride(2), w2.stride(1))  # B[k=h, n=i] = w2[s, i, h]
    g = torch.empty(P, I, dtype=grad_out.dtype, device=grad_out.device)
    _launch_rows(
        a=grad_out, b=w2, b_strides=w2_t, out=g,
        layout=layout, top_k=top_k, gather_a=True, epilogue=EPI_PLAIN.value, n_cols=I, kd=H, half=0, cfg=cfg,
    )
    dw_pos = torch.empty(P, dtype=torch.float32, device=grad_out.device)
    gated_act_backward_rows(g, h13, weight, layout, dh13, aw, dw_pos, act=act, grad_out=grad_out, b2=b2,
                            top_k=top_k)
    return dh13, aw, dw_pos


def gated_act_backward_rows(
    g: torch.Tensor, h13: torch.Tensor, weight: torch.Tensor, layout: PairLayout,
    dh13: torch.Tensor, aw: torch.Tensor, dw_pos: torch.Tensor, act=None,
    grad_out: torch.Tensor | None = None, b2: torch.Tensor | None = None, top_k: int = 1,
) -> None:
    """The elementwise half of :func:`swiglu_backward_rows` (launcher of ``_swiglu_bwd_rows_kernel``),
    also the FP8 experts' (whose G comes from an FP8 GEMM).

    Args: g = G [P, I]; h13 [P, 2I] (g's dtype); weight float32 [R, K]; outputs written in place:
        dh13 [P, 2I], aw [P, I] (g's dtype), dw_pos float32 [P]; act as :func:`gate_up_swiglu`;
        b2 [S, H] the optional down bias, with grad_out [R, H] (its rows add <grad_out[row], b2[s]>).
    """
    P, I = g.shape
    if not P:
        return
    S = layout.offsets.numel() - 1
    block_i = min(256, triton.next_power_of_2(I))
    block_r = max(1, 2048 // block_i)
    mode, alpha, limit = act_params(act)
    if b2 is None:
        bias, go, b, H, stride_go = {}, g, g, 0, 0
    else:
        bias = dict(HAS_BIAS=True, TOP_K=top_k, GROUPS_PAD=triton.next_power_of_2(S))
        go, b, H, stride_go = grad_out, b2.contiguous(), b2.shape[1], grad_out.stride(0)
    _swiglu_bwd_rows_kernel[(triton.cdiv(P, block_r),)](
        g, h13, weight.contiguous(), layout.sorted_pair, layout.offsets[-1:], dh13, aw, dw_pos, P, I,
        go, b, layout.offsets, S, H, stride_go,
        BLOCK_R=block_r, BLOCK_I=block_i, ZERO_TAIL=ZERO_TAIL, ACT=mode, ALPHA=alpha, LIMIT=limit, **bias,
    )


def dgrad_rows(dh13: torch.Tensor, layout: PairLayout, top_k: int, w13: torch.Tensor, cfg: GemmConfig | None = None) -> torch.Tensor:
    """dxs[p] = dh13[p] @ w13_s^T.

    Args: dh13 [R*K, 2I]; w13 [S, H, 2I] (dh13's dtype).
    Returns: dxs [R*K, H] in dh13.dtype; rows past offsets[S] are unset.
    """
    _check_matrix("dh13", dh13)
    _check_same("dh13", dh13, "w13", w13)
    w13 = w13.contiguous()
    S, H, I2 = w13.shape
    if dh13.shape[1] != I2:
        raise ValueError(f"dh13 must have 2I={I2} columns, got {dh13.shape[1]}")
    _check_layout(layout, S, dh13.shape[0], dh13.device)
    cfg = cfg or default_config("dx", dh13.dtype, dh13.device)
    dxs = torch.empty(dh13.shape[0], H, dtype=dh13.dtype, device=dh13.device)
    # B[k=j, n=h] = w13[s, h, j]
    _launch_rows(
        a=dh13, b=w13, b_strides=(w13.stride(0), w13.stride(2), w13.stride(1)), out=dxs,
        layout=layout, top_k=top_k, gather_a=False, epilogue=EPI_PLAIN.value, n_cols=H, kd=I2, half=0, cfg=cfg,
    )
    return dxs


def grouped_wgrad(
    a_src: torch.Tensor, b_src: torch.Tensor, layout: PairLayout, top_k: int,
    gather_a: bool, gather_b: bool, role: str = "wgrad13", cfg: GemmConfig | None = None,
    dual: bool = False,
) -> torch.Tensor:
    """dW[s] = A_s^T @ B_s where A_s / B_s are the rows of group s (gathered through the pair's
    input row when ``gather_*``, else taken at the position itself).

    Args:
        a_src: [R or R*K, M]; b_src: [R or R*K, N]; same dtype, row-contiguous.
        dual: compute the two column halves of B in one program sharing the A tile (N even).
        cfg.tma (one side gathered): the side taken by position goes through a TMA descriptor;
            its rows outside the groups (positions >= offsets[S]) must then be finite.
    Returns:
        [S, M, N] in a_src.dtype; exactly zero for slots with no pairs.
    """
    _check_matrix("a_src", a_src)
    _check_matrix("b_src", b_src)
    _check_same("a_src", a_src, "b_src", b_src)
    S = layout.offsets.numel() - 1
    M, N = a_src.shape[1], b_src.shape[1]
    if dual and N % 2:
        raise ValueError(f"dual needs an even number of B columns, got {N}")
    cfg = cfg or default_config(role, a_src.dtype, a_src.device)
    out = torch.empty(S, M, N, dtype=a_src.dtype, device=a_src.device)
    if M == 0 or N == 0:
        return out
    n_cols = N // 2 if dual else N
    if cfg.tma and gather_a != gather_b and (gather_a or not dual):
        from ray_moe.kernels import grouped_tma

        if grouped_tma.tma_ok(b_src if gather_a else a_src):
            grouped_tma.launch_wgrad_tma(
                a_src=a_src, b_src=b_src, out=out, offsets=layout.offsets, sorted_pair=layout.sorted_pair,
                top_k=top_k, gather_a=gather_a, dual=dual, n_cols=n_cols, cfg=cfg,
                dot_precision=_dot_precision(a_src.dtype),
            )
            return out
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(n_cols, cfg.block_n), S)
    _grouped_wgrad_kernel[grid](
        a_src, b_src, out, layout.offsets, layout.sorted_pair, M, n_cols, n_cols,
        a_src.stride(0), b_src.stride(0), out.stride(0), out.stride(1),
        TOP_K=top_k, GATHER_A=gather_a, GATHER_B=gather_b, DUAL=dual, DOT_PRECISION=_dot_precision(a_src.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


WGRAD_BACKENDS = ("triton", "grouped_mm", "quack")  # quack: see ray_moe.kernels.quack_wgrad


def grouped_wgrad_mm(
    a_src: torch.Tensor, b_src: torch.Tensor, layout: PairLayout, top_k: int, gather_a: bool, gather_b: bool,
) -> torch.Tensor:
    """:func:`grouped_wgrad` through ``torch._grouped_mm`` (groups along the contraction).

    The gathered side is materialised in position order first (a transient [R*K, M or N]
    tensor, its valid positions only: :func:`~ray_moe.kernels.gather_sum.gather_pair_rows`),
    which the Triton kernel avoids; in exchange the GEMM runs at cuBLAS/CUTLASS speed.
    Positions past the last group are never read (``offs`` ends there). Slots with no pairs are
    zeroed explicitly rather than trusting the library with empty groups, and only those
    (:func:`~ray_moe.kernels.empty_groups.zero_empty_groups`: a masked fill over every slot cost
    a full pass over the gradient).

    Args/returns as :func:`grouped_wgrad`; needs rows of 16-byte multiples (library rule).
    """
    _check_matrix("a_src", a_src)
    _check_matrix("b_src", b_src)
    _check_same("a_src", a_src, "b_src", b_src)
    for name, t in (("a_src", a_src), ("b_src", b_src)):
        if (t.shape[1] * t.element_size()) % 16:
            raise ValueError(f"grouped_wgrad_mm needs {name} rows of a multiple of 16 bytes, got "
                             f"{t.shape[1]} x {t.element_size()} bytes; use the triton backend")
    a = gather_pair_rows(a_src, layout, top_k) if gather_a else a_src
    b = gather_pair_rows(b_src, layout, top_k) if gather_b else b_src
    offs = layout.offsets[1:].contiguous()
    out = torch._grouped_mm(a.t(), b, offs=offs)
    return zero_empty_groups(out, layout.offsets)


# ---------------------------------------------------------------------------------------------
# pure-torch references (float32 math, one loop over groups; valid positions only)
# ---------------------------------------------------------------------------------------------


def _groups(layout: PairLayout):
    offsets = layout.offsets.tolist()
    for s in range(len(offsets) - 1):
        yield s, offsets[s], offsets[s + 1]


def _rows_of(layout: PairLayout, top_k: int, lo: int, hi: int) -> torch.Tensor:
    return layout.sorted_pair[lo:hi].long() // top_k


def gated_act_reference(h13: torch.Tensor, act=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated activation of g|u = ``h13`` [P, 2I] and its partial derivatives, float32:
    (a, da/dg, da/du), each [P, I]. ``act`` as :func:`gate_up_swiglu`; the clamped form's
    derivatives are zero where a clamp holds (torch.clamp's gradient: kept at the bound)."""
    mode, alpha, limit = act_params(act)
    gate, up = h13.float().chunk(2, dim=-1)
    if mode == ACT_CLAMPED.value:
        gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
        sig = torch.sigmoid(alpha * gc)
        glu = gc * sig
        d_gate = ((uc + 1) * sig * (1 + alpha * gc * (1 - sig))) * (gate <= limit)
        return (uc + 1) * glu, d_gate, glu * ((up >= -limit) & (up <= limit))
    sig = torch.sigmoid(gate)
    return gate * sig * up, up * sig * (1 + gate * (1 - sig)), gate * sig


def gate_up_swiglu_reference(x, layout, top_k, w13, act=None, b13=None):
    """Reference of :func:`gate_up_swiglu` → (act, h13) float32, unset rows 0."""
    P, I2 = layout.sorted_pair.numel(), w13.shape[2]
    h13 = torch.zeros(P, I2, dtype=torch.float32, device=x.device)
    for s, lo, hi in _groups(layout):
        h13[lo:hi] = x[_rows_of(layout, top_k, lo, hi)].float() @ w13[s].float()
        if b13 is not None:
            h13[lo:hi] += b13[s].float()
    return gated_act_reference(h13, act)[0], h13


def down_scaled_reference(act, layout, top_k, weight, w2, b2=None):
    """Reference of :func:`down_scaled` (float32)."""
    y = torch.zeros(act.shape[0], w2.shape[2], dtype=torch.float32, device=act.device)
    wflat = weight.reshape(-1).float()
    for s, lo, hi in _groups(layout):
        pairs = layout.sorted_pair[lo:hi].long()
        y[lo:hi] = act[lo:hi].float() @ w2[s].float()
        if b2 is not None:
            y[lo:hi] += b2[s].float()
        y[lo:hi] *= wflat[pairs, None]
    return y


def swiglu_backward_rows_reference(grad_out, layout, top_k, weight, w2, h13, act=None, b2=None):
    """Reference of :func:`swiglu_backward_rows` (float32)."""
    P, I = h13.shape[0], w2.shape[1]
    g_all = torch.zeros(P, I, dtype=torch.float32, device=grad_out.device)
    dw_bias = torch.zeros(P, dtype=torch.float32, device=grad_out.device)
    for s, lo, hi in _groups(layout):
        go = grad_out[_rows_of(layout, top_k, lo, hi)].float()
        g_all[lo:hi] = go @ w2[s].float().T
        if b2 is not None:
            dw_bias[lo:hi] = go @ b2[s].float()
    w = torch.zeros(P, dtype=torch.float32, device=grad_out.device)
    n_valid = int(layout.offsets[-1])
    w[:n_valid] = weight.reshape(-1).float()[layout.sorted_pair[:n_valid].long()]
    a, da_dg, da_du = gated_act_reference(h13, act)
    d_act = g_all * w[:, None]
    return torch.cat([d_act * da_dg, d_act * da_du], dim=1), a * w[:, None], (a * g_all).sum(1) + dw_bias


def dgrad_rows_reference(dh13, layout, top_k, w13):
    """Reference of :func:`dgrad_rows` (float32)."""
    out = torch.zeros(dh13.shape[0], w13.shape[1], dtype=torch.float32, device=dh13.device)
    for s, lo, hi in _groups(layout):
        out[lo:hi] = dh13[lo:hi].float() @ w13[s].float().T
    return out


def grouped_wgrad_reference(a_src, b_src, layout, top_k, gather_a, gather_b):
    """Reference of :func:`grouped_wgrad` (float32)."""
    S = layout.offsets.numel() - 1
    out = torch.zeros(S, a_src.shape[1], b_src.shape[1], dtype=torch.float32, device=a_src.device)
    for s, lo, hi in _groups(layout):
        ia = _rows_of(layout, top_k, lo, hi) if gather_a else torch.arange(lo, hi, device=a_src.device)
        ib = _rows_of(layout, top_k, lo, hi) if gather_b else torch.arange(lo, hi, device=a_src.device)
        out[s] = a_src[ia].float().T @ b_src[ib].float()
    return out
