"""Recovery rules: on by default; dead and hung workers are retried, errors no restart fixes are not."""

from __future__ import annotations

import errno

import pytest

from ray_moe.config import Config
from ray_moe.driver.group import WorkerFailure
from ray_moe.driver.trainer import retryable


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
])
def test_errors_no_restart_fixes_are_not_retried(original):
    assert not retryable(_failure("error", original))


@pytest.mark.parametrize("failure", [
    _failure("died"), _failure("timeout"), _failure("error", RuntimeError("gloo: connection reset")),
    _failure("error", OSError(errno.ECONNRESET, "reset")), _failure("error"),
])
def test_dead_hung_and_other_failures_are_retried(failure):
    assert retryable(failure)
