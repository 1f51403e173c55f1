"""The driver: the Trainer (training steps, metrics, checkpoints, recovery, re-cloning) and the
worker group it drives (placement group, ranks, rendezvous, typed calls)."""

from ray_moe.driver.group import GroupError, WorkerFailure, WorkerGroup, connect
from ray_moe.driver.trainer import Trainer, TrainingError

__all__ = ["GroupError", "Trainer", "TrainingError", "WorkerFailure", "WorkerGroup", "connect"]
