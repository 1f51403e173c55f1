"""Load statistics: an exponential moving average of tokens per logical expert (per source rank).

The driver feeds it the per-rank counts the workers measure on the device every step; the clone
planner (:mod:`ray_moe.placement.planner`) plans from its averages. Its state is part of a
checkpoint (:meth:`LoadTracker.state_dict`), so a resumed run plans exactly as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ArrayLike = Any  # numpy array, torch tensor or nested lists of numbers


def as_f64(x: ArrayLike) -> np.ndarray:
    """float64 numpy copy of a tensor, array or nested list."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


class LoadTracker:
    """Exponential moving average of per-expert token counts, per layer (and per source rank).

    Feed :meth:`update` with the counts of one window (a step or an interval):
    ``[layers, E]`` (tokens per logical expert) or ``[layers, W_src, E]`` (per source rank: what
    each worker's ``MoELayer.pop_load`` returns, stacked). The first update sets the average;
    later ones do ``avg = ema * avg + (1 - ema) * counts``.
    """

    def __init__(self, num_layers: int, num_experts: int, world_size: int | None = None,
                 ema: float = 0.9) -> None:
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema={ema} must be in [0, 1)")
        self.num_layers, self.num_experts, self.world_size, self.ema = num_layers, num_experts, world_size, ema
        self._avg: np.ndarray | None = None  # float64 [layers, W_src, E] (W_src = 1 if not per source)
        self.updates = 0

    def update(self, counts: ArrayLike) -> None:
        """counts: float/int [layers, E] or [layers, W_src, E] tokens routed in the window."""
        c = as_f64(counts)
        L, E = self.num_layers, self.num_experts
        if c.ndim == 2:
            c = c[:, None, :]
        if c.ndim != 3 or c.shape[0] != L or c.shape[2] != E:
            raise ValueError(f"counts has shape {tuple(as_f64(counts).shape)}; expected "
                             f"[{L}, {E}] or [{L}, W_src, {E}]")
        if self.world_size is not None and c.shape[1] not in (1, self.world_size):
            raise ValueError(f"counts has {c.shape[1]} source ranks; expected {self.world_size}")
        if (c < 0).any() or not np.isfinite(c).all():
            raise ValueError("counts must be finite and >= 0")
        if self._avg is not None and self._avg.shape != c.shape:
            raise ValueError(f"counts has shape {c.shape} but earlier updates had {self._avg.shape}")
        self._avg = c.copy() if self._avg is None else self.ema * self._avg + (1.0 - self.ema) * c
        self.updates += 1

    @property
    def loads(self) -> np.ndarray:
        """float64 [layers, E]: averaged tokens per logical expert (zeros before any update)."""
        if self._avg is None:
            return np.zeros((self.num_layers, self.num_experts))
        return self._avg.sum(1)

    @property
    def source_loads(self) -> np.ndarray | None:
        """float64 [layers, W_src, E], or None when the updates were not per source rank."""
        if self._avg is None or self._avg.shape[1] == 1 and (self.world_size or 1) != 1:
            return None
        return self._avg.copy()

    def reset(self) -> None:
        self._avg, self.updates = None, 0

    def state_dict(self) -> dict:
        return {"avg": None if self._avg is None else self._avg.tolist(), "updates": self.updates,
                "ema": self.ema}

    def load_state_dict(self, state: dict) -> None:
        self._avg = None if state["avg"] is None else np.asarray(state["avg"], dtype=np.float64)
        self.updates, self.ema = int(state["updates"]), float(state["ema"])
