"""Per-pair point-to-point bandwidth between the ranks of a live group (torch.distributed).

    rows = group.execute(pair_bandwidth, nbytes, iters)   # rows[i][j]: GB/s rank i → rank j

Pairs are measured one at a time (a barrier between pairs), so no two transfers share a link.
For each ordered pair (src, dst) src sends ``nbytes`` to dst ``iters`` times and dst answers
every message with a one-byte acknowledgement; src times the whole exchange after one warm-up
round (which also creates NCCL's point-to-point communicator), so the figure is one direction's
rate including per-message latency. Works over gloo (CPU tensors) and NCCL (GPU tensors).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ray_moe.device import synchronize


def _exchange(buf: torch.Tensor, ack: torch.Tensor, peer: int, rounds: int, sender: bool) -> None:
    for _ in range(rounds):
        if sender:
            dist.send(buf, peer)
            dist.recv(ack, peer)
        else:
            dist.recv(buf, peer)
            dist.send(ack, peer)


def pair_bandwidth(worker: Any, nbytes: int, iters: int = 3) -> list[float | None]:
    """Run on every rank. Returns this rank's row: GB/s to each destination (None for itself)."""
    rank, world = worker.rank_info.rank, worker.rank_info.world_size
    device = worker.device
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
    ack = torch.zeros(1, dtype=torch.uint8, device=device)
    row: list[float | None] = [None] * world
    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            if rank in (src, dst):
                peer, sender = (dst, True) if rank == src else (src, False)
                _exchange(buf, ack, peer, 1, sender)  # warm-up
                synchronize(device)
                t0 = time.perf_counter()
                _exchange(buf, ack, peer, iters, sender)
                synchronize(device)
                if sender:
                    row[dst] = nbytes * iters / (time.perf_counter() - t0) / 1e9
            dist.barrier()
    return row
