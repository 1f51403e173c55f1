"""The run directory: where a run's results live, and the rule that no run destroys another's.

A run directory holds ``metrics.jsonl``, ``config.yaml``, plots, ``checkpoints/`` and the loggers'
files. When a Trainer starts, :func:`plan_start` decides from ``train.resume`` and what the
directory holds:

- ``resume: auto`` (the default) continues from the newest valid checkpoint; a directory that holds
  an earlier run's results but no valid checkpoint is refused (it would be overwritten), unless its
  config.yaml is this run's and no checkpoint of it is corrupt: the same run stopped before its
  first checkpoint (a full disk, a lost terminal) starts over, its results moved to ``archive/``;
- ``resume: true`` must continue: no valid checkpoint is an error naming the files found;
- ``resume: false`` starts fresh: an empty or new directory only, unless ``train.overwrite: true``,
  which moves the earlier results into ``archive/<time>/`` first (nothing is deleted).

Every refusal is one :class:`RunDirError` line naming the directory and how to go on. A corrupt
checkpoint is never used and never deleted; it is named in a warning, moved aside to
``checkpoints/corrupt-step_*`` (no later save can replace it) and the previous valid one is used.

A run directory has one writer: a Trainer holds an exclusive lock on ``RUN_LOCK`` for its life
(:func:`lock_run_dir`, the same lock ``ray-moe prepare`` holds on a dataset directory); a second
run into the same directory is refused naming the first's pid and host, changing nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import IO

from ray_moe import dirlock
from ray_moe.checkpoint import checkpoints_dir, scan_checkpoints
from ray_moe.config import ConfigError, TrainConfig

METRICS = "metrics.jsonl"
ARCHIVE = "archive"
RUN_LOCK = ".run.lock"  # held by the one Trainer writing the directory (dirlock)
CORRUPT_PREFIX = "corrupt-"  # checkpoints/corrupt-step_N: a corrupt checkpoint, kept aside
# What a run writes into its directory (moved aside together by train.overwrite).
RESULTS = (METRICS, "config.yaml", "checkpoints", "loss.png", "imbalance.png", "expert_load.png",
           "tensorboard", "wandb")


class RunDirError(ConfigError):
    """The run directory cannot be used as asked; the message says why and how to go on."""


def in_ray_job_working_dir() -> bool:
    """True when this driver runs as a Ray job with a ``working_dir``: its current directory is a
    temporary copy that Ray deletes, so relative outputs there would be lost."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return False
    try:
        return bool(json.loads(raw).get("runtime_env", {}).get("working_dir"))
    except (ValueError, AttributeError):
        return False


def resolve_run_dir(train: TrainConfig) -> Path:
    """``train.run_dir`` as an absolute path (under ``train.storage_path`` when relative), created
    and checked writable. Raises :class:`RunDirError` naming the path and the reason."""
    path = run_dir_path(train)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(f"train.run_dir={path} is not a writable directory ({exc.strerror or exc}); "
                          "choose another train.run_dir or fix its permissions") from None
    return path


def run_dir_path(train: TrainConfig) -> Path:
    """``train.run_dir`` as an absolute path (under ``train.storage_path`` when relative); nothing
    is created. Raises :class:`RunDirError` for a relative one in a Ray job's temporary copy."""
    path = Path(train.run_dir).expanduser()
    if not path.is_absolute():
        if train.storage_path:
            path = Path(train.storage_path).expanduser() / path
        elif in_ray_job_working_dir():
            raise RunDirError(
                f"train.run_dir={train.run_dir} is relative and this driver runs as a Ray job in a "
                "temporary copy of the working directory that Ray deletes: give an absolute "
                "train.run_dir or train.storage_path=DIR (shared storage on a multi-node cluster)")
    return path.resolve()


def discard_untouched(path: Path) -> bool:
    """A run that failed before writing anything: remove its own files (an empty metrics.jsonl
    and, while it is still held, the lock file) when the directory holds nothing else. Returns
    whether it did; the caller then releases the lock and may remove the empty directory."""
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    metrics = path / METRICS
    if not names <= {RUN_LOCK, METRICS} or (metrics.exists() and metrics.stat().st_size):
        return False
    for name in (METRICS, RUN_LOCK):  # the lock file last: a second run that opens it now is told to rerun
        (path / name).unlink(missing_ok=True)
    return True


def lock_run_dir(path: Path) -> IO[str]:
    """Take the run directory's writer lock (held until the returned file is closed) and name this
    process in it. Raises :class:`RunDirError` naming the run that holds it."""
    try:
        fh = dirlock.take(path / RUN_LOCK, "training run")
    except dirlock.LockHeld as exc:
        raise RunDirError(f"train.run_dir={path} is in use by another run ({exc.holder}); wait for it to end "
                          "or choose another train.run_dir (nothing was changed)") from None
    except dirlock.LockReplaced:
        raise RunDirError(f"train.run_dir={path}: its lock file was replaced as this run started; rerun "
                          "(nothing was changed)") from None
    except dirlock.LockUnusable as exc:
        raise RunDirError(f"train.run_dir={path}: {exc}; this run must be able to lock it (remove or fix "
                          f"{RUN_LOCK} if no run is using the directory)") from None
    if fh is None:
        raise RunDirError(f"train.run_dir={path} disappeared as this run started; rerun")
    dirlock.announce(fh)
    return fh


def set_aside(corrupt: Path) -> Path:
    """Rename a corrupt checkpoint ``step_N`` to ``corrupt-step_N`` (``corrupt-step_N.K`` when that
    exists): out of the way of saves, never deleted. Returns its new path (itself when it is
    already aside or gone)."""
    if corrupt.name.startswith(CORRUPT_PREFIX) or not corrupt.exists():
        return corrupt
    dest, n = corrupt.with_name(CORRUPT_PREFIX + corrupt.name), 1
    while dest.exists():
        dest = corrupt.with_name(f"{CORRUPT_PREFIX}{corrupt.name}.{n}")
        n += 1
    os.replace(corrupt, dest)
    return dest


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint directory from its name (``[corrupt-]step_N[.K]``); None if not one."""
    digits = path.name.removeprefix(CORRUPT_PREFIX).removeprefix("step_").split(".")[0]
    return int(digits) if digits.isdigit() else None


def corrupt_aside(path: Path) -> list[Path]:
    """The corrupt checkpoints set aside in a run directory (``checkpoints/corrupt-step_*``)."""
    root = checkpoints_dir(path)
    return sorted(root.glob(CORRUPT_PREFIX + "step_*")) if root.is_dir() else []


@dataclass
class RunDirState:
    """What a run directory holds: valid checkpoints (newest first), corrupt ones with the check
    that failed, the step records in metrics.jsonl, and the other results present."""

    path: Path
    valid: list[Path] = field(default_factory=list)
    corrupt: list[tuple[Path, str]] = field(default_factory=list)
    metric_steps: int = 0
    results: list[str] = field(default_factory=list)

    @property
    def has_results(self) -> bool:
        return bool(self.valid or self.corrupt or self.metric_steps or self.results)

    def describe(self) -> str:
        parts = []
        if self.metric_steps:
            parts.append(f"{METRICS} with {self.metric_steps} step records")
        if self.valid or self.corrupt:
            parts.append(f"{len(self.valid)} valid and {len(self.corrupt)} corrupt checkpoint(s)")
        rest = [r for r in self.results if r not in (METRICS, "checkpoints")]
        if rest:
            parts.append(", ".join(rest))
        return "; ".join(parts) or "nothing"


def scan(path: Path) -> RunDirState:
    valid, corrupt = scan_checkpoints(path)
    metrics = path / METRICS
    steps = 0
    if metrics.is_file():
        with open(metrics) as f:
            steps = sum('"loss"' in line for line in f)
    results = [name for name in RESULTS if (path / name).exists()
               and not (name == METRICS and steps == 0) and not (name == "checkpoints" and not (valid or corrupt or corrupt_aside(path)))]
    return RunDirState(path, valid, corrupt, steps, results)


def refuse_past_the_end(train: TrainConfig) -> None:
    """For a command that would train ``train.steps`` steps: refuse (:class:`RunDirError`) a run
    directory whose newest valid checkpoint is already past them. Resuming would train nothing and
    still rewrite the run's config.yaml with the smaller ``train.steps``."""
    path = run_dir_path(train)
    if train.resume == "false" or train.overwrite or not path.is_dir():
        return
    valid, _ = scan_checkpoints(path)
    step = checkpoint_step(valid[0]) if valid else None
    if step is not None and step > train.steps:
        raise RunDirError(f"train.run_dir={path} is already at step {step}, past train.steps={train.steps}: "
                          f"no step would be trained; set train.steps above {step} to continue it, or choose "
                          "another train.run_dir (nothing was changed)")


def same_run(path: Path, config_yaml: str) -> bool:
    """True when ``path``'s config.yaml is ``config_yaml``: the directory holds an earlier start of
    this same run (e.g. one stopped before its first checkpoint: a full disk, a lost terminal)."""
    try:
        return (path / "config.yaml").read_text() == config_yaml
    except (OSError, UnicodeDecodeError):
        return False


def plan_start(state: RunDirState, resume: str, overwrite: bool, same_config: bool = False) -> Path | None:
    """The checkpoint to continue from (None: a fresh run). Raises :class:`RunDirError` when the
    directory cannot be used as asked (see the module docstring). ``same_config``: the directory's
    config.yaml is this run's; with ``resume: auto``, an earlier start of it that saved no
    checkpoint (and no corrupt one) starts over, its results moved to ``archive/`` first."""
    where = f"train.run_dir={state.path}"
    corrupt = "; ".join(f"{p.name}: {why}" for p, why in state.corrupt)
    if resume in ("auto", "true") and state.valid:
        return state.valid[0]
    if resume == "true":
        if state.corrupt:
            raise RunDirError(f"{where}: train.resume=true but no checkpoint is valid ({corrupt}); the "
                              "files are left as they are: repair or remove them, or start a fresh run elsewhere")
        raise RunDirError(f"{where} holds no checkpoint to resume from (it holds {state.describe()}); "
                          "use train.resume=auto or false to start a fresh run")
    if not state.has_results:
        return None
    if overwrite or (resume == "auto" and same_config and not state.corrupt and not corrupt_aside(state.path)):
        return None
    how = (f"continue it with train.resume=auto, choose another train.run_dir, or set "
           f"train.overwrite=true to move it to {ARCHIVE}/ and start afresh")
    if state.corrupt and not state.valid:
        raise RunDirError(f"{where} holds an earlier run whose checkpoints are all corrupt ({corrupt}); "
                          f"nothing was changed: choose another train.run_dir, or set train.overwrite=true "
                          f"to move it to {ARCHIVE}/ and start afresh")
    if resume == "auto":
        raise RunDirError(f"{where} holds an earlier run with no checkpoint to continue from "
                          f"({state.describe()}); choose another train.run_dir or set train.overwrite=true "
                          f"to move it to {ARCHIVE}/ and start afresh")
    raise RunDirError(f"{where} holds an earlier run ({state.describe()}); {how}")


def archive_results(path: Path) -> Path | None:
    """Move an earlier run's results into ``archive/<YYYYmmdd-HHMMSS>/``; returns that directory
    (None when there was nothing to move). Nothing is deleted."""
    present = [name for name in RESULTS if (path / name).exists()]
    if not present:
        return None
    dest = path / ARCHIVE / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while dest.exists():
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
        n += 1
    dest.mkdir(parents=True)
    for name in present:
        shutil.move(str(path / name), str(dest / name))
    return dest
