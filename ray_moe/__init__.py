"""ray_moe: expert-parallel Mixture-of-Experts training on a Ray cluster.

    from ray_moe import Config, Trainer
    with Trainer(Config.from_yaml("jobs/tiny.yaml")) as t:
        t.train()

The public names below load on first use, so importing a leaf package (``ray_moe.kernels``,
``ray_moe.comm``) does not pull in Ray or the driver.
"""

from __future__ import annotations

from ray_moe.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "Config": "ray_moe.config",
    "ConfigError": "ray_moe.config",
    "Trainer": "ray_moe.driver.trainer",
    "TrainingError": "ray_moe.driver.errors",
    "WorkerGroup": "ray_moe.driver.group",
    "GroupError": "ray_moe.driver.errors",
    "WorkerFailure": "ray_moe.driver.errors",
    "EPWorker": "ray_moe.worker.actor",
    "MoELayer": "ray_moe.model.moe",
    "MoELayerSpec": "ray_moe.model.moe",
    "Decoder": "ray_moe.model.decoder",
    "Placement": "ray_moe.placement.placement",
    "CheckpointError": "ray_moe.checkpoint",
})


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
