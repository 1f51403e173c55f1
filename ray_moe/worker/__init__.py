"""One rank of the group: the Ray actor (:class:`EPWorker`), its training engine (model shard,
optimizer, gradient sync) and the data it reads."""

from ray_moe.worker.actor import EPWorker
from ray_moe.worker.engine import Engine, ModelReport, buffer_spec

__all__ = ["EPWorker", "Engine", "ModelReport", "buffer_spec"]
