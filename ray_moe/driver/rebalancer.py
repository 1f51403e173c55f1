"""Driver-side re-cloning: collect expert loads, plan placements every ``balance.interval`` steps.

The workers count tokens per logical expert on the device every step (no host sync inside the
step); the Trainer hands each step's per-rank counts to :meth:`Rebalancer.observe`. At every
interval the loads since the last plan go into an EMA (:class:`ray_moe.balance.LoadTracker`) and
:func:`ray_moe.balance.plan_layers` makes one placement per MoE layer; only layers whose plan
changed are sent to the workers, which copy the new clones' weights GPU-to-GPU from the owners.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ray_moe.balance import LoadTracker, plan_layers, plan_report
from ray_moe.config import Config
from ray_moe.placement import Placement


class Rebalancer:
    def __init__(self, config: Config, node_of_rank: list[int]):
        self.config = config
        b, m, e = config.balance, config.model, config.moe
        self.world_size = config.parallel.world_size
        self.node_of_rank = node_of_rank
        self.num_layers = m.n_layers - (1 if m.dense_first_layer else 0)
        self.tracker = LoadTracker.from_config(b, self.num_layers, e.num_experts, self.world_size)
        self.placements = [
            Placement.native(e.num_experts, self.world_size, b.clone_slots) for _ in range(self.num_layers)
        ]
        self._window = np.zeros((self.num_layers, self.world_size, e.num_experts))
        itemsize = 2 if m.dtype == "bfloat16" else 4
        self.bytes_per_expert = 3 * m.d_model * e.expert_hidden * itemsize

    def observe(self, per_rank_expert_tokens: list[list[list[float]]]) -> None:
        """per_rank_expert_tokens[rank][layer][expert]: tokens routed from that rank this step."""
        self._window += np.asarray(per_rank_expert_tokens, dtype=np.float64).transpose(1, 0, 2)

    def due(self, step: int) -> bool:
        return self.config.balance.enabled and step > 0 and step % self.config.balance.interval == 0

    def plan(self) -> tuple[list[dict | None], dict[str, Any]]:
        """New placements (None for layers that keep theirs) and a report for the metrics."""
        self.tracker.update(self._window)
        self._window[:] = 0
        b = self.config.balance
        new = plan_layers(
            self.tracker.loads, self.world_size, self.node_of_rank, b.clone_slots,
            previous=self.placements, max_cross_node_clones=b.max_cross_node_clones,
            source_loads=self.tracker.source_loads,
        )
        changes: list[dict | None] = []
        reports = []
        for i, (old, p) in enumerate(zip(self.placements, new)):
            rep = plan_report(self.tracker.source_loads[i], old, p, self.bytes_per_expert, self.node_of_rank)
            reports.append(rep)
            changes.append(None if p is old else p.to_dict())
        self.placements = list(new)
        summary = {
            "layers_changed": sum(c is not None for c in changes),
            "imbalance_before": [r["imbalance_before"] for r in reports],
            "imbalance_after": [r["imbalance_after"] for r in reports],
            "bytes_planned": sum(r.get("bytes_to_move", 0) for r in reports),
            "versions": [p.version for p in self.placements],
        }
        return changes, summary

    def reset(self) -> None:
        """Back to native placements (after a restore: checkpoints hold native experts only)."""
        self.__init__(self.config, self.node_of_rank)
