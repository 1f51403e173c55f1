"""Where experts live: placements (logical expert → physical rank and slot, clones), load
statistics, the clone planner, clone coherence, and skewed routings for benchmarks.

- :mod:`placement`: :class:`Placement`, :class:`PlacementTables` (device-side replica choice),
  :class:`ExpertShard` (the mark on expert-sharded parameters).
- :mod:`loads`: :class:`LoadTracker`, the EMA of tokens per expert the planner reads.
- :mod:`planner`: :func:`plan_placement` / :func:`plan_layers` (node-aware, deterministic).
- :mod:`clones`: clone gradients onto owners, owners' weights into clones (GPU-to-GPU).
- :mod:`sim`: Zipf-skewed routings.
"""

from ray_moe.placement.placement import (
    ExpertShard,
    Placement,
    PlacementTables,
    Replica,
    expert_shard,
)

__all__ = ["ExpertShard", "Placement", "PlacementTables", "Replica", "expert_shard"]
