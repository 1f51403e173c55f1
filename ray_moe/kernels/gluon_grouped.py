"""A Gluon (Triton 3.6 ``triton.experimental.gluon``) warp-specialised, persistent grouped GEMM
for Hopper (sm_90): the MoE down-projection ``out[p, :] = act[p, :] @ w2[s]`` for every row p of
group s, written like SonicMoE's / CUTLASS's sm90 kernels, which Triton's own compiler cannot
produce for our operands (docs/KERNELS.md, "What to try next", item 4).

Contract (the same grouping conventions as :mod:`ray_moe.kernels.grouped_tma`):

- ``act`` bf16 [P, I] row-contiguous; ``w2`` bf16 [S, I, H] contiguous, read through a 2-D
  descriptor over ``w2.view(S*I, H)`` (N-major: the B tile of group s at k is rows ``s*I + k``);
  ``offsets`` int32 [S+1] on the device, ``offsets[0] = 0``, non-decreasing, groups may be empty;
  ``out`` bf16 [P, H] row-contiguous. Rows in ``[offsets[S], P)`` are left unwritten.
- fp32 accumulation. The contraction never crosses an expert, so ``I % BLOCK_K == 0`` is
  required (:func:`down_gluon_ok` says so and callers fall back); every base and row stride is
  16-byte aligned.
- No host synchronisation: the number of row tiles is computed on the device from the offsets, so
  the launch can be captured in a CUDA graph.

Design
======

Two launches:

1. ``_tile_table_kernel`` (plain Triton, tiny): from the offsets, the table of row tiles in
   group order. ``table[0, 0]`` = the number of row tiles ``total_m`` (sum over groups of
   ``cdiv(rows_s, BLOCK_M)``); row ``1 + t`` = (group, first row, group end, 0) of row tile t.
   Its capacity is ``cdiv(P, BLOCK_M) + S`` tiles (an upper bound of ``total_m``). Splitting this
   out keeps the warp-specialised kernel free of cross-warp reductions (which the in-kernel
   version of ``grouped_tma`` does per tile) and lets the CPU interpreter test the tile mapping.

2. ``_down_ws_kernel`` (Gluon), persistent: ``min(SMs, total tiles upper bound)`` CTAs walk the
   output tiles ``tile = pid, pid + CTAs, ...`` below ``total_m * cdiv(H, BLOCK_N)``
   (``GROUP_M`` row tiles sweep every column tile before the next ones: the expert's weights and
   the rows stay in L2). Partitions (``gl.warp_specialize``):

   - **producer**, 1 warp (a worker partition, ``PRODUCER_REGS`` registers): for each tile and
     k-step, waits for the ring slot to be free (``empty[s]``), arms ``ready[s]`` with the
     expected byte count and issues two TMA loads: the A tile [BLOCK_M, BLOCK_K] at
     (first row, k) and the B tile [BLOCK_K, BLOCK_N] at (s*I + k, n0). An A tile may run past
     its group into the next group's rows, or past P (TMA fills zeros): those rows only reach
     output rows the epilogue does not store.
   - **consumer**, the default partition, ``num_warps`` warps = 1 or 2 warpgroups (a
     [BLOCK_M, BLOCK_N] fp32 accumulator in registers: 128x256 over 2 warpgroups or 128x128
     over 1 is 128 registers a thread): per k-step waits ``ready[s]``, issues an async
     ``warpgroup_mma`` (wgmma, operands straight from shared memory), waits until at most one
     is in flight and then frees the slot of the previous k-step (``empty``), so one wgmma
     always overlaps the next one's issue. The epilogue of a tile: wait for the last wgmma,
     free its slot, cast to bf16 and store. Full row tiles (all rows in the group) go
     registers -> shared memory -> TMA store (asynchronous: the TMA unit writes the tile while
     the consumer starts the next tile's wgmmas; the next epilogue first waits for it); the
     group's last, partial row tile is stored from registers with a row mask (a TMA store
     cannot stop at the group's end). ``EPI_TMA=False`` stores every tile with the masked
     stores (no output buffer in shared memory: room for one more ring stage).
   - The producer runs ahead by up to ``STAGES`` k-steps, so during the consumer's epilogue
     the next tile's first operand tiles are already arriving: the tensor cores only idle for
     the register -> shared memory copy of the accumulator (CUTLASS's "cooperative" schedule;
     its "ping-pong" one, two consumer warpgroups on alternate tiles, needs 64-row tiles per
     warpgroup and is not built here).

   Ring: ``STAGES`` slots of A (BLOCK_M x BLOCK_K) and B (BLOCK_K x BLOCK_N) in shared memory
   with NVMMA (128-byte swizzled) layouts, as the TMA writes and wgmma reads them; two mbarriers
   per slot (``ready``: TMA bytes arrived; ``empty``: the consumer is done with it). Phases: the
   k-step counter ``it`` runs on across tiles in both partitions (they walk the same tiles and
   k-steps), slot ``it % STAGES``, phase ``(it // STAGES) & 1``; the producer waits ``empty``
   with the opposite phase, which a fresh barrier passes at once.

   Shared memory (bf16): a ring stage is ``(BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N) * 2`` bytes
   (48 KiB at 128x256x64), the TMA epilogue buffer ``BLOCK_M*BLOCK_N*2`` (64 KiB at 128x256):
   128x256x64 fits 3 stages with the TMA epilogue (208 KiB) or 4 without (192 KiB); 128x128x64
   fits 5 with it (192 KiB). The sm_90 limit is 227 KiB.

   Registers: the kernel is launched with ``maxnreg = 65536 / (32 * warps)`` rounded down to 8
   (``warps`` = the consumer's warps plus one warpgroup for the producer: registers are
   reassigned per warpgroup with ``setmaxnreg``; 168 at 8 + 4 warps), so one CTA fits an SM;
   the producer warpgroup gives its registers up (``PRODUCER_REGS``, default 40) and the
   consumer warpgroups get the rest (232 a thread at 8 consumer warps, 256 at 4), as SonicMoE's
   56/224 split does. Compiled offline for sm_90 with Triton 3.6: no spills, 4
   ``HGMMA.64x256x16`` per k-step (128x256x64), ``UTMALDG`` loads, ``UTMASTG`` epilogue.

Status (session 26, one H100, docs/BENCHMARKS.md): equal to :func:`reference_grouped_rows` on
the GPU (tests/gpu/test_gluon_gpu.py: 20 passed, with empty groups, one group holding every row,
tails, many tiles per CTA and a CUDA-graph replay), but **not faster** than the Triton kernel it
would replace, so nothing calls it yet: at P=262144, I=1536, H=4096 its best tile (128x256x64,
3 stages, group 16) took 5.224 ms at E=128 and 5.036 at E=64 in one run, against 5.172 / 5.025
for ``grouped_tma``'s kernel with the same plain epilogue, and 6.111 / 5.767 in the next run
beside 5.132 / 5.024. What it lacks against SonicMoE's kernels: the epilogue overlapped with
the next tile's MMAs (two consumer warpgroups ping-ponging), and 2x1 cluster multicast of the
weight tiles. The offline compile (tests/unit/kernels/test_gluon_compile.py) checks that it
lowers to ``wgmma`` + ``cp.async.bulk.tensor`` (TMA) without spills; ``scripts/gluon_bench.py``
times it beside the Triton kernel and ``torch._grouped_mm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.5 with Gluon's Hopper pieces; the kernel targets 3.6's API
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    _GLUON_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    gluon = gl = None  # type: ignore[assignment]
    _GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

#: Dynamic shared memory of one sm_90 CTA (bytes).
SM90_SMEM = 232448


@dataclass(frozen=True)
class GluonDownConfig:
    """Tile and pipeline of :func:`launch_down_gluon`.

    ``block_m`` x ``block_n`` output tile, ``block_k`` contraction step; ``stages`` ring slots;
    ``num_warps`` consumer warps (4 or 8: one or two warpgroups; the accumulator is
    ``block_m*block_n/(32*num_warps)`` fp32 registers a thread, keep it at 128 or less);
    ``group_m`` row tiles swept across every column tile before the next; ``epi_tma`` TMA store
    of full row tiles (else masked stores only); ``producer_regs`` registers of the producer
    warpgroup (24..256, a multiple of 8); ``num_progs`` CTAs (0: one per SM; a runtime value,
    not a compile-time one, so tests can force many tiles per CTA without recompiling)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    num_warps: int = 8
    group_m: int = 8
    epi_tma: bool = True
    producer_regs: int = 40
    num_progs: int = 0

    def smem_bytes(self) -> int:
        """Shared memory of the ring, the epilogue buffer and the barriers (bf16 operands)."""
        ring = self.stages * (self.block_m * self.block_k + self.block_k * self.block_n) * 2
        epi = self.block_m * self.block_n * 2 if self.epi_tma else 0
        return ring + epi + 16 * self.stages + 1024  # barriers, alignment slack

    def maxnreg(self) -> int:
        """Registers a thread at launch: one CTA of (consumer warps + a producer warpgroup) per SM."""
        warps = self.num_warps + 4
        return min(248, (65536 // (32 * warps)) // 8 * 8)  # ptxas takes at most 255

    @staticmethod
    def parse(spec: str) -> "GluonDownConfig":
        """``BMxBNxBK:stages[:warps[:group_m[:epi[:preg]]]]``, e.g. ``128x256x64:3:8:8:tma:40``
        (``epi``: ``tma`` or ``masked``)."""
        parts = spec.split(":")
        bm, bn, bk = (int(v) for v in parts[0].lower().split("x"))
        kw: dict = dict(block_m=bm, block_n=bn, block_k=bk)
        if len(parts) > 1:
            kw["stages"] = int(parts[1])
        if len(parts) > 2:
            kw["num_warps"] = int(parts[2])
        if len(parts) > 3:
            kw["group_m"] = int(parts[3])
        if len(parts) > 4:
            if parts[4] not in ("tma", "masked"):
                raise ValueError(f"epilogue must be tma or masked, got {parts[4]!r}")
            kw["epi_tma"] = parts[4] == "tma"
        if len(parts) > 5:
            kw["producer_regs"] = int(parts[5])
        return GluonDownConfig(**kw)

    def name(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}:{self.stages}:{self.num_warps}:{self.group_m}:"
                f"{'tma' if self.epi_tma else 'masked'}:{self.producer_regs}")

    def check(self) -> None:
        """Raise ValueError for a tile the kernel cannot run (wgmma shapes, registers, smem)."""
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps must be 4 or 8 (one or two consumer warpgroups), got {self.num_warps}")
        if self.block_m % 64 or self.block_m < 64 * (self.num_warps // 4):
            raise ValueError(f"block_m {self.block_m}: wgmma needs 64 rows per consumer warpgroup")
        if self.block_n not in (64, 128, 256) or self.block_k not in (32, 64, 128):
            raise ValueError(f"unsupported tile {self.block_m}x{self.block_n}x{self.block_k}")
        if self.block_m * self.block_n // (32 * self.num_warps) > 128:
            raise ValueError(f"{self.block_m}x{self.block_n} over {self.num_warps} warps: accumulator over 128 registers")
        if self.stages < 2:
            raise ValueError("stages must be at least 2")
        if self.smem_bytes() > SM90_SMEM:
            raise ValueError(f"{self.name()} needs {self.smem_bytes()} bytes of shared memory (> {SM90_SMEM})")
        if not 24 <= self.producer_regs <= 256 or self.producer_regs % 8:
            raise ValueError(f"producer_regs must be a multiple of 8 in [24, 256], got {self.producer_regs}")


DEFAULT_CONFIG = GluonDownConfig()

#: The device sweep's candidates (scripts/gluon_bench.py --configs default).
SWEEP_CONFIGS = (
    "128x256x64:3:8:8:tma:40",
    "128x256x64:4:8:8:masked:40",
    "128x256x64:3:8:16:tma:40",
    "128x256x64:3:8:8:masked:40",
    "128x128x64:5:4:8:tma:40",
    "128x128x64:4:4:8:tma:40",
)


# ---------------------------------------------------------------------------------------------
# availability checks


#: Triton (major, minor) versions whose Gluon API the kernel is written for (Gluon changes between
#: releases: 3.9 renamed ``tma.async_copy_shared_to_global`` to ``async_store``, for one).
SUPPORTED_TRITON = ((3, 6),)


def _triton_version() -> tuple[int, int]:
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def gluon_available() -> bool:
    """Whether this Triton has Gluon with the Hopper pieces the kernel uses, in the API of a
    version it was written for (:data:`SUPPORTED_TRITON`)."""
    if _GLUON_IMPORT_ERROR is not None or _triton_version() not in SUPPORTED_TRITON:
        return False
    needed = (hasattr(gl, "warp_specialize"), hasattr(gl, "NVMMADistributedLayout"),
              hasattr(gl, "NVMMASharedLayout"), hasattr(tma, "async_copy_global_to_shared"),
              hasattr(tma, "async_copy_shared_to_global"), hasattr(mbarrier, "expect"))
    return all(needed)


def gluon_unavailable_reason() -> str | None:
    """Why :func:`gluon_available` is False (None when it is True)."""
    if _GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon (Hopper) not importable: {_GLUON_IMPORT_ERROR}"
    if _triton_version() not in SUPPORTED_TRITON:
        return (f"the kernel is written for Triton {', '.join('%d.%d' % v for v in SUPPORTED_TRITON)}'s Gluon API, "
                f"this is Triton {triton.__version__}")
    if not gluon_available():
        return f"Triton {triton.__version__}'s Gluon lacks the Hopper API this kernel uses"
    return None


def _tma_2d_ok(t: torch.Tensor) -> bool:
    return (t.dim() == 2 and t.shape[0] > 0 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0 and t.shape[1] * t.element_size() >= 16)


def down_gluon_ok(act: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor | None = None,
                  cfg: GluonDownConfig = DEFAULT_CONFIG) -> bool:
    """Whether :func:`launch_down_gluon` can run this problem: Gluon present, CUDA tensors on an
    sm_90 GPU, bf16 act [P, I] / w2 [S, I, H] (contiguous) / out [P, H], int32 offsets [S+1],
    ``I % cfg.block_k == 0``, TMA-compatible (16-byte aligned) bases and row strides, P > 0.
    False means: use another kernel."""
    if not gluon_available():
        return False
    try:
        cfg.check()
    except ValueError:
        return False
    if not (act.is_cuda and w2.is_cuda and offsets.is_cuda):
        return False
    if torch.cuda.get_device_capability(act.device) != (9, 0):
        return False
    if act.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16 or offsets.dtype != torch.int32:
        return False
    if act.dim() != 2 or w2.dim() != 3 or w2.shape[1] != act.shape[1] or not w2.is_contiguous():
        return False
    S, I, H = w2.shape
    if offsets.dim() != 1 or offsets.numel() != S + 1 or S == 0:
        return False
    if I % cfg.block_k or act.shape[0] == 0 or H == 0:
        return False
    if not _tma_2d_ok(act) or not _tma_2d_ok(w2.view(S * I, H)):
        return False
    if out is not None:
        if out.dtype != torch.bfloat16 or out.shape != (act.shape[0], H) or not out.is_cuda or not _tma_2d_ok(out):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# reference


def reference_grouped_rows(act: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[p] = act[p] @ w2[s] for the rows p of group s (float32 [P, H]; rows past offsets[S] 0).

    act [P, I], w2 [S, I, H], offsets int32 [S+1] (any device; read on the host)."""
    P, S, H = act.shape[0], w2.shape[0], w2.shape[2]
    out = torch.zeros(P, H, dtype=torch.float32, device=act.device)
    bounds = offsets.tolist()
    for s in range(S):
        lo, hi = bounds[s], bounds[s + 1]
        if hi > lo:
            out[lo:hi] = act[lo:hi].float() @ w2[s].float()
    return out


# ---------------------------------------------------------------------------------------------
# tile table (plain Triton)

TABLE_COLS = 4  # (group, first row, group end, unused) per row tile; row 0 = (total_m, 0, 0, 0)


@triton.jit
def _tile_table_kernel(offsets_ptr, table_ptr, n_groups, n_rows, max_tiles, BLOCK_M: tl.constexpr,
                       GROUPS_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Row tiles of the groups, in group order: table[1 + t] = (group, first row, group end, 0)
    for t < total_m; program 0 also writes table[0] = (total_m, 0, 0, 0). Entries past total_m are
    written as (0, 0, 0, 0) (never read). Group bounds are clamped to ``n_rows``, so offsets past
    the output's rows never lead to a store past it."""
    g = tl.arange(0, GROUPS_PAD)
    g_ok = g < n_groups
    starts = tl.minimum(tl.load(offsets_ptr + g, mask=g_ok, other=0), n_rows)
    ends = tl.minimum(tl.load(offsets_ptr + g + 1, mask=g_ok, other=0), n_rows)
    tiles = tl.where(g_ok, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, axis=0)  # inclusive
    total = tl.sum(tiles, axis=0)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # group of tile t: the number of groups whose tiles all come before it
    group = tl.sum((cum[None, :] <= t[:, None]).to(tl.int32), axis=1)
    mine = g[None, :] == group[:, None]
    first_tile = tl.sum(tl.where(mine, (cum - tiles)[None, :], 0), axis=1)
    start = tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
    end = tl.sum(tl.where(mine, ends[None, :], 0), axis=1)
    valid = t < total
    row0 = tl.where(valid, start + (t - first_tile) * BLOCK_M, 0)
    base = table_ptr + (1 + t) * 4
    in_table = t < max_tiles
    tl.store(base + 0, tl.where(valid, group, 0), mask=in_table)
    tl.store(base + 1, row0, mask=in_table)
    tl.store(base + 2, tl.where(valid, end, 0), mask=in_table)
    tl.store(base + 3, tl.zeros_like(t), mask=in_table)
    if tl.program_id(0) == 0:
        tl.store(table_ptr + 0, total)
        tl.store(table_ptr + 1, 0)
        tl.store(table_ptr + 2, 0)
        tl.store(table_ptr + 3, 0)


def tile_table_capacity(n_rows: int, n_groups: int, block_m: int) -> int:
    """Upper bound of the row tiles of ``n_groups`` groups over ``n_rows`` rows."""
    return triton.cdiv(n_rows, block_m) + n_groups


def build_tile_table(offsets: torch.Tensor, n_rows: int, block_m: int, table: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [1 + capacity, 4] tile table of ``offsets`` (int32 [S+1]) on offsets' device, one
    launch, no synchronisation (see ``_tile_table_kernel``). ``table``: reuse this buffer."""
    S = offsets.numel() - 1
    cap = tile_table_capacity(n_rows, S, block_m)
    if table is None:
        table = torch.empty(1 + cap, TABLE_COLS, dtype=torch.int32, device=offsets.device)
    elif table.dtype != torch.int32 or table.shape[0] < 1 + cap or table.shape[1:] != (TABLE_COLS,) \
            or not table.is_contiguous():
        raise ValueError(f"table must be contiguous int32 [>= {1 + cap}, {TABLE_COLS}], got {table.dtype} "
                         f"{tuple(table.shape)}")
    pad = max(16, triton.next_power_of_2(max(S, 1)))
    block_t = max(16, min(128, 8192 // pad))
    grid = (triton.cdiv(cap, block_t),)
    _tile_table_kernel[grid](offsets, table, S, n_rows, cap, BLOCK_M=block_m, GROUPS_PAD=pad, BLOCK_T=block_t, num_warps=4)
    return table


def tile_table_reference(offsets: torch.Tensor, n_rows: int, block_m: int) -> torch.Tensor:
    """Plain-torch (host) version of :func:`build_tile_table`'s meaningful entries:
    int32 [1 + total_m, 4]."""
    bounds = [min(b, n_rows) for b in offsets.tolist()]
    rows = []
    for s in range(len(bounds) - 1):
        for r0 in range(bounds[s], bounds[s + 1], block_m):
            rows.append((s, r0, bounds[s + 1], 0))
    return torch.tensor([(len(rows), 0, 0, 0)] + rows, dtype=torch.int32).reshape(-1, TABLE_COLS)


# ---------------------------------------------------------------------------------------------
# the Gluon kernel

if gluon is not None:

    @gluon.jit
    def _tile_coords(tile, total_m, num_n, GROUP_M: gl.constexpr):
        """(row tile, column tile) of the linear output tile ``tile``: GROUP_M row tiles sweep all
        column tiles before the next ones (ray_moe.kernels.tiles.swizzle)."""
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        size_m = min(total_m - first_m, GROUP_M)
        tile_m = first_m + (tile % width) % size_m
        pid_n = (tile % width) // size_m
        return tile_m, pid_n

    @gluon.jit
    def _producer_partition(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, table_ptr, N, KD,
                            GROUP_M: gl.constexpr):
        """One warp: TMA loads of every (tile, k-step) into the ring, in the consumer's order."""
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        TILE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        total_m = gl.load(table_ptr)
        num_n = gl.cdiv(N, BLOCK_N)
        n_k = KD // BLOCK_K
        it = 0
        for tile in range(gl.program_id(0), total_m * num_n, gl.num_programs(0)):
            tile_m, pid_n = _tile_coords(tile, total_m, num_n, GROUP_M)
            entry = table_ptr + (1 + tile_m) * 4
            group = gl.load(entry)
            row0 = gl.load(entry + 1)
            b_row = group * KD
            n0 = pid_n * BLOCK_N
            for kk in range(n_k):
                slot = it % STAGES
                phase = (it // STAGES) & 1
                # a fresh barrier is in phase 0: waiting for the parity of phase "-1" passes at once
                mbarrier.wait(empty_bars.index(slot), phase ^ 1)
                bar = ready_bars.index(slot)
                mbarrier.expect(bar, TILE_BYTES)
                tma.async_copy_global_to_shared(a_desc, [row0, kk * BLOCK_K], bar, a_bufs.index(slot))
                tma.async_copy_global_to_shared(b_desc, [b_row + kk * BLOCK_K, n0], bar, b_bufs.index(slot))
                it += 1

    @gluon.jit
    def _consumer_partition(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_smem, ready_bars, empty_bars, out_ptr,
                            table_ptr, N, KD, stride_om, GROUP_M: gl.constexpr, EPI_TMA: gl.constexpr,
                            num_warps: gl.constexpr):
        """The default partition (``num_warps`` warps): async wgmma over the ring, then the epilogue."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        dtype: gl.constexpr = c_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
        total_m = gl.load(table_ptr)
        num_n = gl.cdiv(N, BLOCK_N)
        n_k = KD // BLOCK_K
        it = 0
        for tile in range(gl.program_id(0), total_m * num_n, gl.num_programs(0)):
            tile_m, pid_n = _tile_coords(tile, total_m, num_n, GROUP_M)
            entry = table_ptr + (1 + tile_m) * 4
            row0 = gl.load(entry + 1)
            row_end = gl.load(entry + 2)
            n0 = pid_n * BLOCK_N

            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for kk in range(n_k):
                slot = it % STAGES
                phase = (it // STAGES) & 1
                mbarrier.wait(ready_bars.index(slot), phase)
                a_buf = a_bufs.index(slot)
                b_buf = b_bufs.index(slot)
                acc = warpgroup_mma(a_buf, b_buf, acc, is_async=True)
                # at most this k-step's wgmma in flight: the previous one has read its slot
                acc, a_buf, b_buf = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_buf, b_buf))
                mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES), pred=kk > 0)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES))

            out = acc.to(dtype)
            if EPI_TMA and row_end - row0 >= BLOCK_M:
                tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
                c_smem.store(out)
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [row0, n0], c_smem)
            else:
                rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
                cols = n0 + gl.arange(0, BLOCK_N, layout=col_layout)
                ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
                mask = (rows < row_end)[:, None] & (cols < N)[None, :]
                gl.store(ptrs, out, mask=mask)
        if EPI_TMA:
            tma.store_wait(pendings=0)

    @gluon.jit
    def _down_ws_kernel(a_desc, b_desc, c_desc, out_ptr, table_ptr, N, KD, stride_om,
                        STAGES: gl.constexpr, GROUP_M: gl.constexpr, EPI_TMA: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """out[rows of group s, :] = A[rows, :] @ B[s*KD : (s+1)*KD, :] over the row tiles of
        ``table_ptr`` (see the module docstring). a_desc: act [P, KD] bf16, block [BM, BK];
        b_desc: w2 viewed [S*KD, N] bf16, block [BK, BN]; c_desc: out [P, N] bf16, block [BM, BN]."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
        if EPI_TMA:
            c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
        else:
            c_smem = gl.allocate_shared_memory(dtype, [8, 8], c_desc.layout)  # unused
        ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_bars.index(i), count=1)
            mbarrier.init(empty_bars.index(i), count=1)
        fence_async_shared()  # the barriers' initialisation is visible to the TMA unit

        gl.warp_specialize([
            (_consumer_partition, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_smem, ready_bars, empty_bars, out_ptr,
                                   table_ptr, N, KD, stride_om, GROUP_M, EPI_TMA, num_warps)),
            (_producer_partition, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, table_ptr, N, KD,
                                   GROUP_M)),
        ], [1], [PRODUCER_REGS])

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready_bars.index(i))
            mbarrier.invalidate(empty_bars.index(i))


def _layouts(cfg: GluonDownConfig):
    """NVMMA shared layouts (bf16) of the A, B and C tiles, as TMA writes and wgmma reads them."""
    a = gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], gl.bfloat16)
    b = gl.NVMMASharedLayout.get_default_for([cfg.block_k, cfg.block_n], gl.bfloat16)
    c = gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_n], gl.bfloat16)
    return a, b, c


def persistent_programs(device: torch.device, cfg: GluonDownConfig, n_rows: int, n_groups: int, n_cols: int) -> int:
    """CTAs of the persistent launch on CUDA ``device``: one per SM (or ``cfg.num_progs``), at
    most the tiles."""
    progs = cfg.num_progs or torch.cuda.get_device_properties(device).multi_processor_count
    max_tiles = tile_table_capacity(n_rows, n_groups, cfg.block_m) * triton.cdiv(n_cols, cfg.block_n)
    return max(1, min(progs, max_tiles))


def launch_down_gluon(act: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor | None = None,
                      cfg: GluonDownConfig = DEFAULT_CONFIG, table: torch.Tensor | None = None) -> torch.Tensor:
    """out[p] = act[p] @ w2[s] for the rows p of group s (bf16, fp32 accumulation).

    Args:
        act: bf16 [P, I], row-contiguous, 16-byte aligned rows. w2: bf16 [S, I, H] contiguous.
        offsets: int32 [S+1] on the device (offsets[0] = 0, non-decreasing, offsets[S] <= P).
        out: bf16 [P, H] to write (allocated if None); rows past offsets[S] are not written.
        cfg: tile / ring / partition choice (:class:`GluonDownConfig`).
        table: int32 [1 + cdiv(P, block_m) + S, 4] scratch for the tile table (allocated if None).
    Returns ``out``. Two launches (tile table, GEMM), no host synchronisation (graph-capturable).
    Caller checks :func:`down_gluon_ok` first (raises ValueError otherwise)."""
    if not down_gluon_ok(act, w2, offsets, out, cfg):
        raise ValueError("launch_down_gluon: unsupported problem (check down_gluon_ok: sm_90, bf16, "
                         f"I % {cfg.block_k} == 0, TMA alignment); {gluon_unavailable_reason() or ''}")
    P, I = act.shape
    S, _, H = w2.shape
    if out is None:
        out = torch.empty(P, H, dtype=act.dtype, device=act.device)
    table = build_tile_table(offsets, P, cfg.block_m, table)
    a_layout, b_layout, c_layout = _layouts(cfg)
    a_desc = GluonTensorDescriptor.from_tensor(act, [cfg.block_m, cfg.block_k], a_layout)
    b_desc = GluonTensorDescriptor.from_tensor(w2.view(S * I, H), [cfg.block_k, cfg.block_n], b_layout)
    c_desc = GluonTensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n], c_layout)
    progs = persistent_programs(act.device, cfg, P, S, H)
    _down_ws_kernel[(progs,)](
        a_desc, b_desc, c_desc, out, table, H, I, out.stride(0),
        STAGES=cfg.stages, GROUP_M=cfg.group_m, EPI_TMA=cfg.epi_tma,
        PRODUCER_REGS=cfg.producer_regs, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg(),
    )
    return out


def compile_down_sm90(cfg: GluonDownConfig = DEFAULT_CONFIG) -> dict:
    """Compile ``_down_ws_kernel`` for sm_90 without a GPU (Triton ships ptxas), specialised as
    the launcher specialises it on the device (divisible-by-16 integers). Returns the compiled
    kernel's ``asm`` dict (``ttgir``, ``ptx``, ``cubin``...) and its ``n_regs``/``n_spills``
    where the compiled object reports them (``metadata``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    reason = gluon_unavailable_reason()
    if reason:
        raise RuntimeError(f"compile_down_sm90: {reason}")
    cfg.check()
    a_layout, b_layout, c_layout = _layouts(cfg)

    def desc_ty(block, layout):
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"

    signature = {
        "a_desc": desc_ty([cfg.block_m, cfg.block_k], a_layout),
        "b_desc": desc_ty([cfg.block_k, cfg.block_n], b_layout),
        "c_desc": desc_ty([cfg.block_m, cfg.block_n], c_layout),
        "out_ptr": "*bf16", "table_ptr": "*i32", "N": "i32", "KD": "i32", "stride_om": "i32",
        "STAGES": "constexpr", "GROUP_M": "constexpr", "EPI_TMA": "constexpr",
        "PRODUCER_REGS": "constexpr", "num_warps": "constexpr",
    }
    constexprs = {"STAGES": cfg.stages, "GROUP_M": cfg.group_m, "EPI_TMA": cfg.epi_tma,
                  "PRODUCER_REGS": cfg.producer_regs, "num_warps": cfg.num_warps}
    # the launcher's specialisation: pointers 16-byte aligned, N / KD / stride multiples of 16
    attrs = {(k,): [["tt.divisibility", 16]] for k in (3, 4, 5, 6, 7)}
    src = GluonASTSource(fn=_down_ws_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg()})
    return {"asm": compiled.asm, "metadata": compiled.metadata}
