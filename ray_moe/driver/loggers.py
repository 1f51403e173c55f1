"""Where a run's step metrics go besides ``metrics.jsonl``: Ray's metrics (always), TensorBoard and
Weights & Biases (``train.loggers``).

Each sink takes the records :class:`ray_moe.driver.metrics.MetricsLog` writes (a step record has
``loss``; an eval event has ``val_loss``) and keeps the scalars users chart: loss, validation loss,
tokens/s, step time, learning rate, gradient norm, expert-load imbalance.
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
import uuid
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ray_moe.config import Config, ConfigError

log = logging.getLogger(__name__)

# record key → chart name
SCALARS = MappingProxyType({
    "loss": "train/loss", "aux_loss": "train/aux_loss", "val_loss": "eval/loss",
    "tokens_per_s": "perf/tokens_per_s", "step_time": "perf/step_time_s", "lr": "train/lr",
    "grad_norm": "train/grad_norm", "imbalance": "moe/imbalance",
})


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The chartable numbers of one record, by chart name."""
    return {name: float(rec[key]) for key, name in SCALARS.items()
            if isinstance(rec.get(key), (int, float)) and not isinstance(rec.get(key), bool)}


def metric_tag(name: str) -> str:
    """``name`` as a Ray metric tag value: Ray encodes tags as ASCII, so a name with other
    characters (a run directory ``runs/über``) becomes its ASCII letters, digits and ``._-``
    plus a short hash of the whole name (distinct runs keep distinct tags)."""
    if name.isascii() and name.isprintable():
        return name
    kept = re.sub(r"[^A-Za-z0-9._-]+", "_", unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode())
    return f"{kept.strip('_') or 'run'}-{hashlib.sha1(name.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}"


class RayMetricsSink:
    """Gauges through ``ray.util.metrics``: exported by every node's metrics agent to Ray's
    Prometheus endpoint and the dashboard, tagged with the run's name."""

    def __init__(self, run_name: str) -> None:
        from ray.util.metrics import Gauge

        self.tags = {"run": metric_tag(run_name)}
        # Ray exports application metrics with a "ray_" prefix: these appear as ray_moe_train_loss, ...
        self.gauges = {
            name: Gauge("moe_" + name.replace("/", "_"), description=f"ray_moe {name}",
                        tag_keys=("run",))
            for name in (*SCALARS.values(), "train/step")
        }

    def rewind(self, step: int) -> None:
        pass

    def write(self, rec: dict[str, Any]) -> None:
        if not self.gauges:  # export stopped after an error
            return
        values = scalars(rec)
        if "loss" in rec:
            values["train/step"] = float(rec["step"])
        try:
            for name, value in values.items():
                self.gauges[name].set(value, tags=self.tags)
        except Exception as exc:  # noqa: BLE001 - Ray's metrics are best effort: training goes on
            log.warning("Ray metrics export stops: %s: %s", type(exc).__name__, exc)
            self.gauges = {}

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Event files under ``run_dir/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``)."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("train.loggers includes tensorboard but it does not import here "
                              f"({exc}); pip install tensorboard") from None
        self._writer_cls, self.log_dir = SummaryWriter, str(run_dir / "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def rewind(self, step: int) -> None:
        """Events after ``step`` are superseded (a resume or recovery replays them)."""
        self.writer.close()
        self.writer = self._writer_cls(log_dir=self.log_dir, purge_step=step + 1)

    def write(self, rec: dict[str, Any]) -> None:
        step = rec.get("step")
        if step is None:
            return
        for name, value in scalars(rec).items():
            self.writer.add_scalar(name, value, global_step=int(step))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (project ``ray-moe``, named after the run directory; files under
    ``run_dir/wandb``). ``WANDB_MODE=offline`` works without network; a resumed ray_moe run
    continues the same W&B run."""

    def __init__(self, run_dir: Path, run_name: str, config: Config) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("train.loggers includes wandb but the wandb package is not installed; "
                              "pip install wandb (or remove wandb from train.loggers)") from None
        id_file = run_dir / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self.run = wandb.init(project="ray-moe", name=run_name, id=run_id, resume="allow",
                              dir=str(run_dir), config=config.to_dict())

    def rewind(self, step: int) -> None:
        pass  # W&B keeps the first value it got for a step; replayed steps are equal anyway

    def write(self, rec: dict[str, Any]) -> None:
        if rec.get("step") is not None and scalars(rec):
            self.run.log(scalars(rec), step=int(rec["step"]))

    def close(self) -> None:
        self.run.finish()


def make_sinks(config: Config, run_dir: Path) -> list[Any]:
    """Ray's metrics plus the sinks ``train.loggers`` names."""
    run_name = run_dir.name
    sinks: list[Any] = []
    try:
        sinks.append(RayMetricsSink(run_name))
    except Exception as exc:  # noqa: BLE001 - metrics are best effort; training goes on
        log.warning("Ray metrics export is off: %s", exc)
    for name in config.train.loggers:
        sinks.append(TensorBoardSink(run_dir) if name == "tensorboard" else WandbSink(run_dir, run_name, config))
    return sinks
