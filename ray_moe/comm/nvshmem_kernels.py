"""Triton kernels of the NVSHMEM transport: rank-dedup dispatch and combine over symmetric memory.

Two persistent kernels, each run by a grid of ``G`` programs (G ≤ number of SMs, equal on every
rank). Program ``p`` of every rank owns token chunk ``p`` of its own tokens
(``[p*C, min((p+1)*C, T))``, ``C = max(1, ceil(T/G))``) and, on the receiving side, the rows that
program ``p`` of each peer sent. That pairing lets each program signal and wait per chunk, so
copy-out and reduction overlap with the peers' sends instead of waiting for a whole exchange.

Symmetric memory (owned by :class:`ray_moe.comm.nvshmem.SymmetricBuffer`) holds, per channel,
one *region* per source rank::

    region = [chunk meta: G x (start, end, total, 0) int32, padded to CM_BYTES]
             [rows:      T_cap x ROW_BYTES      (row j of the source's list for this rank)]
             [row meta:  T_cap x 2*KMAX int32  (K slots, then K float32 weights as bits)]

plus int64 words: ``flag[W, G]`` (arrivals per source and program), ``rsig[W]`` (arrivals of
whole regions put by NVSHMEM on the remote path) and ``ack[W]`` (how many programs of each peer
finished reading what this rank wrote: back-pressure before a region is overwritten).

Every counter is cumulative. Each program keeps its own call counter ``ctr[p]`` (ordinary
device memory), so no host value changes between calls and the kernels can be captured in a
CUDA graph. Every spin is bounded by ``spin_limit`` iterations; on timeout the program writes a
code into ``err`` and carries on (the data are then wrong, but nothing hangs), and the host checks
``err`` outside the hot path (:meth:`SymmetricBuffer.check`).

Error codes (``err[0]`` holds the largest, ``err[1]`` the peer rank involved):
1 layout prefix (programs of this rank not co-resident), 2 back-pressure ack from a peer,
3 rows from a peer (dispatch channel), 4 rows from a peer (combine channel).

The layout's pure-torch reference is the tests' (tests/references.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

# int32 words of a buffer's device error record, written by the wait that timed out (the last one)
ERROR_WORDS = ("code", "peer", "program", "wanted_lo", "wanted_hi", "seen_lo", "seen_hi", "spare")

# timer slots per program of a stamped exchange (:func:`_stamp`), and what each kernel's slots
# mark (each after the step named: the stage's time is its slot minus the one before). Slots
# written inside the per-source loops keep the last source's time, so at W=2 a step's share of the
# own rows' work differs by rank (rank 0's "peers' arrival" includes its own copy-out), and only
# the last peer is seen at W > 2; one thread stamps, so warps' lag before a barrier counts in the
# step after it.
STAMP_SLOTS: tl.constexpr = tl.constexpr(8)
DISPATCH_STAMPS = ("start", "layout", "ack wait", "rows out", "arrival signal", "peers' arrival",
                   "copy-out", "acknowledge")
COMBINE_STAMPS = ("start", "ack wait", "rows out", "arrival signal", "peers' arrival", "sums", "acknowledge")

# ----------------------------------------------------------------------------------- helpers


@triton.jit
def _wait_ge(ptr, target, spin_limit, err_ptr, code, peer):
    """Spin (acquire, system scope) until *ptr >= target, at most spin_limit polls. A timeout
    records the error word (:data:`ERROR_WORDS`): code, peer, program, and the value wanted and
    last seen (low and high 32 bits: an interleave progress word is (call + 1) << 32 | rows)."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    i = 0
    while (v < target) & (i < spin_limit):
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        i += 1
    if v < target:
        tl.atomic_max(err_ptr, code)
        tl.atomic_xchg(err_ptr + 1, peer)
        want = target.to(tl.int64)
        seen = v.to(tl.int64)
        tl.atomic_xchg(err_ptr + 2, tl.program_id(0))
        tl.atomic_xchg(err_ptr + 3, (want & 0xFFFFFFFF).to(tl.int32))
        tl.atomic_xchg(err_ptr + 4, (want >> 32).to(tl.int32))
        tl.atomic_xchg(err_ptr + 5, (seen & 0xFFFFFFFF).to(tl.int32))
        tl.atomic_xchg(err_ptr + 6, (seen >> 32).to(tl.int32))


@triton.jit
def _signal(addr, value):
    """Make this program's earlier stores visible, then add ``value`` at a (peer) address."""
    tl.debug_barrier()
    tl.atomic_add(addr.to(tl.pointer_type(tl.int64)), value, sem="release", scope="sys")


@triton.jit
def _publish(addr, value):
    """Make this program's earlier stores visible, then set the (peer) word at ``addr`` to ``value``."""
    tl.debug_barrier()
    tl.atomic_xchg(addr.to(tl.pointer_type(tl.int64)), value, sem="release", scope="sys")


@triton.jit
def _stamp(stamp_ptr, pid, i: tl.constexpr, STAMPS: tl.constexpr):
    """STAMPS: the global nanosecond timer into stamp_ptr[pid, i] (int64 [G, STAMP_SLOTS]): where
    a program's time goes, read by ``bench comm``'s latency floor. Compiled out otherwise."""
    if STAMPS:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
        tl.store(stamp_ptr + pid * STAMP_SLOTS + i, t)


@triton.jit
def _rows_of(base, rows, cols, ROW_ELEMS: tl.constexpr, COLS: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointers [R, COLS] to columns ``cols`` [COLS] (contiguous, starting at a multiple of COLS) of
    rows ``rows`` [R] of a row-major array with ROW_ELEMS elements per row at pointer ``base``.

    ALIGNED (base 16-byte aligned and rows a multiple of 16 bytes) adds the hints that let Triton
    emit 16-byte vector accesses. Without them, addresses built from an integer (peer pointers,
    symmetric regions) and even some of ordinary tensors compile to one 2-byte access per element
    (seen in the PTX), which made the NVLink traffic latency-bound. The hints must sit on the op that
    computes the pointers, hence this function.
    """
    p = base + rows[:, None].to(tl.int64) * ROW_ELEMS + cols[None, :]
    if ALIGNED:
        p = tl.max_contiguous(tl.multiple_of(p, [16, 16]), [1, COLS])
    return p


@triton.jit
def _row_block(addr, rows, cols, ROW_ELEMS: tl.constexpr, ELEM: tl.constexpr, COLS: tl.constexpr):
    """:func:`_rows_of` for an array at byte address ``addr`` (int64 scalar) in a symmetric region
    (or its local staging copy), which is always aligned: regions are 256-byte multiples inside
    their allocation, CM_BYTES is a multiple of 256, ROW_BYTES of 16, and row meta is 8*KMAX bytes
    per row with KMAX a multiple of 4."""
    return _rows_of(addr.to(tl.pointer_type(ELEM)), rows, cols, ROW_ELEMS, COLS, True)


@triton.jit
def _column(mat, col_ids, d):
    """mat[:, d] of an int tensor [R, W_PAD] as [R]."""
    return tl.sum(tl.where(col_ids[None, :] == d, mat, 0), axis=1)


@triton.jit
def _exclusive_prefix(hit, BLOCK_R: tl.constexpr):
    """Exclusive prefix sum over the rows of hit [BLOCK_R, W_PAD] (int32), as a triangular sum.

    ``tl.cumsum`` here trips an assertion in Triton 3.6's scan lowering (ScanOpToLLVM.cpp,
    ``AddPartialReduceOneWarp``) when G <= 32 programs; BLOCK_R is small, so the [R, R, W_PAD]
    product costs nothing.
    """
    r = tl.arange(0, BLOCK_R)
    before = (r[None, :] < r[:, None]).to(tl.int32)  # [i, j]: row j comes before row i
    return tl.sum(before[:, :, None] * hit[None, :, :], axis=1)


@triton.jit
def _chunk(T, pid, G: tl.constexpr):
    C = tl.maximum((T + G - 1) // G, 1)
    t0 = tl.minimum(pid * C, T)
    t1 = tl.minimum(t0 + C, T)
    return t0, t1


@triton.jit
def _copy_in(region, j0, j1, s, out_x_ptr, out_slot_ptr, out_w_ptr, T_cap, meta_base, rrow, hcol, kcol,
             ELEM: tl.constexpr, ROW_ELEMS: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
             K_PAD: tl.constexpr, KMAX: tl.constexpr, CM_BYTES: tl.constexpr, HAS_META: tl.constexpr,
             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ALIGNED: tl.constexpr):
    """Received rows [j0, j1) of source ``s`` (and their slot/weight meta) from its region at byte
    address ``region`` to rows ``s*T_cap + j`` of the outputs."""
    for jb in range(j0, j1, BLOCK_R):
        j = jb + rrow
        jm = j < j1
        out_row = (s * T_cap + j).to(tl.int64)
        for hb in tl.static_range(0, H, BLOCK_H):
            h = hb + hcol
            hm = h < H
            src = _row_block(region + CM_BYTES, j, h, ROW_ELEMS, ELEM, BLOCK_H)
            v = tl.load(src, mask=jm[:, None] & hm[None, :], cache_modifier=".cg")
            tl.store(_rows_of(out_x_ptr, out_row, h, H, BLOCK_H, ALIGNED), v, mask=jm[:, None] & hm[None, :])
        if HAS_META:
            _copy_meta_block(region, j, jm, out_row, out_slot_ptr, out_w_ptr, meta_base, kcol, K, K_PAD, KMAX)


@triton.jit
def _copy_meta_block(region, j, jm, out_row, out_slot_ptr, out_w_ptr, meta_base, kcol,
                     K: tl.constexpr, K_PAD: tl.constexpr, KMAX: tl.constexpr):
    """The slot/weight meta of received rows ``j`` (mask ``jm``) from the region at byte address
    ``region`` to rows ``out_row`` of out_slot / out_w."""
    kmask = kcol[None, :] < K
    mrow = _row_block(region + meta_base, j, kcol, 2 * KMAX, tl.int32, K_PAD)
    slot = tl.load(mrow, mask=jm[:, None] & kmask, cache_modifier=".cg")
    wgt = tl.load((mrow + KMAX).to(tl.pointer_type(tl.float32)), mask=jm[:, None] & kmask, cache_modifier=".cg")
    tl.store(out_slot_ptr + out_row[:, None] * K + kcol[None, :], slot, mask=jm[:, None] & kmask)
    tl.store(out_w_ptr + out_row[:, None] * K + kcol[None, :], wgt, mask=jm[:, None] & kmask)


@triton.jit
def _pad_meta(out_slot_ptr, out_w_ptr, s, tot, T_cap, pid, rrow, kcol, G: tl.constexpr, K: tl.constexpr,
              K_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """Padding rows [tot, T_cap) of source ``s``'s meta (slot -1, weight 0), striped over the G
    programs (this one takes the blocks ``pid`` mod G from the first padded one)."""
    nblk = (T_cap + BLOCK_R - 1) // BLOCK_R
    b0 = tot // BLOCK_R
    first = b0 + ((pid - b0) % G + G) % G
    kmask = kcol[None, :] < K
    for b in range(first, nblk, G):
        j = b * BLOCK_R + rrow
        jm = (j >= tot) & (j < T_cap)
        out_row = (s * T_cap + j).to(tl.int64)
        tl.store(out_slot_ptr + out_row[:, None] * K + kcol[None, :],
                 tl.full([BLOCK_R, K_PAD], -1, tl.int32), mask=jm[:, None] & kmask)
        tl.store(out_w_ptr + out_row[:, None] * K + kcol[None, :],
                 tl.zeros([BLOCK_R, K_PAD], dtype=tl.float32), mask=jm[:, None] & kmask)


@triton.jit
def _send_rows(x_ptr, r, rmask, posm, wcol, hcol, me, T_cap, out_x_ptr, dst_tbl, W: tl.constexpr, H: tl.constexpr,
               BLOCK_H: tl.constexpr, ROW_ELEMS: tl.constexpr, ELEM: tl.constexpr, CM_BYTES: tl.constexpr,
               ALIGNED: tl.constexpr):
    """Token rows ``r`` (mask ``rmask``) of x to every destination at their rows ``posm`` [R, W]
    (-1: not sent): this rank's own into out_x's block ``me``, the peers' into their regions."""
    for hb in tl.static_range(0, H, BLOCK_H):
        h = hb + hcol
        hm = h < H
        xt = tl.load(_rows_of(x_ptr, r, h, H, BLOCK_H, ALIGNED), mask=rmask[:, None] & hm[None, :], other=0.0)
        for d in tl.static_range(W):
            pd = _column(posm, wcol, d)
            ok = rmask & (pd >= 0)
            if d == me:
                dst = _rows_of(out_x_ptr, me * T_cap + pd, h, H, BLOCK_H, ALIGNED)
                tl.store(dst, xt, mask=ok[:, None] & hm[None, :])
            else:
                rows = _row_block(tl.load(dst_tbl + d) + CM_BYTES, pd, h, ROW_ELEMS, ELEM, BLOCK_H)
                tl.store(rows, xt, mask=ok[:, None] & hm[None, :])


@triton.jit
def _chunk_meta(region):
    """(start, end, total) of the chunk meta at byte address ``region`` (this program's entry)."""
    cm = tl.load(region.to(tl.pointer_type(tl.int32)) + tl.arange(0, 4), cache_modifier=".cg")
    st = tl.sum(tl.where(tl.arange(0, 4) == 0, cm, 0), axis=0)
    en = tl.sum(tl.where(tl.arange(0, 4) == 1, cm, 0), axis=0)
    return cm, st, en


# ----------------------------------------------------------------------------------- dispatch


@triton.jit(do_not_specialize=["T", "me", "T_cap", "REGION", "spin_limit"])
def _dispatch_kernel(
    # source side
    x_ptr, dest_rank_ptr, dest_slot_ptr, weight_ptr, T,
    pos_ptr,  # int32 [T, W] row of each token in each destination's list (-1: not sent)
    smeta_ptr,  # int32 [G, W, 4] (start, end, total, 0) of each chunk per destination
    scnt_ptr, sflag_ptr,  # int32 [G, W], int32 [G]: layout scratch (this rank only)
    # addresses (int64 tables indexed by peer)
    dst_tbl,  # region this rank writes for peer d (peer pointer, or local staging on the remote path)
    pflag_tbl,  # address of flag[me, 0] on peer d (peer path)
    pack_tbl,  # address of ack[me] on peer s (peer path)
    remote_tbl,  # int32 [W]: 1 = reach that peer with host-issued NVSHMEM puts
    recv_base,  # int: address of this rank's region 0 (regions are REGION bytes apart)
    flag_ptr, rsig_ptr, ack_ptr,  # int64 local words
    # receiver outputs
    out_x_ptr, out_slot_ptr, out_w_ptr,  # [W*T_cap, H], int32 [W*T_cap, K], f32 [W*T_cap, K]
    rmeta_ptr,  # int32 [W, G, 4]: per source, the chunk meta that arrived
    ctr_ptr, err_ptr,
    pprog_tbl, prog_ptr, done_ptr,  # INTERLEAVE's progress words (ChannelAddrs)
    stamp_ptr,  # STAMPS: int64 [G, STAMP_SLOTS] (_stamp)
    me, T_cap, REGION, spin_limit,
    W: tl.constexpr, W_PAD: tl.constexpr, H: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    KMAX: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    CM_BYTES: tl.constexpr, ROW_BYTES: tl.constexpr,
    HAS_META: tl.constexpr, COMPUTE_LAYOUT: tl.constexpr, PHASE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ALIGNED: tl.constexpr, INTERLEAVE: tl.constexpr,
    STAMPS: tl.constexpr,
):
    pid = tl.program_id(0)
    ELEM = x_ptr.dtype.element_ty
    ROW_ELEMS: tl.constexpr = ROW_BYTES // (ELEM.primitive_bitwidth // 8)
    n = tl.load(ctr_ptr + pid)
    t0, t1 = _chunk(T, pid, G)
    wcol = tl.arange(0, W_PAD)
    kcol = tl.arange(0, K_PAD)
    hcol = tl.arange(0, BLOCK_H)
    rrow = tl.arange(0, BLOCK_R)
    meta_base = CM_BYTES + T_cap.to(tl.int64) * ROW_BYTES
    region_sz = REGION.to(tl.int64)
    if PHASE != 2:  # (the remote path's receiving launch keeps the sending launch's start)
        _stamp(stamp_ptr, pid, 0, STAMPS)

    if PHASE % 2 == 1:
        # ---------------- layout: this chunk's rows per destination, then a prefix over chunks
        if COMPUTE_LAYOUT:
            cnt = tl.zeros([W_PAD], dtype=tl.int32)
            for tb in range(t0, t1, BLOCK_R):
                r = tb + rrow
                dr = tl.load(dest_rank_ptr + r[:, None] * K + kcol[None, :],
                             mask=(r[:, None] < t1) & (kcol[None, :] < K), other=-1)
                hit = tl.max((dr[:, :, None] == wcol[None, None, :]).to(tl.int32), axis=1)
                cnt += tl.sum(hit, axis=0)
            tl.store(scnt_ptr + pid * W + wcol, cnt, mask=wcol < W)
            tl.debug_barrier()
            tl.atomic_xchg(sflag_ptr + pid, n + 1, sem="release", scope="gpu")
            # every program of this rank is resident (G <= SMs), so this wait is bounded
            gq = tl.arange(0, G_PAD)
            fl = tl.atomic_add(sflag_ptr + gq, 0, mask=gq < G, sem="acquire", scope="gpu")
            fl = tl.where(gq < G, fl, n + 1)
            i = 0
            while (tl.min(fl, axis=0) < n + 1) & (i < spin_limit):
                fl = tl.atomic_add(sflag_ptr + gq, 0, mask=gq < G, sem="acquire", scope="gpu")
                fl = tl.where(gq < G, fl, n + 1)
                i += 1
            if tl.min(fl, axis=0) < n + 1:
                tl.atomic_max(err_ptr, 1)
                tl.atomic_xchg(err_ptr + 1, me)
                tl.atomic_xchg(err_ptr + 2, pid)
            tl.debug_barrier()
            allc = tl.load(scnt_ptr + gq[:, None] * W + wcol[None, :],
                           mask=(gq[:, None] < G) & (wcol[None, :] < W), other=0, cache_modifier=".cg")
            start = tl.sum(tl.where(gq[:, None] < pid, allc, 0), axis=0)
            total = tl.sum(allc, axis=0)
            sm = smeta_ptr + pid * W * 4 + wcol * 4
            tl.store(sm, start, mask=wcol < W)
            tl.store(sm + 1, start + cnt, mask=wcol < W)
            tl.store(sm + 2, total, mask=wcol < W)
            tl.store(sm + 3, tl.zeros_like(total), mask=wcol < W)
        else:
            sm = smeta_ptr + pid * W * 4 + wcol * 4
            start = tl.load(sm, mask=wcol < W, other=0)
        _stamp(stamp_ptr, pid, 1, STAMPS)
        # ---------------- back-pressure: every program of each peer read our previous writes
        if n > 0:
            for d in tl.static_range(W):
                if d != me:
                    _wait_ge(ack_ptr + d, n.to(tl.int64) * G, spin_limit, err_ptr, 2, d)
            tl.debug_barrier()
        _stamp(stamp_ptr, pid, 2, STAMPS)
        # ---------------- chunk meta first: an interleaved receiver reads it while rows arrive
        for d in tl.static_range(W):
            if d != me:
                smd = tl.load(smeta_ptr + pid * W * 4 + d * 4 + tl.arange(0, 4))
                base = tl.load(dst_tbl + d)
                tl.store((base + pid * 16 + tl.arange(0, 4) * 4).to(tl.pointer_type(tl.int32)), smd)
        if INTERLEAVE:  # progress word = (call + 1) << 32 | rows sent so far in this call
            for d in tl.static_range(W):
                if d != me:
                    _publish(tl.load(pprog_tbl + d) + pid * 8, (n + 1).to(tl.int64) << 32)
        # ---------------- rows (and their slots/weights) to every destination, once per rank
        running = start
        for tb in range(t0, t1, BLOCK_R):
            r = tb + rrow
            rmask = r < t1
            if COMPUTE_LAYOUT:
                dr = tl.load(dest_rank_ptr + r[:, None] * K + kcol[None, :],
                             mask=rmask[:, None] & (kcol[None, :] < K), other=-1)
                hit = tl.max((dr[:, :, None] == wcol[None, None, :]).to(tl.int32), axis=1)
                posm = tl.where(hit > 0, running[None, :] + _exclusive_prefix(hit, BLOCK_R), -1)
                running += tl.sum(hit, axis=0)
                tl.store(pos_ptr + r[:, None] * W + wcol[None, :], posm,
                         mask=rmask[:, None] & (wcol[None, :] < W))
            else:
                posm = tl.load(pos_ptr + r[:, None] * W + wcol[None, :],
                               mask=rmask[:, None] & (wcol[None, :] < W), other=-1)
            if HAS_META:
                dr = tl.load(dest_rank_ptr + r[:, None] * K + kcol[None, :],
                             mask=rmask[:, None] & (kcol[None, :] < K), other=-1)
                ds = tl.load(dest_slot_ptr + r[:, None] * K + kcol[None, :],
                             mask=rmask[:, None] & (kcol[None, :] < K), other=-1)
                wt = tl.load(weight_ptr + r[:, None] * K + kcol[None, :],
                             mask=rmask[:, None] & (kcol[None, :] < K), other=0.0)
            _send_rows(x_ptr, r, rmask, posm, wcol, hcol, me, T_cap, out_x_ptr, dst_tbl,
                       W, H, BLOCK_H, ROW_ELEMS, ELEM, CM_BYTES, ALIGNED)
            if HAS_META:
                kmask = kcol[None, :] < K
                for d in tl.static_range(W):
                    pd = _column(posm, wcol, d)
                    ok = rmask & (pd >= 0)
                    mine = dr == d
                    slot = tl.where(mine, ds, -1)
                    wgt = tl.where(mine, wt, 0.0)
                    if d == me:
                        row = (me * T_cap + pd)[:, None] * K + kcol[None, :]
                        tl.store(out_slot_ptr + row, slot, mask=ok[:, None] & kmask)
                        tl.store(out_w_ptr + row, wgt, mask=ok[:, None] & kmask)
                    else:
                        mrow = _row_block(tl.load(dst_tbl + d) + meta_base, pd, kcol, 2 * KMAX, tl.int32, K_PAD)
                        tl.store(mrow, slot, mask=ok[:, None] & kmask)
                        tl.store((mrow + KMAX).to(tl.pointer_type(tl.float32)), wgt, mask=ok[:, None] & kmask)
            if INTERLEAVE:
                # this block's rows are out: tell each peer how many, then copy out what the
                # peers' counterpart programs have sent so far (overlapping their transfer)
                for d in tl.static_range(W):
                    if d != me:
                        c = tl.sum((rmask & (_column(posm, wcol, d) >= 0)).to(tl.int64), axis=0)
                        if c > 0:
                            _signal(tl.load(pprog_tbl + d) + pid * 8, c)
                for s in tl.static_range(W):
                    if s != me:
                        call = (n + 1).to(tl.int64) << 32
                        v = tl.atomic_add(prog_ptr + s * G + pid, 0, sem="acquire", scope="sys")
                        if v >= call:  # this call's chunk meta is here, and v - call rows
                            tl.debug_barrier()
                            region = recv_base + s * region_sz
                            cm, st, en = _chunk_meta(region + pid * 16)
                            dn = tl.load(done_ptr + s * G + pid)
                            got = tl.minimum(st + (v - call).to(tl.int32), en)
                            _copy_in(region, st + dn, got, s, out_x_ptr, out_slot_ptr, out_w_ptr, T_cap, meta_base,
                                     rrow, hcol, kcol, ELEM, ROW_ELEMS, H, K, K_PAD, KMAX, CM_BYTES, HAS_META,
                                     BLOCK_R, BLOCK_H, ALIGNED)
                            tl.store(done_ptr + s * G + pid, got - st)
        _stamp(stamp_ptr, pid, 3, STAMPS)
        # ---------------- the arrival signal (peer path)
        for d in tl.static_range(W):
            if d != me:
                if tl.load(remote_tbl + d) == 0:
                    _signal(tl.load(pflag_tbl + d) + pid * 8, 1)
        _stamp(stamp_ptr, pid, 4, STAMPS)

    if PHASE >= 2:
        tl.debug_barrier()
        # ---------------- receive: wait for program pid of every source, copy rows out
        for s in tl.static_range(W):
            region = recv_base + s * region_sz
            if s == me:
                cm = tl.load(smeta_ptr + pid * W * 4 + me * 4 + tl.arange(0, 4))
            elif INTERLEAVE:  # the rest of the chunk, each block once it is here
                call = (n + 1).to(tl.int64) << 32
                _wait_ge(prog_ptr + s * G + pid, call, spin_limit, err_ptr, 3, s)
                tl.debug_barrier()
                cm, st, en = _chunk_meta(region + pid * 16)
                for jb in range(st + tl.load(done_ptr + s * G + pid), en, BLOCK_R):
                    je = tl.minimum(jb + BLOCK_R, en)
                    _wait_ge(prog_ptr + s * G + pid, call + (je - st).to(tl.int64), spin_limit, err_ptr, 3, s)
                    tl.debug_barrier()
                    _copy_in(region, jb, je, s, out_x_ptr, out_slot_ptr, out_w_ptr, T_cap, meta_base,
                             rrow, hcol, kcol, ELEM, ROW_ELEMS, H, K, K_PAD, KMAX, CM_BYTES, HAS_META,
                             BLOCK_R, BLOCK_H, ALIGNED)
                tl.store(done_ptr + s * G + pid, 0)
            else:
                if tl.load(remote_tbl + s) == 0:
                    _wait_ge(flag_ptr + s * G + pid, n.to(tl.int64) + 1, spin_limit, err_ptr, 3, s)
                else:
                    _wait_ge(rsig_ptr + s, n.to(tl.int64) + 1, spin_limit, err_ptr, 3, s)
                tl.debug_barrier()
                _stamp(stamp_ptr, pid, 5, STAMPS)
                cm, st, en = _chunk_meta(region + pid * 16)
                _copy_in(region, st, en, s, out_x_ptr, out_slot_ptr, out_w_ptr, T_cap, meta_base,
                         rrow, hcol, kcol, ELEM, ROW_ELEMS, H, K, K_PAD, KMAX, CM_BYTES, HAS_META,
                         BLOCK_R, BLOCK_H, ALIGNED)
            tl.store(rmeta_ptr + (s * G + pid) * 4 + tl.arange(0, 4), cm)
            tot = tl.sum(tl.where(tl.arange(0, 4) == 2, cm, 0), axis=0)
            # padding rows [tot, T_cap) of this source's block: striped over programs
            nblk = (T_cap + BLOCK_R - 1) // BLOCK_R
            b0 = tot // BLOCK_R
            first = b0 + ((pid - b0) % G + G) % G
            for b in range(first, nblk, G):
                j = b * BLOCK_R + rrow
                jm = (j >= tot) & (j < T_cap)
                out_row = (s * T_cap + j).to(tl.int64)
                for hb in tl.static_range(0, H, BLOCK_H):
                    h = hb + hcol
                    z = tl.zeros([BLOCK_R, BLOCK_H], dtype=ELEM)
                    tl.store(_rows_of(out_x_ptr, out_row, h, H, BLOCK_H, ALIGNED), z,
                             mask=jm[:, None] & (h[None, :] < H))
            if HAS_META:
                _pad_meta(out_slot_ptr, out_w_ptr, s, tot, T_cap, pid, rrow, kcol, G, K, K_PAD, BLOCK_R)
            _stamp(stamp_ptr, pid, 6, STAMPS)
            if s != me:
                if tl.load(remote_tbl + s) == 0:
                    _signal(tl.load(pack_tbl + s), 1)
        _stamp(stamp_ptr, pid, 7, STAMPS)
        tl.store(ctr_ptr + pid, n + 1)


# ----------------------------------------------------------------------------------- combine


@triton.jit
def _combine_block(tb, t1, pid, me, src_ptr, side_ptr, pos_ptr, dest_rank_ptr, out_ptr, gw_ptr, recv_base,
                   region_sz, meta_base, T_cap, rrow, hcol, kcol, wcol,
                   ELEM: tl.constexpr, ROW_ELEMS: tl.constexpr, W: tl.constexpr, H: tl.constexpr,
                   K: tl.constexpr, K_PAD: tl.constexpr, KMAX: tl.constexpr, CM_BYTES: tl.constexpr,
                   HAS_META: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ALIGNED: tl.constexpr):
    """Tokens [tb, min(tb + BLOCK_R, t1)): out = the sum over ranks d (in rank order) of the row
    each token has at d (this rank's own from src, the others' from their regions here)."""
    r = tb + rrow
    rmask = r < t1
    kmask = kcol[None, :] < K
    posm = tl.load(pos_ptr + r[:, None] * W + wcol[None, :], mask=rmask[:, None] & (wcol[None, :] < W), other=-1)
    for hb in tl.static_range(0, H, BLOCK_H):
        h = hb + hcol
        hm = h < H
        acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        for d in tl.static_range(W):
            pd = _column(posm, wcol, d)
            ok = (rmask & (pd >= 0))[:, None] & hm[None, :]
            if d == me:
                v = tl.load(_rows_of(src_ptr, me * T_cap + pd, h, H, BLOCK_H, ALIGNED), mask=ok, other=0.0)
            else:
                rows = _row_block(recv_base + d * region_sz + CM_BYTES, pd, h, ROW_ELEMS, ELEM, BLOCK_H)
                v = tl.load(rows, mask=ok, other=0.0, cache_modifier=".cg")
            acc += v.to(tl.float32)
        tl.store(_rows_of(out_ptr, r, h, H, BLOCK_H, ALIGNED), acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & hm[None, :])
    if HAS_META:
        dr = tl.load(dest_rank_ptr + r[:, None] * K + kcol[None, :], mask=rmask[:, None] & kmask, other=-1)
        g = tl.zeros([BLOCK_R, K_PAD], dtype=tl.float32)
        for d in tl.static_range(W):
            pd = _column(posm, wcol, d)
            ok = (rmask & (pd >= 0))[:, None] & kmask & (dr == d)
            if d == me:
                sv = tl.load(side_ptr + (me * T_cap + pd)[:, None].to(tl.int64) * K + kcol[None, :],
                             mask=ok, other=0.0)
            else:
                mrow = _row_block(recv_base + d * region_sz + meta_base, pd, kcol, 2 * KMAX, tl.float32, K_PAD)
                sv = tl.load(mrow, mask=ok, other=0.0, cache_modifier=".cg")
            g += sv
        tl.store(gw_ptr + r[:, None] * K + kcol[None, :], g, mask=rmask[:, None] & kmask)


@triton.jit
def _rows_needed(tb, t1, d, pid, pos_ptr, smeta_ptr, rrow, W: tl.constexpr):
    """Rows peer ``d`` must have sent back (of those for this program's chunk) before tokens
    [tb, tb + BLOCK_R) can be summed: one past the largest row any of them has at d."""
    r = tb + rrow
    pd = tl.load(pos_ptr + r * W + d, mask=r < t1, other=-1)
    st = tl.load(smeta_ptr + pid * W * 4 + d * 4)
    return tl.maximum(tl.max(pd, axis=0) - st + 1, 0).to(tl.int64)


@triton.jit(do_not_specialize=["T", "me", "T_cap", "REGION", "spin_limit"])
def _combine_kernel(
    # expert side
    src_ptr, side_ptr,  # [W*T_cap, H] rows to send back, float32 [W*T_cap, K] per-row side values
    rmeta_ptr,  # int32 [W, G, 4] from the dispatch: which rows program pid received per source
    dst_tbl, pflag_tbl, pack_tbl, remote_tbl, recv_base,
    flag_ptr, rsig_ptr, ack_ptr,
    # source side
    pos_ptr, dest_rank_ptr, T,  # int32 [T, W], int32 [T, K]
    out_ptr, gw_ptr,  # [T, H] sums, float32 [T, K] side values picked per k
    ctr_ptr, err_ptr,
    smeta_ptr,  # int32 [G, W, 4] from the dispatch: which rows of each peer hold this chunk's tokens
    pprog_tbl, prog_ptr, done_ptr,  # INTERLEAVE's progress words (ChannelAddrs)
    stamp_ptr,  # STAMPS: int64 [G, STAMP_SLOTS] (_stamp)
    me, T_cap, REGION, spin_limit,
    W: tl.constexpr, W_PAD: tl.constexpr, H: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    KMAX: tl.constexpr, G: tl.constexpr,
    CM_BYTES: tl.constexpr, ROW_BYTES: tl.constexpr,
    HAS_META: tl.constexpr, PHASE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVE: tl.constexpr, STAMPS: tl.constexpr,
):
    pid = tl.program_id(0)
    ELEM = src_ptr.dtype.element_ty
    ROW_ELEMS: tl.constexpr = ROW_BYTES // (ELEM.primitive_bitwidth // 8)
    n = tl.load(ctr_ptr + pid)
    wcol = tl.arange(0, W_PAD)
    kcol = tl.arange(0, K_PAD)
    kmask = kcol[None, :] < K
    hcol = tl.arange(0, BLOCK_H)
    rrow = tl.arange(0, BLOCK_R)
    meta_base = CM_BYTES + T_cap.to(tl.int64) * ROW_BYTES
    region_sz = REGION.to(tl.int64)
    t0, t1 = _chunk(T, pid, G)
    if PHASE != 2:  # (the remote path's receiving launch keeps the sending launch's start)
        _stamp(stamp_ptr, pid, 0, STAMPS)

    if PHASE % 2 == 1:
        if n > 0:
            for d in tl.static_range(W):
                if d != me:
                    _wait_ge(ack_ptr + d, n.to(tl.int64) * G, spin_limit, err_ptr, 2, d)
            tl.debug_barrier()
        _stamp(stamp_ptr, pid, 1, STAMPS)
        if INTERLEAVE:  # progress word = (call + 1) << 32 | rows sent back so far in this call
            for d in tl.static_range(W):
                if d != me:
                    _publish(tl.load(pprog_tbl + d) + pid * 8, (n + 1).to(tl.int64) << 32)
        # ---------------- send back the rows program pid received from each source
        # ROTATE: rank me serves sources me+1, me+2, ... (mod W) instead of 0, 1, ...: at any moment
        # each rank then receives from one peer (a ring schedule) rather than all ranks writing to
        # the lowest rank first. The same rows, stores and signals per source, in another order.
        for i in tl.static_range(W):
            if ROTATE:
                s = (me + 1 + i) % W  # i = W-1 is me itself
            else:
                s = i
            if s != me:
                st = tl.load(rmeta_ptr + (s * G + pid) * 4)
                en = tl.load(rmeta_ptr + (s * G + pid) * 4 + 1)
                base = tl.load(dst_tbl + s)
                for jb in range(st, en, BLOCK_R):
                    j = jb + rrow
                    jm = j < en
                    in_row = (s * T_cap + j).to(tl.int64)
                    for hb in tl.static_range(0, H, BLOCK_H):
                        h = hb + hcol
                        hm = h < H
                        v = tl.load(_rows_of(src_ptr, in_row, h, H, BLOCK_H, ALIGNED), mask=jm[:, None] & hm[None, :])
                        dst = _row_block(base + CM_BYTES, j, h, ROW_ELEMS, ELEM, BLOCK_H)
                        tl.store(dst, v, mask=jm[:, None] & hm[None, :])
                    if HAS_META:
                        sv = tl.load(side_ptr + in_row[:, None] * K + kcol[None, :], mask=jm[:, None] & kmask)
                        mrow = _row_block(base + meta_base, j, kcol, 2 * KMAX, tl.float32, K_PAD)
                        tl.store(mrow, sv, mask=jm[:, None] & kmask)
                    if INTERLEAVE:
                        # these rows are out: tell s, then sum the next block of this rank's own
                        # tokens if every peer has sent back what it needs
                        _signal(tl.load(pprog_tbl + s) + pid * 8, tl.minimum(en - jb, BLOCK_R).to(tl.int64))
                        tb = t0 + tl.load(done_ptr + pid)  # done: tokens of the chunk summed so far
                        if tb < t1:
                            ready = True
                            for d in tl.static_range(W):
                                if d != me:
                                    have = tl.atomic_add(prog_ptr + d * G + pid, 0, sem="acquire", scope="sys")
                                    need = ((n + 1).to(tl.int64) << 32) + _rows_needed(
                                        tb, t1, d, pid, pos_ptr, smeta_ptr, rrow, W)
                                    ready = ready & (have >= need)
                            if ready:
                                tl.debug_barrier()
                                _combine_block(tb, t1, pid, me, src_ptr, side_ptr, pos_ptr, dest_rank_ptr, out_ptr,
                                               gw_ptr, recv_base, region_sz, meta_base, T_cap, rrow, hcol, kcol,
                                               wcol, ELEM, ROW_ELEMS, W, H, K, K_PAD, KMAX, CM_BYTES, HAS_META,
                                               BLOCK_R, BLOCK_H, ALIGNED)
                                tl.store(done_ptr + pid, tb + BLOCK_R - t0)
                if tl.load(remote_tbl + s) == 0:
                    _stamp(stamp_ptr, pid, 2, STAMPS)
                    _signal(tl.load(pflag_tbl + s) + pid * 8, 1)
        _stamp(stamp_ptr, pid, 3, STAMPS)

    if PHASE >= 2:
        if INTERLEAVE:
            # ---------------- the tokens not summed yet, each block once its rows are back
            for tb in range(t0 + tl.load(done_ptr + pid), t1, BLOCK_R):
                for d in tl.static_range(W):
                    if d != me:
                        need = ((n + 1).to(tl.int64) << 32) + _rows_needed(tb, t1, d, pid, pos_ptr,
                                                                            smeta_ptr, rrow, W)
                        _wait_ge(prog_ptr + d * G + pid, need, spin_limit, err_ptr, 4, d)
                tl.debug_barrier()
                _combine_block(tb, t1, pid, me, src_ptr, side_ptr, pos_ptr, dest_rank_ptr, out_ptr, gw_ptr,
                               recv_base, region_sz, meta_base, T_cap, rrow, hcol, kcol, wcol, ELEM, ROW_ELEMS,
                               W, H, K, K_PAD, KMAX, CM_BYTES, HAS_META, BLOCK_R, BLOCK_H, ALIGNED)
            tl.store(done_ptr + pid, 0)
        else:
            # ---------------- wait for program pid of every expert rank, then sum per token
            for d in tl.static_range(W):
                if d != me:
                    if tl.load(remote_tbl + d) == 0:
                        _wait_ge(flag_ptr + d * G + pid, n.to(tl.int64) + 1, spin_limit, err_ptr, 4, d)
                    else:
                        _wait_ge(rsig_ptr + d, n.to(tl.int64) + 1, spin_limit, err_ptr, 4, d)
            tl.debug_barrier()
            _stamp(stamp_ptr, pid, 4, STAMPS)
            for tb in range(t0, t1, BLOCK_R):
                _combine_block(tb, t1, pid, me, src_ptr, side_ptr, pos_ptr, dest_rank_ptr, out_ptr, gw_ptr,
                               recv_base, region_sz, meta_base, T_cap, rrow, hcol, kcol, wcol, ELEM, ROW_ELEMS,
                               W, H, K, K_PAD, KMAX, CM_BYTES, HAS_META, BLOCK_R, BLOCK_H, ALIGNED)
        _stamp(stamp_ptr, pid, 5, STAMPS)
        for d in tl.static_range(W):
            if d != me:
                if tl.load(remote_tbl + d) == 0:
                    _signal(tl.load(pack_tbl + d), 1)
        _stamp(stamp_ptr, pid, 6, STAMPS)
        tl.store(ctr_ptr + pid, n + 1)


# ----------------------------------------------------------------------------------- references


# ----------------------------------------------------------------------------------- launchers


def _pow2(n: int, floor: int = 2) -> int:
    """The next power of two >= n, at least ``floor`` (plain Python: triton.next_power_of_2 is a
    constexpr function whose wrapper costs microseconds per call on the launch path)."""
    return max(floor, 1 << (max(int(n), 1) - 1).bit_length())


class Geometry:
    """Sizes shared by every rank of one symmetric buffer (kernel constants).

    Attributes: world_size W, rank, capacity T_cap (rows per source region), hidden H,
    kmax (row-meta width), num_programs G, cm_bytes, row_bytes, region_bytes.
    """

    def __init__(self, world_size: int, rank: int, capacity: int, hidden: int, elem_bytes: int,
                 kmax: int, num_programs: int) -> None:
        self.world_size, self.rank, self.capacity = world_size, rank, capacity
        # row meta (K int32 slots + K float32 weights) rounded to 32 bytes keeps its rows 16-byte aligned
        self.hidden, self.elem_bytes, self.kmax, self.num_programs = hidden, elem_bytes, -(-kmax // 4) * 4, num_programs
        self.cm_bytes = -(-(num_programs * 16) // 256) * 256
        self.row_bytes = -(-(hidden * elem_bytes) // 16) * 16
        self.meta_bytes = 8 * self.kmax  # the rounded width: the kernels lay rows out by it
        self.region_bytes = -(-(self.cm_bytes + capacity * (self.row_bytes + self.meta_bytes)) // 256) * 256


class ChannelAddrs:
    """Addresses and words of one channel (dispatch-like or combine-like) on this rank.

    dst_tbl/pflag_tbl/pack_tbl: int64 [W] device tables (see the kernels); remote_tbl int32 [W];
    recv_base: int address of this rank's region 0; flag int64 [W*G], rsig int64 [W], ack int64 [W]
    (symmetric words); ctr int32 [G] per-program call counters. For :attr:`Tuning.interleave`:
    pprog_tbl int64 [W] (address of prog[me, 0] on peer d), prog int64 [W*G] (symmetric: for
    program p of source s, ``(call + 1) << 32`` plus the rows it has sent here in that call; set
    absolutely at each call's start, so a timed-out call never shifts the next) and done int32
    [W*G] (this rank's work on them so far in the call, ordinary device memory).
    """

    def __init__(self, dst_tbl, pflag_tbl, pack_tbl, remote_tbl, recv_base, flag, rsig, ack, ctr,
                 pprog_tbl, prog, done):
        self.dst_tbl, self.pflag_tbl, self.pack_tbl, self.remote_tbl = dst_tbl, pflag_tbl, pack_tbl, remote_tbl
        self.recv_base, self.flag, self.rsig, self.ack, self.ctr = recv_base, flag, rsig, ack, ctr
        self.pprog_tbl, self.prog, self.done = pprog_tbl, prog, done


class Tuning:
    """Launch parameters (any value is correct; the benchmark picks the fastest).

    ``rotate_peers``: the combine sends its rows back to the sources in ring order starting after
    this rank (at any moment each rank receives from one peer) instead of in rank order (every
    rank writes to the lowest rank first). On by default from three ranks: on H200 x4 at
    T_local=16384, H=4096 the combine took 1205 µs against 2000 in rank order (305 GB/s, 1.10x
    the dispatch's), and the T_local=128 pair 63 µs against 93 (measured 2026-11-26).

    ``interleave`` (calls whose peers are all reached through peer pointers): the senders signal
    a progress word after every block of rows, and between its own sends each program does the
    receiving side's work on what has arrived: the dispatch copies rows out of the symmetric
    region, the combine sums each block of its tokens whose rows every peer has sent back (in
    the same order, so the sums are the same). Otherwise that work follows the whole transfer:
    ~90 µs of ~477 at T_local=16384, H=4096, W=2 on H100s (measured 2026-11-25).
    Every rank must use the same value; it applies where no rank has a remote peer (see
    :class:`~ray_moe.comm.nvshmem.SymmetricBuffer`'s ``interleave_ok``). On by default for rows of
    2048 or more elements at two ranks (:meth:`for_hidden`): on H100
    x2 at T_local=16384, H=4096 the dispatch+combine pair took 857 µs against 985 (dispatch 0.82
    of the copy ceiling against 0.78), at 4096 250 against 263 µs (measured 2026-11-25).
    """

    def __init__(self, block_r: int = 8, block_h: int = 1024, num_warps: int = 8,
                 rotate_peers: bool = False, interleave: bool = False) -> None:
        self.block_r, self.block_h, self.num_warps = block_r, block_h, num_warps
        self.rotate_peers, self.interleave = bool(rotate_peers), bool(interleave)

    @classmethod
    def for_hidden(cls, hidden: int, world_size: int) -> "Tuning":
        """Default per row width and world size: for wide rows whole 4096-wide rows, 8 per step,
        16 warps (the fastest of the variants measured on H100 x2 and H200 x2, docs/RESULTS.md#dispatch-w2),
        interleaved at two ranks, where that was measured faster (pair 13 % on H100 x2); at four
        ranks the interleaved dispatch was slower (1520 against 1335 µs on H200 x4, 2026-11-26).
        The combine's sends rotate from three ranks on (``rotate_peers``)."""
        rotate = world_size >= 3
        if hidden >= 2048:
            return cls(block_r=8, block_h=4096, num_warps=16, rotate_peers=rotate, interleave=world_size == 2)
        return cls(rotate_peers=rotate)

    def key(self) -> tuple:
        return (self.block_r, self.block_h, self.num_warps, self.rotate_peers, self.interleave)


def _check(t: torch.Tensor, name: str, shape: tuple, dtype=None, device=None) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _aligned_rows(*tensors: torch.Tensor) -> bool:
    """Whether every row tensor [N, H] starts 16-byte aligned with rows a multiple of 16 bytes."""
    return all(t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors)


def _nz(t: torch.Tensor) -> torch.Tensor:
    """A tensor Triton can take a pointer of (a one-element stand-in for an empty one)."""
    return t if t.numel() else t.new_empty(1)


def _dispatch_checks(geo, T_cap, x, pos, smeta, out_x, rmeta, dest_rank, dest_slot, weight, out_slot, out_w,
                     scratch, compute_layout, has_meta, K) -> None:
    W, G = geo.world_size, geo.num_programs
    T, H = x.shape[0], x.shape[1] if x.dim() == 2 else geo.hidden  # H: the row payload's elements
    dev = x.device
    _check(x, "x", (T, H), device=dev)
    if H == geo.hidden and x.element_size() > geo.elem_bytes:
        raise TypeError(f"x of {x.dtype} needs {x.element_size()} bytes per element; the buffer "
                        f"was sized for {geo.elem_bytes} (BufferSpec.elem_bytes)")
    if H * x.element_size() > geo.hidden * geo.elem_bytes:
        raise ValueError(f"rows of {H} x {x.dtype} ({H * x.element_size()} bytes) do not fit the buffer's rows of "
                         f"{geo.hidden * geo.elem_bytes} bytes")
    if not 1 <= T_cap <= geo.capacity:
        raise ValueError(f"capacity {T_cap} must be between 1 and the buffer's {geo.capacity} rows per rank")
    if T > T_cap:
        raise ValueError(f"{T} tokens exceed the capacity of {T_cap} per rank "
                         "(BufferSpec.max_tokens)")
    _check(pos, "pos", (T, W), torch.int32, dev)
    _check(smeta, "smeta", (G, W, 4), torch.int32, dev)
    _check(out_x, "out_x", (W * T_cap, H), x.dtype, dev)
    _check(rmeta, "rmeta", (W, G, 4), torch.int32, dev)
    if compute_layout or has_meta:
        _check(dest_rank, "dest_rank", (T, K), torch.int32, dev)
    if compute_layout and scratch is None:
        raise ValueError("compute_layout needs the layout scratch tensors")
    if has_meta:
        if K > geo.kmax:
            raise ValueError(f"top_k={K} exceeds the buffer's row-meta width {geo.kmax}")
        _check(dest_slot, "dest_slot", (T, K), torch.int32, dev)
        _check(weight, "weight", (T, K), torch.float32, dev)
        _check(out_slot, "out_slot", (W * T_cap, K), torch.int32, dev)
        _check(out_w, "out_w", (W * T_cap, K), torch.float32, dev)


def _dispatch_varying(x, pos, smeta, out_x, rmeta, dest_rank, dest_slot, weight, out_slot, out_w, scratch) -> dict:
    """The arguments of :func:`_dispatch_kernel` that change from call to call (tensors and T)."""
    has_meta = weight is not None
    scnt, sflag = scratch if scratch is not None else (_nz(pos), _nz(pos))
    T = x.shape[0]
    x, pos = _nz(x), _nz(pos)
    dest_rank = _nz(dest_rank) if dest_rank is not None else pos
    return dict(
        x_ptr=x, dest_rank_ptr=dest_rank, dest_slot_ptr=_nz(dest_slot) if has_meta else pos,
        weight_ptr=_nz(weight) if has_meta else x, T=T, pos_ptr=pos, smeta_ptr=_nz(smeta),
        scnt_ptr=scnt, sflag_ptr=sflag, out_x_ptr=out_x, out_slot_ptr=out_slot if has_meta else pos,
        out_w_ptr=out_w if has_meta else x, rmeta_ptr=rmeta,
    )


def _dispatch_fixed(geo, ch, err, phase, T_cap, K, has_meta, compute_layout, spin_limit, tu, aligned,
                    interleave, stamps=None, row_elems: int | None = None) -> dict:
    """The rest of :func:`_dispatch_kernel`'s arguments (constexprs included): functions of the
    buffer and of the call's key. ``row_elems``: elements of the rows sent (default the buffer's
    H; the region's row stride stays ``geo.row_bytes`` whatever they are)."""
    W, G = geo.world_size, geo.num_programs
    H = geo.hidden if row_elems is None else row_elems
    return dict(
        dst_tbl=ch.dst_tbl, pflag_tbl=ch.pflag_tbl, pack_tbl=ch.pack_tbl, remote_tbl=ch.remote_tbl,
        recv_base=ch.recv_base, flag_ptr=ch.flag, rsig_ptr=ch.rsig, ack_ptr=ch.ack,
        ctr_ptr=ch.ctr, err_ptr=err, me=geo.rank, T_cap=T_cap, REGION=geo.region_bytes, spin_limit=spin_limit,
        W=W, W_PAD=_pow2(W), H=H, K=K, K_PAD=_pow2(K), KMAX=geo.kmax, G=G, G_PAD=_pow2(G),
        CM_BYTES=geo.cm_bytes, ROW_BYTES=geo.row_bytes,
        HAS_META=has_meta, COMPUTE_LAYOUT=compute_layout, PHASE=phase,
        BLOCK_R=tu.block_r, BLOCK_H=min(tu.block_h, _pow2(H)), ALIGNED=aligned,
        pprog_tbl=ch.pprog_tbl, prog_ptr=ch.prog, done_ptr=ch.done, INTERLEAVE=interleave,
        stamp_ptr=err if stamps is None else stamps, STAMPS=stamps is not None,
    )


def launch_dispatch(
    geo: Geometry, ch: ChannelAddrs, x: torch.Tensor, pos: torch.Tensor, smeta: torch.Tensor,
    out_x: torch.Tensor, rmeta: torch.Tensor, err: torch.Tensor, *, phase: int,
    dest_rank: torch.Tensor | None = None, dest_slot: torch.Tensor | None = None,
    weight: torch.Tensor | None = None, out_slot: torch.Tensor | None = None,
    out_w: torch.Tensor | None = None, scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    compute_layout: bool = False, spin_limit: int = 1 << 25,
    tuning: Tuning | None = None, capacity: int | None = None, launcher: "Launcher | None" = None,
    key: tuple | None = None, interleave_ok: bool = True, stamps: torch.Tensor | None = None,
) -> None:
    """Dispatch-like exchange: rows of x [T, H] go to out_x [W*C, H] of their destinations, where
    C = ``capacity`` (rows per source this call; default the buffer's T_cap, at most that). H is
    the row payload's width: the buffer's hidden size (the model dtype's rows), or any row of at
    most the buffer's row bytes (FP8 rows and their scales as words: H is then a constexpr of its
    own, the bf16 rows' specialisation unchanged).

    With ``compute_layout`` (forward dispatch) the layout is derived from dest_rank int32 [T, K]
    and written to pos int32 [T, W] and smeta int32 [G, W, 4]; otherwise both are read (the
    backward of combine). With dest_slot/weight (int32/float32 [T, K]) the per-row meta goes to
    out_slot int32 / out_w float32 [W*C, K]. ``phase``: 1 send, 2 receive, 3 both.
    ``launcher``/``key``: launch through a :class:`Launcher`, which checks the arguments and binds
    them through Triton's JIT only on the first call of ``key`` (the caller's promise that the
    call's shapes, dtypes and constants are those of that first call). ``tuning.interleave`` applies
    where ``interleave_ok`` (no rank of the buffer has a remote peer: every rank must agree) in
    phase 3.

    ``stamps`` int64 [G, STAMP_SLOTS]: each program's timer at :data:`DISPATCH_STAMPS` (part of
    the key: a stamped call compiles its own kernel).
    """
    tu = tuning or Tuning()
    T_cap = capacity or geo.capacity
    launcher = launcher or Launcher(fast=False)
    interleave = tu.interleave and interleave_ok and phase == 3
    varying = _dispatch_varying(x, pos, smeta, out_x, rmeta, dest_rank, dest_slot, weight, out_slot, out_w, scratch)

    def fixed() -> dict:
        has_meta = weight is not None
        K = dest_rank.shape[1] if dest_rank is not None else 1
        _dispatch_checks(geo, T_cap, x, pos, smeta, out_x, rmeta, dest_rank, dest_slot, weight, out_slot, out_w,
                         scratch, compute_layout, has_meta, K)
        return _dispatch_fixed(geo, ch, err, phase, T_cap, K, has_meta, compute_layout, spin_limit, tu,
                               _aligned_rows(varying["x_ptr"], out_x), interleave, stamps, row_elems=x.shape[1])

    launcher.launch(_dispatch_kernel, (geo.num_programs,), varying, fixed, tu.num_warps, key,
                    first={"spin_limit": _first_spin(spin_limit)})


def _combine_checks(geo, T_cap, src, rmeta, pos, out, side, dest_rank, gw, smeta) -> None:
    W, G, H = geo.world_size, geo.num_programs, geo.hidden
    T = out.shape[0]
    dev = src.device
    if not 1 <= T_cap <= geo.capacity:
        raise ValueError(f"capacity {T_cap} must be between 1 and the buffer's {geo.capacity} rows per rank")
    _check(src, "src", (W * T_cap, H), device=dev)
    if src.element_size() > geo.elem_bytes:
        raise TypeError(f"rows of {src.dtype} do not fit the buffer sized for {geo.elem_bytes}-byte elements")
    _check(rmeta, "rmeta", (W, G, 4), torch.int32, dev)
    _check(pos, "pos", (T, W), torch.int32, dev)
    _check(out, "out", (T, H), src.dtype, dev)
    if smeta is not None:
        _check(smeta, "smeta", (G, W, 4), torch.int32, dev)
    if side is not None:
        K = side.shape[1]
        if K > geo.kmax:
            raise ValueError(f"top_k={K} exceeds the buffer's row-meta width {geo.kmax}")
        _check(side, "side", (W * T_cap, K), torch.float32, dev)
        _check(dest_rank, "dest_rank", (T, K), torch.int32, dev)
        _check(gw, "gw", (T, K), torch.float32, dev)


def _combine_varying(src, rmeta, pos, out, side, dest_rank, gw, smeta) -> dict:
    """The arguments of :func:`_combine_kernel` that change from call to call (tensors and T)."""
    has_meta = side is not None
    T = out.shape[0]
    pos, out = _nz(pos), _nz(out)
    return dict(src_ptr=src, side_ptr=side if has_meta else src, rmeta_ptr=rmeta, pos_ptr=pos,
                dest_rank_ptr=_nz(dest_rank) if has_meta else pos, T=T, out_ptr=out,
                gw_ptr=_nz(gw) if has_meta else out, smeta_ptr=rmeta if smeta is None else smeta)


def _combine_fixed(geo, ch, err, phase, T_cap, K, has_meta, spin_limit, tu, aligned, interleave,
                   stamps=None) -> dict:
    """The rest of :func:`_combine_kernel`'s arguments (constexprs included)."""
    W, G, H = geo.world_size, geo.num_programs, geo.hidden
    return dict(
        dst_tbl=ch.dst_tbl, pflag_tbl=ch.pflag_tbl, pack_tbl=ch.pack_tbl, remote_tbl=ch.remote_tbl,
        recv_base=ch.recv_base, flag_ptr=ch.flag, rsig_ptr=ch.rsig, ack_ptr=ch.ack,
        ctr_ptr=ch.ctr, err_ptr=err, me=geo.rank, T_cap=T_cap, REGION=geo.region_bytes, spin_limit=spin_limit,
        W=W, W_PAD=_pow2(W), H=H, K=K, K_PAD=_pow2(K), KMAX=geo.kmax, G=G,
        CM_BYTES=geo.cm_bytes, ROW_BYTES=geo.row_bytes, HAS_META=has_meta, PHASE=phase,
        BLOCK_R=tu.block_r, BLOCK_H=min(tu.block_h, _pow2(H)), ALIGNED=aligned, ROTATE=tu.rotate_peers,
        pprog_tbl=ch.pprog_tbl, prog_ptr=ch.prog, done_ptr=ch.done, INTERLEAVE=interleave,
        stamp_ptr=err if stamps is None else stamps, STAMPS=stamps is not None,
    )


def launch_combine(
    geo: Geometry, ch: ChannelAddrs, src: torch.Tensor, rmeta: torch.Tensor, pos: torch.Tensor,
    out: torch.Tensor, err: torch.Tensor, *, phase: int, side: torch.Tensor | None = None,
    dest_rank: torch.Tensor | None = None, gw: torch.Tensor | None = None,
    smeta: torch.Tensor | None = None,
    spin_limit: int = 1 << 25, tuning: Tuning | None = None, capacity: int | None = None,
    launcher: "Launcher | None" = None, key: tuple | None = None, interleave_ok: bool = True,
    stamps: torch.Tensor | None = None,
) -> None:
    """Combine-like exchange: rows src [W*C, H] go back to their sources, summed per token
    (C = ``capacity``, as the dispatch that made the layout used).

    out [T, H] (src dtype) gets sum over destinations d of the row token t had at d. With side
    float32 [W*C, K] and dest_rank int32 [T, K], gw float32 [T, K] gets side[row at
    dest_rank[t, k], k] (the routing-weight gradient). ``launcher``/``key``: see
    :func:`launch_dispatch`. ``tuning.interleave`` (phase 3 only) sums each block of tokens as soon
    as its rows are back, between the sends; it needs the dispatch's ``smeta`` int32 [G, W, 4].
    ``stamps``: as in :func:`launch_dispatch`, at :data:`COMBINE_STAMPS`.
    """
    tu = tuning or Tuning()
    T_cap = capacity or geo.capacity
    launcher = launcher or Launcher(fast=False)
    varying = _combine_varying(src, rmeta, pos, out, side, dest_rank, gw, smeta)
    interleave = tu.interleave and interleave_ok and phase == 3 and smeta is not None

    def fixed() -> dict:
        _combine_checks(geo, T_cap, src, rmeta, pos, out, side, dest_rank, gw, smeta)
        K = side.shape[1] if side is not None else 1
        return _combine_fixed(geo, ch, err, phase, T_cap, K, side is not None, spin_limit, tu,
                              _aligned_rows(src, varying["out_ptr"]), interleave, stamps)

    launcher.launch(_combine_kernel, (geo.num_programs,), varying, fixed, tu.num_warps, key,
                    first={"spin_limit": _first_spin(spin_limit)})


# ----------------------------------------------------------------------------------- host cost

# The first launch of a call shape (and every keyless one) waits this many times longer. Every
# rank meets a new kernel variant (constexprs, dtypes, tuning) at the same call, and each compiles
# it before launching: a rank that compiles faster waits in its exchange for one still compiling.
# 2^25 polls are seconds; the interleaved W=4 combine compiles in 5 s on one CPU (1 s not
# interleaved), and four ranks compile at once. Later launches of the shape keep the configured
# limit, so a dead peer is still named quickly.
FIRST_LAUNCH_SPIN_FACTOR = 16


def _first_spin(spin_limit: int) -> int:
    """The spin limit of a first launch (:data:`FIRST_LAUNCH_SPIN_FACTOR`), within int32."""
    return min(spin_limit * FIRST_LAUNCH_SPIN_FACTOR, 2**31 - 1)


class Launcher:
    """Launch state of one buffer's exchange kernels, kept per call shape (``key``).

    The first call of a key checks every argument and launches through Triton's JIT
    (``kernel[grid](**kwargs)``: binding and specialising ~45 arguments, the cache lookup, and a
    compile the first time). With ``fast`` it keeps Triton's compiled kernel and the call's
    arguments in signature order with the per-call ones (tensors, T) blanked; every later call of
    the key fills those in and launches the compiled kernel directly (:class:`DirectLaunch`): no
    checks, no rebinding, no rebuilding of the constant arguments, and every pointer passed as an
    integer (Triton's C launcher otherwise calls each tensor's ``data_ptr`` and asks the driver
    about the pointer: ~25 driver calls per exchange launch).

    The key is the caller's promise that shapes, dtypes, constexprs and tunings equal those of the
    first call (:meth:`ray_moe.comm.nvshmem.SymmetricBuffer._key` builds it from them) and that every
    pointer is 16-byte aligned as on that call (the only pointer property Triton specialises on;
    the buffer's own tensors come from the allocator, and callers pass ``key=None`` when one of
    theirs is not aligned or empty, which takes the JIT path). Integer arguments that change per
    call (T) are ``do_not_specialize``; the others are fixed per buffer and key. The constant
    tensors' addresses are kept as integers, so they must outlive the launcher (the buffer owns
    both). ``fast`` needs a Triton whose compiled kernels launch like that: :func:`fast_launch_works`.

    ``calls`` counts launches by path ("jit", "fast") for tests and benchmarks.
    """

    def __init__(self, fast: bool, device: torch.device | None = None) -> None:
        self.fast = fast
        self.device = device
        self._fixed: dict[tuple, dict] = {}  # key -> the checked constant arguments
        self._entries: dict[tuple, tuple] = {}  # key -> (launch, template, [(index, name)]) with fast
        self.calls = {"jit": 0, "fast": 0}

    def launch(self, kernel, grid: tuple, varying: dict, fixed: Callable[[], dict], num_warps: int,
               key: tuple | None, first: dict | None = None) -> None:
        """Launch ``kernel`` on ``grid`` with ``varying`` (per-call arguments) and ``fixed()`` (the
        others; called, which checks the arguments, only when the key is new or None). ``first``
        replaces some of the fixed arguments on the first launch of a key and on every keyless
        one (the exchanges' longer spin limit: :data:`FIRST_LAUNCH_SPIN_FACTOR`)."""
        fixed_kw = None
        if key is not None:
            entry = self._entries.get(key)
            if entry is not None:
                self.calls["fast"] += 1
                run, template, slots = entry
                args = list(template)
                for i, name in slots:
                    v = varying[name]
                    args[i] = v.data_ptr() if isinstance(v, torch.Tensor) else v  # _pointer_as_int, inlined
                run(*args)
                return
            fixed_kw = self._fixed.get(key)
        new = fixed_kw is None
        if new:
            fixed_kw = fixed()
        self.calls["jit"] += 1
        kwargs = {**fixed_kw, **varying}
        compiled = kernel[grid](**({**kwargs, **first} if new and first else kwargs), num_warps=num_warps)
        if key is None or not new:
            return
        self._fixed[key] = fixed_kw
        if self.fast and hasattr(compiled, "__getitem__") and hasattr(compiled, "function"):
            names = kernel.arg_names
            slots = [(i, n) for i, n in enumerate(names) if n in varying]
            template = tuple(None if n in varying else _pointer_as_int(kwargs[n]) for n in names)
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            self._entries[key] = (DirectLaunch.of(compiled, grid3, self.device), template, slots)


    def bound(self, key: tuple | None, fixed: dict) -> "BoundLaunch | None":
        """The direct launch of ``key`` with the per-call arguments in ``fixed`` bound for good (a
        caller's own tensors that stay the same from call to call, such as buffer-owned outputs),
        or None before the key's first launch, without direct launches, or for a keyless call."""
        entry = self._entries.get(key) if key is not None else None
        if entry is None:
            return None
        run, template, slots = entry
        args = list(template)
        rest = []
        for i, name in slots:
            if name in fixed:
                args[i] = _pointer_as_int(fixed[name])
            else:
                rest.append((i, name))
        return BoundLaunch(run, args, tuple(rest), self)


class BoundLaunch:
    """:meth:`Launcher.bound`'s launch: ``launch(values)`` fills in the remaining per-call
    arguments (name → tensor or integer) and launches; what Triton's binding, the argument dicts
    and ~20 ``data_ptr`` calls cost per call is gone (the small-batch exchange's host time)."""

    __slots__ = ("_run", "_args", "_rest", "_launcher")

    def __init__(self, run: Callable, args: list, rest: tuple, launcher: Launcher) -> None:
        self._run, self._args, self._rest, self._launcher = run, args, rest, launcher

    def launch(self, values: dict) -> None:
        args = list(self._args)
        for i, name in self._rest:
            v = values[name]
            args[i] = v.data_ptr() if isinstance(v, torch.Tensor) else v
        self._launcher.calls["fast"] += 1
        self._run(*args)


def _pointer_as_int(v):
    """A tensor argument as its address (Triton's launchers take integers for pointers as they are)."""
    return v.data_ptr() if isinstance(v, torch.Tensor) else v


class DirectLaunch:
    """One compiled Triton kernel on one grid, launched with the fewest host steps: the current
    stream of ``device`` read through torch's raw-stream call, then Triton's C launcher. Triton's
    own ``compiled[grid](*args)`` also looks up the current device, builds launch metadata and
    reads the launch hooks through its knobs: ~5 µs per launch. Where a launch hook is set (a
    profiler such as proton) each launch goes through Triton's path, so the hooks still fire.

    :meth:`of` falls back to ``compiled[grid]`` on a Triton without ``run``/``packed_metadata``
    (:func:`fast_launch_works` checks the path on the device before any buffer uses it).
    """

    __slots__ = ("_run", "_function", "_packed", "_grid", "_index", "_hooks", "_fallback", "_stream")

    def __init__(self, compiled, grid3: tuple[int, int, int], device: torch.device,
                 raw_stream: Callable[[int], int] | None = None) -> None:
        self._fallback = compiled[grid3]  # (also loads the module: run/function exist after it)
        self._run, self._function, self._packed = compiled.run, compiled.function, compiled.packed_metadata
        self._stream = raw_stream or torch._C._cuda_getCurrentRawStream  # the current stream's handle
        self._grid, self._index = grid3, device.index if device.index is not None else torch.cuda.current_device()
        self._hooks = _launch_hooks()

    @classmethod
    def of(cls, compiled, grid3: tuple[int, int, int], device: torch.device | None) -> Callable:
        if device is None or device.type != "cuda":
            return compiled[grid3]
        try:
            return cls(compiled, grid3, device)
        except (AttributeError, ImportError):
            return compiled[grid3]

    def __call__(self, *args) -> None:
        hooks = self._hooks
        if _hook_set(hooks.launch_enter_hook) or _hook_set(hooks.launch_exit_hook):
            self._fallback(*args)
            return
        gx, gy, gz = self._grid
        self._run(gx, gy, gz, self._stream(self._index), self._function, self._packed, None, None, None, *args)


def _hook_set(hook) -> bool:
    """Whether a Triton launch hook is set: a callable (Triton 3.6) or a non-empty HookChain (later)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_hooks():
    """Where this Triton keeps its launch hooks (``knobs.runtime``; the CompiledKernel class before)."""
    try:
        from triton import knobs
        return knobs.runtime
    except ImportError:
        from triton.compiler.compiler import CompiledKernel
        return CompiledKernel


@triton.jit(do_not_specialize=["n"])
def _probe_kernel(out_ptr, n, B: tl.constexpr, a_ptr, c):
    i = tl.arange(0, B)
    tl.store(out_ptr + i, tl.load(a_ptr + i) * n + c)


def fast_launch_works(device: torch.device) -> bool:
    """Whether this Triton's compiled kernels launch as :class:`Launcher` calls them (every
    argument in signature order, constexprs included, pointers as integers, through
    :class:`DirectLaunch`): a small kernel launched through a Launcher's JIT path, then its fast
    path with other values, and both results checked (one host sync; False on any error or
    difference, and on the CPU)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.arange(16, dtype=torch.int32, device=device)
        first, second = torch.zeros_like(a), torch.zeros_like(a)
        launcher = Launcher(fast=True, device=device)
        for out, n in ((first, 3), (second, 7)):
            launcher.launch(_probe_kernel, (1,), {"out_ptr": out, "n": n}, lambda: {"B": 16, "a_ptr": a, "c": 5},
                            4, ("probe",))
        torch.cuda.synchronize(device)
        return bool(launcher.calls == {"jit": 1, "fast": 1} and torch.equal(first, a * 3 + 5)
                    and torch.equal(second, a * 7 + 5))
    except Exception:  # another Triton: launch through the JIT
        return False
