"""The run's records: per-step metrics aggregated over ranks, events, the summary, and plots.

One :class:`MetricsLog` per run keeps every record in memory (``Trainer.metrics``) and appends it
to ``metrics.jsonl`` in the run directory: a step record has ``loss``; an event record has
``event`` (``eval``, ``checkpoint``, ``failure``, ``recovered``, ``rebalance``, ...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ray_moe.driver.errors import WriteError


def aggregate_step(results: list[dict[str, Any]], wall: float, ep: int | None = None) -> dict[str, Any]:
    """One step's record from every rank's result (``EPWorker.step``), in rank order.

    Loss and auxiliary loss are means over ranks; tokens a sum; ``expert_tokens[layer][e]`` the
    tokens routed to logical expert e from all ranks; ``rank_pairs[layer][rank]`` the (token,
    expert) pairs each rank computed; ``imbalance_per_group[g][layer]`` max/mean of those over the
    ranks of EP group g (``ep``: ranks per EP group of the rank mesh, default the world: rows move
    only inside a group, so balance is a group's); ``imbalance_per_layer`` their mean over the
    groups and ``imbalance`` its mean over layers. ``replica_reduce_max``: the slowest rank's
    exposed reduction of the DP replicas' expert gradients (0 at DP 1).
    """
    W = len(results)
    ep = ep or W
    tokens = sum(r["tokens"] for r in results)
    loads = [r["load"] for r in results]
    n_layers = len(loads[0]["expert_tokens"])
    expert_tokens = [
        [sum(ld["expert_tokens"][i][e] for ld in loads) for e in range(len(loads[0]["expert_tokens"][i]))]
        for i in range(n_layers)
    ]
    rank_pairs = [[ld["received_pairs"][i] for ld in loads] for i in range(n_layers)]
    groups = [range(g, g + ep) for g in range(0, W, ep)]
    per_group = [[max(p[r] for r in rs) / (sum(p[r] for r in rs) / ep) if sum(p[r] for r in rs) > 0 else 1.0
                  for p in rank_pairs] for rs in groups]
    imb = [sum(g[i] for g in per_group) / len(per_group) for i in range(n_layers)]
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
        "imbalance_per_group": per_group,
        "replica_reduce_max": max(r["time"].get("replica_reduce", 0.0) for r in results),
    }


# Events that stay in the history when the run goes back to an earlier step (recovery, resume):
# they say what happened, and happened once.
HISTORY_EVENTS = ("failure", "recovered", "resumed", "corrupt_checkpoint", "preempted", "resized")


def append_line(path: Path, line: str) -> None:
    """Append ``line`` to ``path`` whole or not at all (:class:`WriteError` naming the path and
    errno; a part written before the error is truncated away)."""
    data = memoryview(line.encode("utf-8"))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as exc:
        raise WriteError(path, exc) from None
    try:
        size = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as exc:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise WriteError(path, exc) from None
    finally:
        os.close(fd)


class MetricsLog:
    """Records of one run, in memory and appended to ``path`` (JSON lines), and handed to the
    run's other sinks (:mod:`ray_moe.driver.loggers`).

    Each step appears once: when the run goes back to step s (a resume or a recovery),
    :meth:`rewind` drops the records of later steps before new ones are written.
    """

    def __init__(self, path: Path, sinks: list[Any] | None = None) -> None:
        self.path = path
        self.sinks = list(sinks or [])
        self.records: list[dict[str, Any]] = []

    def start_fresh(self) -> None:
        """An empty file (a fresh run; run_dir.plan_start made sure nothing is lost)."""
        try:
            self.path.write_text("")
        except OSError as exc:
            raise WriteError(self.path, exc) from None
        self.records = []

    def load(self) -> None:
        """The records an earlier part of this run wrote (a resume): the summary covers the whole
        run. A torn last line (a crash mid-write) is dropped."""
        self.records = []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    self.records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue

    def rewind(self, step: int) -> int:
        """Drop records of steps after ``step`` (history events stay); rewrite the file atomically.
        Returns how many records were dropped."""
        keep = [r for r in self.records
                if r.get("event") in HISTORY_EVENTS or r.get("step", 0) <= step]
        dropped = len(self.records) - len(keep)
        self.records = keep
        tmp = self.path.with_suffix(".jsonl.tmp")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            os.replace(tmp, self.path)
        except OSError as exc:  # the file stays as it was
            tmp.unlink(missing_ok=True)
            raise WriteError(self.path, exc) from None
        for sink in self.sinks:
            sink.rewind(step)
        return dropped

    def record(self, rec: dict[str, Any]) -> None:
        """Append ``rec`` as one whole line: a write that fails (a full disk) is cut back to the
        file as it was and raised as :class:`WriteError`, and ``rec`` is not kept."""
        append_line(self.path, json.dumps(rec) + "\n")
        self.records.append(rec)
        for sink in self.sinks:
            sink.write(rec)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def event(self, event: str, **fields: Any) -> None:
        self.record({"event": event, **fields})

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [m for m in self.records if "loss" in m]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [m for m in self.records if m.get("event") == name]

    def summary(self) -> dict[str, Any]:
        """The run so far: losses, throughput, imbalance, re-cloning, skipped steps."""
        steps = self.steps
        evals = [m["val_loss"] for m in self.records if "val_loss" in m]
        if not steps:
            return {"val_loss": evals[-1] if evals else None}
        rebalances = self.events("rebalance")
        out = {
            "first_loss": steps[0]["loss"],
            "last_loss": steps[-1]["loss"],
            "val_loss": evals[-1] if evals else None,
            "mean_tokens_per_s": sum(m["tokens_per_s"] for m in steps) / len(steps),
            "mean_step_time_s": sum(m["step_time"] for m in steps) / len(steps),
            "mean_imbalance": sum(m["imbalance"] for m in steps) / len(steps),
            "last_imbalance": steps[-1]["imbalance"],
            "rebalances": len(rebalances),
            "clone_bytes_moved": sum(m.get("bytes_moved", 0) for m in rebalances),
        }
        if rebalances:
            r = rebalances[-1]
            out.update(planned_imbalance_before=max(r["imbalance_before"]),
                       planned_imbalance_after=max(r["imbalance_after"]), last_rebalance_s=r["seconds"])
        out["skipped_steps"] = sum(bool(m["skipped"]) for m in steps)
        return out

    def plot(self, run_dir: Path, unit: str = "nats/byte", blocks: list[int] | None = None) -> list[Path]:
        """loss.png (cross-entropy in ``unit``), imbalance.png and expert_load.png (tokens per expert
        over the whole run; rows labelled with ``blocks``, each MoE layer's block index)."""
        from ray_moe.driver.plots import (
            expert_load_heatmap,
            imbalance_curve,
            loss_curve,
        )

        curves = [m for m in self.records if "loss" in m or "val_loss" in m]
        out = [loss_curve(curves, run_dir / "loss.png", unit),
               imbalance_curve(self.records, run_dir / "imbalance.png")]
        totals: list[list[float]] | None = None
        for m in self.records:
            if "expert_tokens" in m:
                if totals is None:
                    totals = [list(row) for row in m["expert_tokens"]]
                else:
                    totals = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(totals, m["expert_tokens"])]
        if totals:
            out.append(expert_load_heatmap(totals, run_dir / "expert_load.png", "tokens per expert (whole run)",
                                           blocks))
        return out
