"""What the benchmarks share: the device from ``--device``, synchronisation, peak-memory windows
(also on a group's workers: ``bench grad_reduce``, ``bench overlap``), freeing an engine's memory
before the next is built, and the RankInfo of the one rank the one-process benchmarks (``bench
train``, ``bench precision``) run (no group)."""

from __future__ import annotations

import gc
import platform

import torch

from ray_moe.topology import RankInfo


def pick_device(name: str) -> torch.device:
    """``--device``: auto (CUDA where available, else the CPU), cuda or cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def missing_device(prog: str, device: torch.device) -> str | None:
    """The one-line error of ``prog`` (e.g. ``ray-moe bench train``) when ``--device cuda`` names
    no GPU, else None."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"{prog}: error: --device cuda but CUDA is not available; use --device cpu or auto"
    return None


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Give the last engine's or loss's memory back to the device before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> int:
    """Start a peak-memory window; returns the bytes allocated now (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_gib(device: torch.device, base: int = 0) -> float | None:
    """GiB allocated at the peak since :func:`reset_peak`, less ``base`` (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


def reset_worker_peak(worker) -> None:
    """On a worker of a group (``group.execute(reset_worker_peak)``): :func:`reset_peak` of its engine's device."""
    reset_peak(worker.engine.device)


def worker_peak_gib(worker) -> float | None:
    """On a worker of a group: :func:`peak_gib` of its engine's device since :func:`reset_worker_peak`."""
    return peak_gib(worker.engine.device)


def one_rank(device: torch.device) -> RankInfo:
    """The RankInfo of the one rank (W = 1, no group) a benchmark's engine runs as on ``device``."""
    return RankInfo(0, 1, "local", 0, 1, 0, 1, "127.0.0.1", platform.node(), 0, 0 if device.type == "cuda" else -1)
