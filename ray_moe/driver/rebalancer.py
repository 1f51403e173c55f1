"""Driver-side re-cloning: collect expert loads, plan placements every ``balance.interval`` steps.

The workers count tokens per logical expert on the device every step (no host sync inside the
step); the Trainer hands each step's per-rank counts to :meth:`Rebalancer.observe`. At every
interval the loads since the last plan go into an EMA (:class:`ray_moe.placement.loads.LoadTracker`)
and :func:`ray_moe.placement.planner.plan_layers` makes one placement per MoE layer; only layers
whose plan changed are sent to the workers, which copy the new clones' weights GPU-to-GPU from
the owners.

Every fact about the model comes from the workers' :class:`~ray_moe.worker.engine.ModelReport`
(MoE layers, native placement, bytes per expert); the world size and node of each rank from the
group. The state (EMA, the window since the last plan, the placements) goes into checkpoints.

On a rank mesh (:mod:`ray_moe.mesh`) the plan is one per layer for every EP group: the replicas
must keep one placement for their expert gradients to line up, so the loads of EP rank e are
summed over its DP replicas (each EP group routes its own tokens the same way), and the planner
sees one EP group of ``mesh.ep`` ranks on the nodes of the first one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ray_moe.config import BalanceConfig
from ray_moe.mesh import MeshSpec
from ray_moe.placement.loads import LoadTracker
from ray_moe.placement.placement import Placement
from ray_moe.placement.planner import plan_layers, plan_report
from ray_moe.worker.engine import ModelReport


class Rebalancer:
    def __init__(self, balance: BalanceConfig, report: ModelReport, node_of_rank: list[int],
                 mesh: MeshSpec | None = None):
        """``node_of_rank``: every rank's node (the world's); ``mesh``: the group's (default:
        expert parallelism over the whole world)."""
        self.balance = balance
        self.mesh = mesh or MeshSpec.whole(len(node_of_rank))
        if self.mesh.world != len(node_of_rank):
            raise ValueError(f"mesh of {self.mesh.world} ranks for a group of {len(node_of_rank)}")
        self.node_of_rank = list(node_of_rank)[: self.mesh.ep]  # the first EP group's (the plan's ranks)
        self.world_size = self.mesh.ep
        self.num_layers = len(report.moe_layers)
        self.num_experts = report.num_experts
        self.native = Placement.from_dict(report.native_placement)
        if self.native.world_size != self.world_size:
            raise ValueError(f"the workers report a placement for W={self.native.world_size}; "
                             f"the group has {self.world_size} ranks")
        self.bytes_per_expert = report.expert_bytes
        self.tracker = LoadTracker(self.num_layers, self.num_experts, self.world_size, ema=balance.ema)
        self.placements = [self.native] * self.num_layers
        self._window = np.zeros((self.num_layers, self.world_size, self.num_experts))

    def observe(self, per_rank_expert_tokens: list[list[list[float]]]) -> None:
        """per_rank_expert_tokens[rank][layer][expert]: tokens routed from that rank this step (every
        rank of the world; an EP rank's replicas are summed)."""
        counts = np.asarray(per_rank_expert_tokens, dtype=np.float64)
        counts = counts.reshape((self.mesh.dp, self.mesh.ep) + counts.shape[1:]).sum(0)
        self._window += counts.transpose(1, 0, 2)

    def due(self, step: int) -> bool:
        return self.balance.enabled and step > 0 and step % self.balance.interval == 0

    def plan(self) -> tuple[list[dict | None], dict[str, Any]]:
        """New placements (None for layers that keep theirs) and a report for the metrics."""
        self.tracker.update(self._window)
        self._window[:] = 0
        b = self.balance
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
        """Back to native placements with no load history (a restore at another world size)."""
        self.tracker.reset()
        self.placements = [self.native] * self.num_layers
        self._window[:] = 0

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state: the EMA, the loads seen since the last plan, the placements."""
        return {"tracker": self.tracker.state_dict(), "window": self._window.tolist(),
                "placements": [p.to_dict() for p in self.placements], "world_size": self.world_size,
                "mesh": self.mesh.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same world size and model; the caller checks)."""
        if state["world_size"] != self.world_size:
            raise ValueError(f"re-cloning state is for EP {state['world_size']}; the group has {self.world_size}")
        self.tracker.load_state_dict(state["tracker"])
        self._window = np.asarray(state["window"], dtype=np.float64).reshape(self._window.shape)
        self.placements = [Placement.from_dict(p) for p in state["placements"]]
