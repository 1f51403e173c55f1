"""Skewed routings for benchmarks and tests: Zipf expert popularity, and routing by a placement's
on-device rule (what the planner is measured against)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ray_moe.placement.placement import Placement


@dataclass
class ZipfRouting:
    """Expert popularity ∝ rank^-s, with the popularity ranks at a random permutation of experts.

    probs: float64 [E] (sums to 1). s = 0 is uniform.
    """

    probs: np.ndarray

    @classmethod
    def make(cls, num_experts: int, s: float, seed: int) -> "ZipfRouting":
        g = np.random.default_rng(seed)
        order = g.permutation(num_experts)
        p = np.empty(num_experts)
        p[order] = np.arange(1, num_experts + 1, dtype=np.float64) ** (-s)
        return cls(p / p.sum())

    def draw(self, world_size: int, tokens_per_rank: int, top_k: int,
             generator: torch.Generator) -> torch.Tensor:
        """int64 [W, T, K]: each source rank's tokens' K distinct experts (Gumbel top-k)."""
        logp = torch.from_numpy(np.log(self.probs)).to(torch.float32)
        u = torch.rand(world_size, tokens_per_rank, len(self.probs), generator=generator)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-20)))
        return (logp + gumbel).topk(top_k, dim=-1).indices

    @staticmethod
    def counts(ids: torch.Tensor, num_experts: int) -> np.ndarray:
        """float64 [W, E] tokens per source rank and expert from ids [W, T, K]."""
        W = ids.shape[0]
        flat = ids.reshape(W, -1) + torch.arange(W).view(W, 1) * num_experts
        return torch.bincount(flat.flatten(), minlength=W * num_experts).view(W, num_experts).double().numpy()


def routed_imbalance(ids: torch.Tensor, placement: Placement) -> float:
    """max/mean (token, expert) pairs per rank when ids [W, T, K] are routed by the placement's
    on-device rule (:meth:`PlacementTables.route`, the deterministic hash), not in expectation."""
    tables = placement.tables("cpu")
    per_rank = torch.zeros(placement.world_size, dtype=torch.float64)
    for s in range(ids.shape[0]):
        dest, _ = tables.route(ids[s], s)
        per_rank += torch.bincount(dest.flatten().long(), minlength=placement.world_size).double()
    mean = per_rank.mean().item()
    return per_rank.max().item() / mean if mean > 0 else 1.0
