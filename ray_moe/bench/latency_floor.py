"""The latency floor of a small exchange: the parts of a dispatch + combine pair no tuning removes.

At T_local=128 and W=2 the pair replayed from a CUDA graph took 25.7-32.7 µs (H200 x2, measured
2026-11-26) against a target of 20, whatever the number of programs. Its fixed parts, each
timed alone here and by ``bench comm`` beside the pair in the same run:

- **two kernel launches from a graph** (:func:`empty_kernel`): the dispatch and the combine are
  one kernel each;
- **one signal across NVLink and back** (:func:`ping_pong`): a dispatch's receiver waits for the
  sender's release store to its flag (one crossing), and the next call's sender for the receiver's
  acknowledgement; one program per rank bounces a counter ``rounds`` times in one kernel, so the
  one-way latency is the kernel's time / (2 rounds);
- **the layout's grid-wide wait** (:func:`grid_sync`): every program of the dispatch publishes its
  counts and waits for all G before any row moves.

Kernel + launcher + reference here (the reference is the counts each kernel leaves behind); every
wait is bounded (``spin_limit`` polls) and a timeout is written to ``err`` ([1] int32, 1 = timed out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1)


def empty_kernel(out: torch.Tensor) -> None:
    """One launch of a kernel that stores 1 into ``out`` (int32 [G], one program per element)."""
    _empty_kernel[(out.numel(),)](out, num_warps=1)


@triton.jit(do_not_specialize=["base", "rounds", "spin_limit"])
def _ping_pong_kernel(local_ptr, peer_addr, err_ptr, base, rounds, spin_limit, FIRST: tl.constexpr):
    peer = peer_addr.to(tl.pointer_type(tl.int64))
    failed = 0
    for i in range(rounds):
        if failed == 0:
            if FIRST:  # serve: tell the peer, then wait for its answer
                tl.atomic_add(peer, 1, sem="release", scope="sys")
            want = base + i + 1
            v = tl.atomic_add(local_ptr, 0, sem="acquire", scope="sys")
            n = 0
            while (v < want) & (n < spin_limit):
                v = tl.atomic_add(local_ptr, 0, sem="acquire", scope="sys")
                n += 1
            if v < want:
                failed = 1
                tl.atomic_xchg(err_ptr, 1)
            if not FIRST:  # answer what arrived
                if v >= want:
                    tl.atomic_add(peer, 1, sem="release", scope="sys")


def ping_pong(local: torch.Tensor, peer_addr: int, err: torch.Tensor, base: int, rounds: int, first: bool,
              spin_limit: int = 1 << 24) -> None:
    """Bounce a counter ``rounds`` times between two ranks in one single-program kernel.

    Args:
        local: int64 [1], this rank's word (symmetric memory: the peer adds to it).
        peer_addr: the peer's word, as an address this device can store to (a peer pointer).
        err: int32 [1], set to 1 if a wait gave up after ``spin_limit`` polls.
        base: the value ``local`` held before this call (both ranks pass the same: calls x rounds).
        rounds: round trips; ``first``: this rank serves (the other answers).
    Each rank's word ends at ``base + rounds``.
    """
    _ping_pong_kernel[(1,)](local, peer_addr, err, base, rounds, spin_limit, FIRST=first, num_warps=1)


@triton.jit(do_not_specialize=["spin_limit"])
def _grid_sync_kernel(flags_ptr, err_ptr, spin_limit, G: tl.constexpr, G_PAD: tl.constexpr):
    pid = tl.program_id(0)
    call = tl.load(flags_ptr + pid)  # this program's launches so far (the device keeps the count:
    gq = tl.arange(0, G_PAD)         # a graph replays the launch unchanged)
    tl.atomic_xchg(flags_ptr + pid, call + 1, sem="release", scope="gpu")
    fl = tl.atomic_add(flags_ptr + gq, 0, mask=gq < G, sem="acquire", scope="gpu")
    fl = tl.where(gq < G, fl, call + 1)
    n = 0
    while (tl.min(fl, axis=0) < call + 1) & (n < spin_limit):
        fl = tl.atomic_add(flags_ptr + gq, 0, mask=gq < G, sem="acquire", scope="gpu")
        fl = tl.where(gq < G, fl, call + 1)
        n += 1
    if tl.min(fl, axis=0) < call + 1:
        tl.atomic_xchg(err_ptr, 1)


def grid_sync(flags: torch.Tensor, err: torch.Tensor, spin_limit: int = 1 << 24, num_warps: int = 16) -> None:
    """G programs each publish one more launch in ``flags`` (int32 [G], zeros at first: each ends
    at the launches so far) and wait until all G have, as the dispatch's layout does (every program
    must be resident: G <= the SMs). ``err`` as in :func:`ping_pong`. ``num_warps``: the exchange
    kernels' default for wide rows."""
    G = flags.numel()
    _grid_sync_kernel[(G,)](flags, err, spin_limit, G=G, G_PAD=triton.next_power_of_2(G), num_warps=num_warps)
