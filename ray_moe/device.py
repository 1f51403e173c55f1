"""Small device helpers shared by the engine, the benchmarks and the smoke test."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU, where work is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
