"""Trainer: the driver API shared by the CLI, `ray job submit` jobs and notebooks.

    with Trainer(Config.from_yaml("jobs/tiny.yaml", ["train.steps=20"])) as t:
        t.train()                 # progress bar, metrics.jsonl, checkpoints, plots
        print(t.evaluate(), t.expert_load())

Only control messages and small metrics pass through the driver; batches are built on the
workers and checkpoints are written by the workers themselves.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import operator
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, NoReturn, Sequence

import yaml

from ray_moe.checkpoint import (
    CheckpointError,
    check_compatible,
    clean_staging,
    commit,
    new_staging_dir,
    read_meta,
    scan_checkpoints,
    step_name,
)
from ray_moe.config import Config, ConfigError
from ray_moe.driver.errors import (
    CallRejected,
    GroupError,
    TrainerClosed,
    TrainingError,
    TrainingInterrupted,
    WorkerFailure,
    WriteError,
)
from ray_moe.driver.evaluation import EvaluationStopped, ProgressLines, evaluate_in_chunks
from ray_moe.driver.group import WorkerGroup, connect
from ray_moe.driver.loggers import make_sinks
from ray_moe.driver.metrics import MetricsLog, aggregate_step
from ray_moe.driver.preflight import preflight
from ray_moe.driver.progress import Progress
from ray_moe.driver.rebalancer import Rebalancer
from ray_moe.driver.run_dir import (
    archive_results,
    checkpoint_step,
    discard_untouched,
    lock_run_dir,
    plan_start,
    resolve_run_dir,
    run_dir_path,
    same_run,
    scan,
    set_aside,
)
from ray_moe.mesh import MeshSpec
from ray_moe.placement.placement import Placement
from ray_moe.topology import node_of_rank
from ray_moe.worker.actor import EPWorker
from ray_moe.worker.engine import ModelReport

log = logging.getLogger(__name__)


# Errors a worker raises that a new worker group would meet again: not retried, whatever
# train.max_failures says (bad data, bad config or checkpoint, a full or read-only disk, a shape
# that does not fit the device's memory: the new group has the same world size where it fits).
FATAL_ERRORS = ("DataError", "ConfigError", "CheckpointError", "WeightsError", "ArchError", "TrainingError",
                "OutOfMemoryError")
FATAL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
# Errors a worker raises for a call's own arguments or data (the user's mistake, not a broken
# worker): the call ends with one line, the run stays where it was, no failure is counted.
USER_ERRORS = ("ValueError", "TypeError", "DataError", "ConfigError", "ArchError")


def _original(failure: WorkerFailure) -> BaseException | None:
    """The exception a worker raised (Ray's RayTaskError carries it as ``cause``), or None."""
    return getattr(failure.__cause__, "cause", None) or failure.__cause__


def user_error(failure: WorkerFailure) -> bool:
    """True when a worker raised an error about the call's arguments or data (USER_ERRORS):
    not a worker failure; no new group would do better, and the group is still whole."""
    original = _original(failure) if failure.cause == "error" else None
    return original is not None and bool({c.__name__ for c in type(original).__mro__} & set(USER_ERRORS))


def retryable(failure: WorkerFailure) -> bool:
    """A dead or hung worker is retried on a new group; an error that a worker raised is not when
    it is one that no restart fixes (see FATAL_ERRORS, FATAL_ERRNOS)."""
    if failure.cause != "error":
        return True
    original = _original(failure)
    if original is None:
        return True
    if user_error(failure):
        return False
    names = {c.__name__ for c in type(original).__mro__}
    if names & set(FATAL_ERRORS):
        return False
    return not (isinstance(original, OSError) and original.errno in FATAL_ERRNOS)


class Trainer:
    """Runs training steps of one run on a worker group.

    Args:
        config: the run's configuration.
        address: Ray address to attach to (default: ``RAY_ADDRESS`` or a cluster started here).
        progress: show a progress bar in :meth:`train`.
        group: an existing :class:`WorkerGroup` to train on (its world size is the run's); the
            Trainer builds its engine there and leaves the group running on :meth:`close`. A group
            that a worker failure replaces is the Trainer's own from then on.
    """

    def __init__(self, config: Config, address: str | None = None, progress: bool = True,
                 group: WorkerGroup | None = None):
        self.arch = config.validate()  # the one resolution of the architecture; the workers build from it
        preflight(config, self.arch)  # what the workers would refuse (ConfigError, DataError): before anything starts
        self.config = config
        self.address = address
        self.progress = progress
        self.failures = 0
        self._closed = False
        self._has_val: bool | None = None
        self.group: WorkerGroup | None = None
        self._owns_group = group is None
        self.model_report: ModelReport | None = None
        self.rebalancer: Rebalancer | None = None
        self.step_count = 0
        self.last_load: list[list[float]] | None = None
        self.last_checkpoint: Path | None = None  # the newest checkpoint this run saved or restored
        self._last_health = time.monotonic()
        self._stop_signal: int | None = None
        self._progress: Progress | None = None
        if group is None:  # a cluster that cannot be reached leaves no run directory behind
            connect(address, timeout_s=config.parallel.startup_timeout_s)
        # The run directory next: a run that cannot keep its results does not start, and a
        # directory another run is writing is refused before anything in it is read or changed.
        made = not run_dir_path(config.train).exists()
        self.run_dir = resolve_run_dir(config.train)
        self._run_lock = lock_run_dir(self.run_dir)
        try:  # from here on, any failure closes what was started and releases the lock at once
            self._open_run(group)
        except BaseException:
            untouched = discard_untouched(self.run_dir)  # a start that failed leaves no empty files
            self.close()
            if untouched and made:
                with contextlib.suppress(OSError):  # something else arrived meanwhile: left alone
                    self.run_dir.rmdir()
            raise

    def _open_run(self, group: WorkerGroup | None) -> None:
        """With the run directory locked: plan the start (fresh, resumed or overwritten), open the
        metrics log, start the workers (or build on ``group``), restore, write config.yaml."""
        state = scan(self.run_dir)
        resume_from = plan_start(state, self.config.train.resume, self.config.train.overwrite,
                                 same_run(self.run_dir, self._config_yaml()))
        if resume_from is None and state.has_results:
            archived = archive_results(self.run_dir)
            why = "train.overwrite=true" if self.config.train.overwrite else \
                "the same run stopped before its first checkpoint"
            log.warning("%s: moved the earlier results in %s to %s; starting afresh", why, self.run_dir, archived)
        clean_staging(self.run_dir)
        self.log = MetricsLog(self.run_dir / "metrics.jsonl", make_sinks(self.config, self.run_dir))
        if resume_from is not None:
            self.log.load()
        else:
            self.log.start_fresh()
        if resume_from is not None:  # an overwritten run's corrupt checkpoints went to the archive with it
            self._report_corrupt(state.corrupt)
        self._start_group(group)
        if resume_from is not None:
            self.restore(resume_from)
            self.log.event("resumed", checkpoint=str(resume_from), step=self.step_count)
        try:
            (self.run_dir / "config.yaml").write_text(self._config_yaml())
        except OSError as exc:
            raise WriteError(self.run_dir / "config.yaml", exc) from None

    def _config_yaml(self) -> str:
        """The run's config.yaml: the config as given, its model.arch the family trained (an HF
        architecture reached through model.init_from or model.hf_config alone says ``byte``)."""
        saved = self.config.to_dict()
        saved["model"]["arch"] = self.arch.spec.family if self.arch.hf_config is not None else "byte"
        return yaml.safe_dump(saved, sort_keys=False)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Every record of this run so far (one dict per step or event), as in metrics.jsonl."""
        return self.log.records

    @property
    def world_size(self) -> int:
        """The ranks training now (the group's; it can shrink after a failure)."""
        return self._live_group().world_size

    def _live_group(self) -> WorkerGroup:
        """The group this Trainer trains on; :class:`TrainerClosed` after :meth:`close` (or once
        a failure left it without one)."""
        if self.group is None:
            why = "this Trainer is closed" if self._closed else "this Trainer lost its worker group (a recovery failed)"
            raise TrainerClosed(f"{why}; make a new Trainer for the run (train.resume=auto continues it "
                                "from its newest checkpoint)")
        return self.group

    # ------------------------------------------------------------------ group life cycle
    def _start_group(self, group: WorkerGroup | None = None, world_size: int | None = None) -> None:
        """Train on ``group``, or on a new one of ``world_size`` ranks (default
        ``parallel.world_size``). The group owns the world size; the config stays as given."""
        if group is None:
            connect(self.address, timeout_s=self.config.parallel.startup_timeout_s)
            group = WorkerGroup(self.config, world_size=world_size, arch=self.arch)
            self._owns_group = True
        else:
            error = self.config.world_size_error(group.world_size, "the group's world_size",
                                                 self.arch.spec.num_experts)
            if error:
                raise ConfigError(error)
        self.group = group
        if hasattr(group, "use_mesh"):  # the mesh this config asks for on the group's ranks
            group.use_mesh(self.config, self.arch)
        try:
            reports = group.call(EPWorker.build_engine, self.config.to_dict(), self.arch,
                                 timeout=self.config.parallel.startup_timeout_s + 120)
        except WorkerFailure as exc:
            # Only the group goes: the run (its lock, metrics sinks) is closed by whoever gives up
            # on it, and a recovery that started this group may still go on with another.
            if self._owns_group:
                group.close()
            self.group = None
            if exc.cause == "error":
                raise TrainingError(f"workers could not build the model and data: {exc}") from None
            raise
        self.model_report = reports[0]
        self.rebalancer = (
            Rebalancer(self.config.balance, self.model_report, node_of_rank(group.ranks), getattr(group, "mesh", None))
            if self.config.balance.enabled else None
        )

    def _recover(self, failure: WorkerFailure) -> None:
        """Tear the group down, start a new one, restore this run's newest valid checkpoint, go on.
        An error a worker raised that no restart fixes (:func:`retryable`) is not a failure: it
        ends the call in one line and the run stays where it was (nothing counted or rewound)."""
        if user_error(failure):
            raise CallRejected(str(failure)) from None
        if not retryable(failure):
            raise TrainingError(f"{failure} (not retried: a new worker group would meet it again)") from None
        self.failures += 1
        self.log.event("failure", rank=failure.rank, cause=failure.cause, message=str(failure),
                       step=self.step_count, failures=self.failures, **failure.where)
        log.warning("worker failure (%s) at step %d: %s", failure.cause, self.step_count, failure)
        if self.failures > self.config.train.max_failures:
            raise TrainingError(
                f"{failure} (failure {self.failures}, train.max_failures={self.config.train.max_failures})"
            ) from failure
        if self.group is not None:  # broken: torn down even when it was handed in
            self.group.close()
            self.group = None
        t0 = time.perf_counter()
        try:
            self._start_group_on_available()
        except WorkerFailure as again:  # a worker of the new group died or hung while building
            self._recover(again)
            return
        # run_dir holds only this run's checkpoints (a fresh run never starts over another's)
        valid, corrupt = scan_checkpoints(self.run_dir)
        self._report_corrupt(corrupt)
        if valid:
            self.restore(valid[0])
        elif corrupt:
            raise TrainingError("no valid checkpoint to recover from: " + "; ".join(why for _, why in corrupt)
                                ) from failure
        else:  # the run had not checkpointed yet: it starts over, its records with it
            self.step_count = 0
            self.log.rewind(0)
        self.log.event("recovered", step=self.step_count, checkpoint=str(valid[0]) if valid else None,
                       world_size=self.world_size, seconds=time.perf_counter() - t0)

    def _report_corrupt(self, corrupt: list[tuple[Path, str]]) -> None:
        """One warning line and one metrics event per corrupt checkpoint: never used, never deleted,
        moved aside to ``checkpoints/corrupt-step_N`` so that no later save replaces it. The
        event's ``step`` is the corrupt checkpoint's step."""
        for path, why in corrupt:
            aside = set_aside(path)
            if any(r.get("event") == "corrupt_checkpoint" and r.get("path") == str(aside) for r in self.log.records):
                continue
            log.warning("skipping corrupt checkpoint (kept as %s): %s", aside.name, why)
            self.log.event("corrupt_checkpoint", path=str(aside), check=why, step=checkpoint_step(path))

    def _start_group_on_available(self) -> None:
        """Same world size when the cluster still fits it, else the largest one that fits
        (checkpoints reshard, so training continues with the same global batch)."""
        wanted = self.config.parallel.world_size
        E = self.arch.spec.num_experts
        sizes = [w for w in range(wanted, 0, -1) if self.config.world_size_error(w, num_experts=E) is None]
        last: Exception | None = None
        for w in sizes:
            try:
                self._start_group(world_size=w)
                if w != wanted:
                    self.log.event("resized", world_size=w, wanted=wanted)
                return
            except WorkerFailure:  # started, then a worker failed: another failure, not "does not fit"
                raise
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
        W = self._live_group().world_size
        if inject_nan_rank is not None and not (_is_int(inject_nan_rank) and 0 <= inject_nan_rank < W):
            raise CallRejected(f"step: inject_nan_rank={inject_nan_rank!r} must be None or a rank in [0, {W})")
        return self._with_recovery(lambda: self._step_once(inject_nan_rank))

    def _step_once(self, poison_rank: int | None = None) -> dict[str, Any]:
        self._live_group()
        t = self.config.train
        now = time.monotonic()
        if now - self._last_health > t.health_check_interval_s:
            self.group.health_check(timeout=min(30.0, t.step_timeout_s))
            self._last_health = now
        t0 = time.perf_counter()
        args = [((r == poison_rank),) for r in range(self.group.world_size)]
        results = self.group.call_each(EPWorker.step, args, timeout=t.step_timeout_s)
        m = aggregate_step(results, time.perf_counter() - t0, self._mesh().ep)
        self.last_load = m["expert_tokens"]
        self.step_count = m["step"]
        if self.rebalancer is not None:
            self.rebalancer.observe([r["load"]["expert_tokens"] for r in results])
            if self.rebalancer.due(self.step_count):
                self.rebalance()
        if m["nonfinite"]:
            self.log.event("nonfinite", step=m["step"], action="skipped" if t.nonfinite == "skip" else "stop")
            if t.nonfinite == "stop":
                self.log.record(m)
                raise TrainingError(f"non-finite loss or gradients at step {m['step']} (train.nonfinite=stop)")
        self.log.record(m)
        if t.checkpoint_interval and self.step_count % t.checkpoint_interval == 0:
            self.save()
        if t.eval_interval and self.step_count % t.eval_interval == 0 and self.has_validation:
            self.evaluate()
        return m

    def train(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Run until ``steps`` more steps are done (default: up to train.steps), then evaluate,
        checkpoint and plot. Returns the metrics of the steps run.

        SIGTERM, SIGINT or SIGHUP (preemption, Ctrl-C, a closed SSH session) lets the step in flight
        finish (an evaluation in flight stops between two of its calls, within about a second,
        and is recorded as ``eval_interrupted``, never as an ``eval``), checkpoints, and raises
        :class:`TrainingInterrupted`; a second signal stops at once.
        """
        t = self.config.train
        target = self.step_count + steps if steps is not None else t.steps
        done: list[dict[str, Any]] = []
        bar = Progress(t.progress if self.progress else "off", self.step_count, target,
                       t.log_interval, t.log_every_s)
        self._progress = bar
        try:
            with _StopOnSignal(self):  # over the final evaluation (stopped between its calls) and save too
                while self.step_count < target:
                    m = self.step()
                    done.append(m)
                    bar.update(m)
                    if self._stop_signal is not None:
                        self._stop_now()
                if self.has_validation and not (done and t.eval_interval and self.step_count % t.eval_interval == 0):
                    bar.message(f"final evaluation: {t.eval_batches} batches (train.eval_batches)")
                    self.evaluate()  # unless the last step just did (step() evaluates every eval_interval)
                if self.last_checkpoint is None or self.last_checkpoint.name != step_name(self.step_count):
                    self.save()
                if self._stop_signal is not None:
                    self._stop_now()
            if t.plots:
                self.plot()
        finally:
            bar.close()
            self._progress = None
        return done

    def _stop_now(self) -> NoReturn:
        """A stop signal arrived: checkpoint the step just finished, record it, raise."""
        signum = self._stop_signal
        assert signum is not None
        try:
            saved = self.last_checkpoint is not None and self.last_checkpoint.name == step_name(self.step_count)
            path = self.last_checkpoint if saved else self.save()
        except Exception as exc:  # noqa: BLE001 - report it; the interruption is what matters
            log.warning("checkpoint on %s failed: %s", signal.Signals(signum).name, exc)
            path = None
        self.log.event("preempted", signal=signal.Signals(signum).name, step=self.step_count,
                       checkpoint=str(path) if path else None)
        raise TrainingInterrupted(signum, self.step_count, path)

    def rebalance(self) -> dict[str, Any]:
        """Plan clone placements from the loads seen so far and apply the changed layers."""
        self._live_group()
        if self.rebalancer is None:
            raise CallRejected("rebalance needs balance.enabled=true (and balance.clone_slots >= 1)")
        t0 = time.perf_counter()
        changes, report = self.rebalancer.plan()
        moved = 0
        if any(c is not None for c in changes):
            moved = sum(self.group.call(EPWorker.set_placements, changes,
                                        timeout=self.config.train.step_timeout_s))
        report.update(step=self.step_count, bytes_moved=moved, seconds=time.perf_counter() - t0)
        self.log.event("rebalance", **report)
        return report

    def evaluate(self, batches: int | None = None) -> float:
        """Mean validation loss over ``batches`` (default ``train.eval_batches``) fixed batches.
        A run without a validation split (``data.val_fraction=0``) has none to measure: CallRejected.

        The workers are asked for a few batches per call (the result is bit-identical to one
        call); a long evaluation prints ``eval 120/5000 batches`` every ``train.log_every_s``
        seconds in :meth:`train`, where a stop signal ends it between two calls: it is recorded
        as an ``eval_interrupted`` event (no ``val_loss``), the run checkpoints and
        :class:`TrainingInterrupted` is raised."""
        self._live_group()
        if batches is not None and not (_is_int(batches) and batches >= 1):
            raise CallRejected(f"evaluate: batches={batches!r} must be None (train.eval_batches) or an integer >= 1")
        if not self.has_validation:
            raise CallRejected("evaluate: this run has no validation split (data.val_fraction=0, or a dataset "
                               "prepared with --val-fraction 0); give it one to measure validation loss")
        t = self.config.train
        n = batches or t.eval_batches
        say = self._progress.message if self._progress is not None else (lambda text: None)
        try:
            val = self._with_recovery(lambda: evaluate_in_chunks(
                self.group, n, timeout=t.step_timeout_s, stop_requested=lambda: self._stop_signal is not None,
                progress=ProgressLines(say, t.log_every_s)))
        except EvaluationStopped as stopped:
            name = signal.Signals(self._stop_signal).name
            say(f"{name}: evaluation stopped after {stopped.done} of {n} batches (not recorded as an eval)")
            self.log.event("eval_interrupted", step=self.step_count, batches_done=stopped.done, batches=n,
                           signal=name)
            self._stop_now()
        self.log.event("eval", step=self.step_count, val_loss=val)
        if self._progress is not None:
            self._progress.message(f"eval at step {self.step_count}: val_loss {val:.4f}")
        return val

    @property
    def has_validation(self) -> bool:
        """False for a run without a validation split (a byte corpus with ``data.val_fraction=0``,
        or a prepared dataset made with ``--val-fraction 0``): it never evaluates (train() skips
        its evaluations; evaluate() says why)."""
        if self._has_val is None:
            self._has_val = has_validation_split(self.config)
        return self._has_val

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 200, temperature: float = 0.8,
                 seed: int | None = None) -> str | list[int]:
        """Continue ``prompt`` with the model as trained so far: ``prompt`` and the result are text
        (bytes for the byte-level model, ``data.tokenizer``'s tokens when the run has one) or
        token ids. Returns the prompt followed by ``max_new_tokens`` sampled tokens (greedy at
        ``temperature`` <= 0; ``seed``: the sampling seed, default ``train.seed``). The context is
        the last ``model.seq_len`` tokens. Arguments are checked here, before any worker sees
        them (:class:`CallRejected`, a ValueError, naming what is allowed)."""
        self._live_group()
        codec = _TextCodec(self.config)
        ids = generate_ids(prompt, codec, self.arch.spec.vocab_size)
        check_sampling(max_new_tokens, temperature, seed)
        seed = self.config.train.seed if seed is None else seed
        new = self._with_recovery(lambda: self.group.call(
            EPWorker.generate, ids, max_new_tokens, float(temperature), seed,
            timeout=self.config.train.step_timeout_s)[0])
        return codec.decode(ids + new) if isinstance(prompt, str) else ids + new

    def expert_load(self) -> list[list[float]] | None:
        """Tokens per logical expert per MoE layer in the last step (summed over ranks)."""
        return self.last_load

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint the current step under run_dir/checkpoints (atomic)."""
        self._live_group()
        timeout = self.config.train.step_timeout_s
        try:
            staging = new_staging_dir(self.run_dir, self.step_count)
        except OSError as exc:
            raise WriteError(exc.filename or self.run_dir, exc) from None
        try:
            return self._save_into(staging, timeout)
        except OSError as exc:  # the driver's part (meta.json, the rename): one line naming the file
            shutil.rmtree(staging, ignore_errors=True)
            raise WriteError(exc.filename or staging, exc) from None
        except BaseException:  # the previous checkpoint stays the newest; no .tmp-step_* is left behind
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _save_into(self, staging: Path, timeout: float) -> Path:
        self._live_group()
        files = self.group.call(EPWorker.save_shard, str(staging), timeout=timeout)
        meta = {
            "step": self.step_count,
            "opt_steps": self.group.call(EPWorker.counters, timeout=timeout)[0]["opt_steps"],
            "world_size": self.group.world_size,
            "mesh": self._mesh().to_dict(),
            "config": self.config.to_dict(),
            "placements": self.group.call(EPWorker.placements, timeout=timeout)[0],
            "balance": self.rebalancer.state_dict() if self.rebalancer is not None else None,
            # the HF config in effect (for `ray-moe export`, whatever becomes of model.hf_config's file)
            "hf_config": self.arch.hf_config,
            "time": time.time(),
        }
        path = commit(staging, meta, files)
        self.last_checkpoint = path
        self.log.event("checkpoint", step=self.step_count, path=str(path))
        return path

    def restore(self, path: str | Path | None = None) -> int:
        """Load a checkpoint (default: run_dir's latest) into the current group; returns its step.

        At the world size it was saved with, the placements (clones) and the re-cloning state come
        back too, so the run continues exactly as it would have; at another world size every layer
        starts from its native placement and the load statistics start afresh.
        """
        self._live_group()
        if path is None:
            valid, corrupt = scan_checkpoints(self.run_dir)
            self._report_corrupt(corrupt)
            if not valid:
                raise CheckpointError(f"no complete checkpoint under {str(self.run_dir)!r}")
            path = valid[0]
        path = Path(path).expanduser().resolve()
        meta = read_meta(path)
        check_compatible(meta, self.config, path, self.arch)
        timeout = self.config.train.step_timeout_s
        steps = self.group.call(EPWorker.load_checkpoint, str(path), timeout=timeout)
        self.step_count = steps[0]
        self.last_checkpoint = path
        self.log.rewind(self.step_count)  # later steps will be run (and recorded) again
        saved_mesh = meta.get("mesh") or MeshSpec.whole(meta["world_size"]).to_dict()
        same_layout = (meta["world_size"] == self.group.world_size and saved_mesh == self._mesh().to_dict()
                       and meta["config"]["balance"]["clone_slots"] == self.config.balance.clone_slots)
        if same_layout and meta.get("placements"):
            self.group.call(EPWorker.set_placements, meta["placements"], timeout=timeout)
        if self.rebalancer is not None:
            if same_layout and meta.get("balance"):
                self.rebalancer.load_state_dict(meta["balance"])
            else:
                self.rebalancer.reset()
                if same_layout and meta.get("placements"):  # the clones stay; plan on top of them
                    self.rebalancer.placements = [Placement.from_dict(p) for p in meta["placements"]]
        return self.step_count

    def _mesh(self) -> MeshSpec:
        """The group's rank mesh (a group without one: expert parallelism over the whole world)."""
        assert self.group is not None
        return getattr(self.group, "mesh", None) or MeshSpec.whole(self.group.world_size)

    # ------------------------------------------------------------------ records
    def plot(self) -> list[Path]:
        unit = "nats/token" if self.config.data.datasets else "nats/byte"  # token datasets, else bytes
        blocks = list(self.model_report.moe_layers) if self.model_report is not None else None
        return self.log.plot(self.run_dir, unit, blocks)

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.step_count,
            **self.log.summary(),
            "failures": self.failures,
            "world_size": self.group.world_size if self.group else None,
            "transport": self.group.transport_name if self.group else None,
            "run_dir": str(self.run_dir),
        }

    def close(self) -> None:
        """Stop the workers if this Trainer started them (a group passed in stays up); close the
        metrics sinks. Idempotent."""
        self._closed = True
        if self.group is not None and self._owns_group:
            self.group.close()
        self.group = None
        if getattr(self, "log", None) is not None:
            self.log.close()
            self.log.sinks = []
        self._release_run_dir()

    def _release_run_dir(self) -> None:
        lock, self._run_lock = getattr(self, "_run_lock", None), None
        if lock is not None:
            lock.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def has_validation_split(config: Config) -> bool:
    """Whether every batch source of ``config`` has validation data: the byte corpus when
    ``data.val_fraction > 0``; each prepared dataset when it holds val tokens (its index only is read)."""
    from ray_moe.worker.data import has_val_split

    return has_val_split(config.data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def generate_ids(prompt: Any, codec: "_TextCodec", vocab_size: int) -> list[int]:
    """``prompt`` (text, or a sequence of token ids) as token ids in [0, vocab_size); CallRejected
    for an empty prompt, an id that is not an integer or out of range, or another type."""
    if isinstance(prompt, str):
        ids = codec.encode(prompt)
    elif isinstance(prompt, (list, tuple)) or (hasattr(prompt, "__iter__") and not isinstance(prompt, (bytes, dict))):
        ids = []
        for i in prompt:
            try:
                if isinstance(i, bool):
                    raise TypeError
                ids.append(operator.index(i))  # ints, NumPy's and 0-d integer tensors; not floats
            except TypeError:
                raise CallRejected(f"generate: prompt token id {i!r} is not an integer; give text or "
                                   "integer ids") from None
    else:
        raise CallRejected(f"generate: prompt {prompt!r} must be text or a sequence of token ids")
    if not ids:
        raise CallRejected("generate: the prompt is empty; give at least one character or token id")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise CallRejected(f"generate: prompt token ids must be in [0, {vocab_size}) (the model's vocabulary), "
                           f"got min {lo}, max {hi}")
    return ids


def check_sampling(max_new_tokens: Any, temperature: Any, seed: Any) -> None:
    """CallRejected unless ``max_new_tokens`` is an integer >= 0, ``temperature`` a finite number
    >= 0 (0: greedy) and ``seed`` None or an integer."""
    if not (_is_int(max_new_tokens) and max_new_tokens >= 0):
        raise CallRejected(f"generate: max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise CallRejected(f"generate: temperature={temperature!r} must be a finite number >= 0 (0: greedy)")
    if seed is not None and not _is_int(seed):
        raise CallRejected(f"generate: seed={seed!r} must be None (train.seed) or an integer")


class _StopOnSignal:
    """While training: the first SIGTERM, SIGINT or SIGHUP asks the Trainer to stop after the step in
    flight (it checkpoints); a second signal raises KeyboardInterrupt at once. Handlers are
    installed only in the main thread and restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the SSH session that ran it closed

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.previous = trainer, {}

    def __enter__(self) -> "_StopOnSignal":
        self.trainer._stop_signal = None  # a stop that ended an earlier train() call is spent
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # nohup: the user asked the run to outlive the terminal
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.trainer._stop_signal is not None:  # asked twice: stop now (a long evaluation included)
            raise KeyboardInterrupt
        self.trainer._stop_signal = signum
        log.warning("%s: stopping after the step in flight (an evaluation: after its call in flight) and "
                    "checkpointing; a second signal (Ctrl-C again) stops at once", signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.trainer._stop_signal = None  # evaluate() outside train() is never stopped by it


class _TextCodec:
    """Text ↔ token ids of a run: ``data.tokenizer``'s tokenizer.json when the config has one, else
    UTF-8 bytes (ids >= 256, which a byte-level run never trains on, decode as U+FFFD)."""

    def __init__(self, config: Config):
        directory = getattr(config.data, "tokenizer", "") or ""
        self.tokenizer = None
        if directory:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(Path(directory).expanduser() / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(text).ids)
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(list(ids))
        return b"".join(bytes([i]) if i < 256 else "\ufffd".encode() for i in ids).decode("utf-8", "replace")


__all__ = ["Trainer", "TrainingError", "TrainingInterrupted", "GroupError", "WorkerFailure"]
