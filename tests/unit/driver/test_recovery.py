"""Recovery rules: on by default; dead and hung workers are retried, errors no restart fixes are not;
with a stand-in worker group, a worker that fails while a recovery's new group builds is one more
failure, and the run keeps its directory lock and metrics log throughout."""

from __future__ import annotations

import errno

import pytest
import torch

import ray_moe.driver.trainer as trainer_mod
from ray_moe.config import Config
from ray_moe.driver.group import WorkerFailure
from ray_moe.driver.run_dir import RunDirError, lock_run_dir
from ray_moe.driver.trainer import retryable
from tests.support import small_config


class DataError(ValueError):  # the worker's error class, as it arrives (matched by name)
    pass


class _TaskError(RuntimeError):
    """Stands for Ray's RayTaskError: the worker's exception is its ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _failure(cause: str, original: BaseException | None = None) -> WorkerFailure:
    failure = WorkerFailure("save_shard: rank 0 raised ...", 0, cause)
    if original is not None:
        failure.__cause__ = _TaskError(original)
    return failure


def test_recovery_is_on_by_default():
    assert Config().train.max_failures == 3


@pytest.mark.parametrize("original", [
    OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EROFS, "Read-only file system"),
    DataError("data.paths: x.bin: binary content"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
])
def test_errors_no_restart_fixes_are_not_retried(original):
    assert not retryable(_failure("error", original))


@pytest.mark.parametrize("failure", [
    _failure("died"), _failure("timeout"), _failure("error", RuntimeError("gloo: connection reset")),
    _failure("error", OSError(errno.ECONNRESET, "reset")), _failure("error"),
])
def test_dead_hung_and_other_failures_are_retried(failure):
    assert retryable(failure)


class _Group:
    """A worker group whose build_engine answers from a script: 'died', 'error' or 'ok'."""

    def __init__(self, script: list[str], world_size: int) -> None:
        self.script, self.world_size, self.ranks, self.closed = script, world_size, [], False

    def call(self, *_args, **_kwargs):
        what = self.script.pop(0)
        if what != "ok":
            raise WorkerFailure(f"rank 1 {what} while building", rank=1, cause=what)
        return [object()] * self.world_size

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def started(tmp_path, monkeypatch):
    """starts(script) -> a Trainer whose groups answer build_engine from ``script`` in turn."""
    made: list[_Group] = []

    def starts(script: list[str]) -> trainer_mod.Trainer:
        def group(config, world_size=None, arch=None):
            made.append(_Group(script, world_size or config.parallel.world_size))
            return made[-1]

        monkeypatch.setattr(trainer_mod, "WorkerGroup", group)
        monkeypatch.setattr(trainer_mod, "connect", lambda *a, **k: None)
        return trainer_mod.Trainer(small_config(tmp_path, **{"train.max_failures": 3}), progress=False)

    starts.made = made
    return starts


def test_a_worker_failing_while_a_recovery_builds_is_another_failure_and_the_run_stays_locked(started):
    t = started(["ok", "died", "ok"])
    try:
        t._recover(WorkerFailure("rank 0 died", rank=0, cause="died"))
        assert t.failures == 2 and t.group is started.made[-1] and t.world_size == 2  # the same size again
        assert [g.closed for g in started.made] == [True, True, False]
        assert [r["event"] for r in t.metrics if r.get("event") in ("failure", "recovered")] == \
            ["failure", "failure", "recovered"]
        with pytest.raises(RunDirError, match="in use by another run"):
            lock_run_dir(t.run_dir)
        assert t.log.sinks  # still writing
    finally:
        t.close()
    lock_run_dir(t.run_dir).close()  # released at close


def test_an_error_raised_while_a_recovery_builds_ends_the_run_in_one_line(started):
    t = started(["ok", "error"])
    try:
        with pytest.raises(trainer_mod.TrainingError, match="workers could not build the model and data"):
            t._recover(WorkerFailure("rank 0 died", rank=0, cause="died"))
        with pytest.raises(RunDirError):  # the run is still the Trainer's until it is closed
            lock_run_dir(t.run_dir)
    finally:
        t.close()
