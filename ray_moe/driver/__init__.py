"""The driver: the Trainer (training steps, metrics, checkpoints, recovery, re-cloning) and the
worker group it drives (placement group, ranks, rendezvous, typed calls).

The names below load on first use, so that importing a Ray-free part of the package
(:mod:`ray_moe.driver.errors`, ``plots``) does not import Ray."""

from __future__ import annotations

from ray_moe.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "GroupError": "ray_moe.driver.errors",
    "WorkerFailure": "ray_moe.driver.errors",
    "TrainingError": "ray_moe.driver.errors",
    "WorkerGroup": "ray_moe.driver.group",
    "connect": "ray_moe.driver.group",
    "Trainer": "ray_moe.driver.trainer",
})
