"""Trainer: the driver API shared by the CLI, `ray job submit` jobs and notebooks.

    with Trainer.from_yaml("jobs/tiny.yaml", ["train.steps=20"]) as t:
        t.train()                 # progress bar, metrics.jsonl, checkpoints, plots
        print(t.evaluate(), t.expert_load())

Only control messages and small metrics pass through the driver; batches are built on the
workers and checkpoints are written by the workers themselves.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterable

from ray_moe.checkpoint import (
    CheckpointError,
    clean_staging,
    commit,
    latest_checkpoint,
    new_staging_dir,
    read_meta,
)
from ray_moe.config import Config, ConfigError
from ray_moe.group import GroupError, WorkerFailure, WorkerGroup, connect
from ray_moe.rebalance import Rebalancer
from ray_moe.topology import node_of_rank

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (bad data, too many failures, non-finite loss with nonfinite=stop)."""


class Trainer:
    def __init__(self, config: Config, address: str | None = None, progress: bool = True):
        config.validate()
        self.config = config
        self.address = address
        self.progress = progress
        self.run_dir = Path(config.train.run_dir).expanduser().resolve()
        self.metrics: list[dict[str, Any]] = []
        self.failures = 0
        self.group: WorkerGroup | None = None
        self.rebalancer: Rebalancer | None = None
        self.step_count = 0
        self.last_load: list[list[float]] | None = None
        # What a recovery restores: the last checkpoint this run saved or restored (never an
        # earlier run's checkpoint that happens to sit in the same run_dir).
        self.last_checkpoint: Path | None = None
        self._last_health = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        clean_staging(self.run_dir)
        self._metrics_file = self.run_dir / "metrics.jsonl"
        self._start_group()
        resumed = self.config.train.resume and latest_checkpoint(self.run_dir)
        if resumed:
            self.restore(resumed)
            self._log_event("resumed", checkpoint=str(resumed), step=self.step_count)
        else:
            self._metrics_file.write_text("")
        (self.run_dir / "config.yaml").write_text(config.to_yaml())

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Iterable[str] = (), **kwargs: Any) -> "Trainer":
        return cls(Config.from_yaml(path, overrides), **kwargs)

    # ------------------------------------------------------------------ group life cycle
    def _start_group(self) -> None:
        connect(self.address)
        self.group = WorkerGroup(self.config)
        try:
            self.describe = self.group.call("build_engine", timeout=self.config.parallel.startup_timeout_s + 120)
        except WorkerFailure as exc:
            self.group.close()
            self.group = None
            if exc.cause == "error":
                raise TrainingError(f"workers could not build the model and data: {exc}") from None
            raise
        self.rebalancer = (
            Rebalancer(self.config, node_of_rank(self.group.ranks))
            if self.config.balance.enabled else None
        )

    def _recover(self, failure: WorkerFailure) -> None:
        """Tear the group down, start a new one, restore the latest checkpoint, go on."""
        self.failures += 1
        self._log_event("failure", rank=failure.rank, cause=failure.cause, message=str(failure),
                        step=self.step_count, failures=self.failures)
        log.warning("worker failure (%s) at step %d: %s", failure.cause, self.step_count, failure)
        if self.failures > self.config.train.max_failures:
            raise TrainingError(
                f"{failure} (failure {self.failures}, train.max_failures={self.config.train.max_failures})"
            ) from failure
        if self.group is not None:
            self.group.close()
            self.group = None
        t0 = time.perf_counter()
        self._start_group_on_available()
        ckpt = self.last_checkpoint
        if ckpt is not None:
            try:
                read_meta(ckpt)
            except CheckpointError as exc:
                log.warning("cannot recover from %s (%s); restarting from step 0", ckpt, exc)
                ckpt = None
        if ckpt is not None:
            self.restore(ckpt)
        else:
            self.step_count = 0
        self._log_event("recovered", step=self.step_count, checkpoint=str(ckpt) if ckpt else None,
                        world_size=self.config.parallel.world_size,
                        seconds=time.perf_counter() - t0)

    def _start_group_on_available(self) -> None:
        """Same world size when the cluster still fits it, else the largest one that fits
        (checkpoints reshard, so training continues with the same global batch)."""
        wanted = self.config.parallel.world_size
        e, b = self.config.moe.num_experts, self.config.train.batch_size
        sizes = [w for w in range(wanted, 0, -1) if e % w == 0 and b % w == 0]
        last: Exception | None = None
        for w in sizes:
            if w != self.config.parallel.world_size:
                self.config = self.config.with_overrides([f"parallel.world_size={w}"])
            try:
                self._start_group()
                if w != wanted:
                    self._log_event("resized", world_size=w, wanted=wanted)
                return
            except GroupError as exc:  # does not fit: try a smaller group
                last = exc
        raise TrainingError(f"no worker group could be started after a failure: {last}")

    def _with_recovery(self, fn):
        while True:
            try:
                return fn()
            except WorkerFailure as exc:
                self._recover(exc)

    # ------------------------------------------------------------------ training
    def step(self, inject_nan_rank: int | None = None) -> dict[str, Any]:
        """One training step on every rank; returns the aggregated metrics of the step.

        ``inject_nan_rank`` makes that rank's loss NaN (fault injection for tests and smoke
        checks: the step must be skipped, or the run stopped, per ``train.nonfinite``).
        """
        return self._with_recovery(lambda: self._step_once(inject_nan_rank))

    def _step_once(self, poison_rank: int | None = None) -> dict[str, Any]:
        assert self.group is not None
        t = self.config.train
        now = time.monotonic()
        if now - self._last_health > t.health_check_interval_s:
            self.group.health_check(timeout=min(30.0, t.step_timeout_s))
            self._last_health = now
        t0 = time.perf_counter()
        args = [((r == poison_rank),) for r in range(self.group.world_size)]
        results = self.group.call_each("call_engine_step", args, timeout=t.step_timeout_s)
        wall = time.perf_counter() - t0
        m = self._aggregate(results, wall)
        self.step_count = m["step"]
        if self.rebalancer is not None:
            self.rebalancer.observe([r["load"]["expert_tokens"] for r in results])
            if self.rebalancer.due(self.step_count):
                self.rebalance()
        if m["nonfinite"]:
            self._log_event("nonfinite", step=m["step"], action="skipped" if t.nonfinite == "skip" else "stop")
            if t.nonfinite == "stop":
                self._record(m)
                raise TrainingError(f"non-finite loss or gradients at step {m['step']} (train.nonfinite=stop)")
        self._record(m)
        if t.checkpoint_interval and self.step_count % t.checkpoint_interval == 0:
            self.save()
        if t.eval_interval and self.step_count % t.eval_interval == 0:
            self.evaluate()
        return m

    def _aggregate(self, results: list[dict], wall: float) -> dict[str, Any]:
        W = len(results)
        tokens = sum(r["tokens"] for r in results)
        loads = [r["load"] for r in results]
        n_layers = len(loads[0]["expert_tokens"])
        expert_tokens = [
            [sum(l["expert_tokens"][i][e] for l in loads) for e in range(len(loads[0]["expert_tokens"][i]))]
            for i in range(n_layers)
        ]
        rank_pairs = [[l["received_pairs"][i] for l in loads] for i in range(n_layers)]
        imb = [max(p) / (sum(p) / W) if sum(p) > 0 else 1.0 for p in rank_pairs]
        self.last_load = expert_tokens
        return {
            "step": results[0]["step"],
            "loss": sum(r["loss"] for r in results) / W,
            "aux_loss": sum(r["aux_loss"] for r in results) / W,
            "lr": results[0]["lr"],
            "grad_norm": results[0]["grad_norm"],
            "skipped": results[0]["skipped"],
            "nonfinite": any(r["nonfinite"] for r in results),
            "tokens": tokens,
            "step_time": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "time_per_rank": {k: [r["time"][k] for r in results] for k in results[0]["time"]},
            "expert_tokens": expert_tokens,
            "rank_pairs": rank_pairs,
            "imbalance": sum(imb) / len(imb) if imb else 1.0,
            "imbalance_per_layer": imb,
        }

    def train(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Run until ``steps`` more steps are done (default: up to train.steps), then evaluate,
        checkpoint and plot. Returns the metrics of the steps run."""
        from tqdm.auto import tqdm

        target = self.step_count + steps if steps is not None else self.config.train.steps
        done: list[dict[str, Any]] = []
        bar = tqdm(total=max(0, target - self.step_count), disable=not self.progress, unit="step",
                   dynamic_ncols=True)
        try:
            while self.step_count < target:
                m = self.step()
                done.append(m)
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}",
                                step_s=f"{m['step_time']:.2f}")
        finally:
            bar.close()
        self.evaluate()
        self.save()
        if self.config.train.plots:
            self.plot()
        return done

    def rebalance(self) -> dict[str, Any]:
        """Plan clone placements from the loads seen so far and apply the changed layers."""
        assert self.group is not None and self.rebalancer is not None
        t0 = time.perf_counter()
        changes, report = self.rebalancer.plan()
        moved = 0
        if any(c is not None for c in changes):
            moved = sum(self.group.call("call_engine", "set_placements", changes,
                                        timeout=self.config.train.step_timeout_s))
        report.update(step=self.step_count, bytes_moved=moved, seconds=time.perf_counter() - t0)
        self._log_event("rebalance", **report)
        return report

    def evaluate(self, batches: int | None = None) -> float:
        assert self.group is not None
        val = self._with_recovery(
            lambda: self.group.call("call_engine", "evaluate", batches, timeout=self.config.train.step_timeout_s)[0]
        )
        self._log_event("eval", step=self.step_count, val_loss=val)
        return val

    def expert_load(self) -> list[list[float]] | None:
        """Tokens per logical expert per MoE layer in the last step (summed over ranks)."""
        return self.last_load

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint the current step under run_dir/checkpoints (atomic)."""
        assert self.group is not None
        staging = new_staging_dir(self.run_dir, self.step_count)
        files = self.group.call("save_shard", str(staging), timeout=self.config.train.step_timeout_s)
        meta = {
            "step": self.step_count,
            "opt_steps": self.group.call("call_engine", "counters")[0]["opt_steps"],
            "world_size": self.group.world_size,
            "config": self.config.to_dict(),
            "time": time.time(),
        }
        path = commit(staging, meta, files)
        self.last_checkpoint = path
        self._log_event("checkpoint", step=self.step_count, path=str(path))
        return path

    def restore(self, path: str | Path | None = None) -> int:
        """Load a checkpoint (default: run_dir's latest) into the current group; returns its step."""
        assert self.group is not None
        if path is None:
            path = latest_checkpoint(self.run_dir)
            if path is None:
                raise CheckpointError(f"no complete checkpoint under {str(self.run_dir)!r}")
        path = Path(path).expanduser().resolve()
        meta = read_meta(path)
        m = meta["config"]["model"]
        for key in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
            if m[key] != getattr(self.config.model, key):
                raise ConfigError(
                    f"model.{key}={getattr(self.config.model, key)} but checkpoint {str(path)!r} has {m[key]}"
                )
        e = meta["config"]["moe"]
        for key in ("num_experts", "expert_hidden"):
            if e[key] != getattr(self.config.moe, key):
                raise ConfigError(f"moe.{key}={getattr(self.config.moe, key)} but checkpoint has {e[key]}")
        steps = self.group.call("load_checkpoint", str(path), timeout=self.config.train.step_timeout_s)
        self.step_count = steps[0]
        self.last_checkpoint = path
        if self.rebalancer is not None:
            self.rebalancer.reset()  # the workers are back on native placements
        return self.step_count

    # ------------------------------------------------------------------ records
    def _record(self, m: dict[str, Any]) -> None:
        self.metrics.append(m)
        with open(self._metrics_file, "a") as f:
            f.write(json.dumps(m) + "\n")

    def _log_event(self, event: str, **fields: Any) -> None:
        rec = {"event": event, **fields}
        if event == "eval":
            rec["val_loss"] = fields["val_loss"]
        self.metrics.append(rec)
        with open(self._metrics_file, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def plot(self) -> list[Path]:
        from ray_moe.plots import expert_load_heatmap, imbalance_curve, loss_curve

        steps = [m for m in self.metrics if "loss" in m or "val_loss" in m]
        out = [loss_curve(steps, self.run_dir / "loss.png"),
               imbalance_curve(self.metrics, self.run_dir / "imbalance.png")]
        totals = None
        for m in self.metrics:
            if "expert_tokens" in m:
                if totals is None:
                    totals = [list(row) for row in m["expert_tokens"]]
                else:
                    totals = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(totals, m["expert_tokens"])]
        if totals:
            out.append(expert_load_heatmap(totals, self.run_dir / "expert_load.png",
                                           "tokens per expert (whole run)"))
        return out

    def summary(self) -> dict[str, Any]:
        steps = [m for m in self.metrics if "loss" in m]
        evals = [m["val_loss"] for m in self.metrics if "val_loss" in m]
        if not steps:
            return {"steps": self.step_count, "val_loss": evals[-1] if evals else None}
        return {
            "steps": self.step_count,
            "first_loss": steps[0]["loss"],
            "last_loss": steps[-1]["loss"],
            "val_loss": evals[-1] if evals else None,
            "mean_tokens_per_s": sum(m["tokens_per_s"] for m in steps) / len(steps),
            "mean_step_time_s": sum(m["step_time"] for m in steps) / len(steps),
            "mean_imbalance": sum(m["imbalance"] for m in steps) / len(steps),
            "last_imbalance": steps[-1]["imbalance"],
            "rebalances": sum(m.get("event") == "rebalance" for m in self.metrics),
            "clone_bytes_moved": sum(m.get("bytes_moved", 0) for m in self.metrics if m.get("event") == "rebalance"),
            **self._last_rebalance_summary(),
            "skipped_steps": sum(bool(m["skipped"]) for m in steps),
            "failures": self.failures,
            "world_size": self.config.parallel.world_size,
            "transport": self.group.transport_name if self.group else None,
            "run_dir": str(self.run_dir),
        }

    def _last_rebalance_summary(self) -> dict[str, Any]:
        last = [m for m in self.metrics if m.get("event") == "rebalance"]
        if not last:
            return {}
        r = last[-1]
        return {"planned_imbalance_before": max(r["imbalance_before"]),
                "planned_imbalance_after": max(r["imbalance_after"]),
                "last_rebalance_s": r["seconds"]}

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Trainer", "TrainingError", "GroupError", "WorkerFailure"]
