"""The driver: the Trainer (training steps, metrics, checkpoints, recovery, re-cloning) and the
worker group it drives (placement group, ranks, rendezvous, typed calls).

The names below load on first use, so that importing a Ray-free part of the package
(:mod:`ray_moe.driver.errors`, ``plots``) does not import Ray."""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

_PUBLIC = MappingProxyType({
    "GroupError": "ray_moe.driver.errors",
    "WorkerFailure": "ray_moe.driver.errors",
    "TrainingError": "ray_moe.driver.errors",
    "WorkerGroup": "ray_moe.driver.group",
    "connect": "ray_moe.driver.group",
    "Trainer": "ray_moe.driver.trainer",
})

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ray_moe.driver' has no attribute {name!r}")
