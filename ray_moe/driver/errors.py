"""The driver's errors, in a module without Ray: the CLI names them for its one-line exits, and
its commands that need no cluster (the single-GPU benchmarks) must not import Ray to do so."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any


class GroupError(RuntimeError):
    """The worker group could not be started or a worker failed; the message names the cause."""


class WorkerFailure(GroupError):
    """A worker died or did not answer in time.

    Attributes: rank (or None if unknown), cause ('died' | 'timeout' | 'error') and ``where``
    (node id, host, pid of that rank; empty when unknown).
    """

    def __init__(self, message: str, rank: int | None, cause: str, where: dict[str, Any] | None = None):
        super().__init__(message)
        self.rank, self.cause, self.where = rank, cause, dict(where or {})


class TrainingError(RuntimeError):
    """Training cannot go on (bad data, too many failures, non-finite loss with nonfinite=stop)."""


class TrainingInterrupted(TrainingError):
    """SIGTERM, SIGINT or SIGHUP stopped training after a checkpoint. Attributes: signum, step, checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint could be written"
        super().__init__(f"stopped by {name} at step {step} ({where}); continue with train.resume=auto")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class CallRejected(TrainingError, ValueError):
    """A call's arguments or data were refused (on the driver, or by the workers for the same
    reason): the call ended, the run is where it was (no failure counted, nothing rewound)."""


class TrainerClosed(TrainingError):
    """A :class:`~ray_moe.driver.trainer.Trainer` method was called after ``close()``."""


class WriteError(TrainingError):
    """A file of the run could not be written (a full disk, a read-only file system, no
    permission); the message names the path and the errno. Nothing half-written is left."""

    def __init__(self, path: Path | str, exc: OSError) -> None:
        import errno as errno_names

        code = errno_names.errorcode.get(exc.errno or 0, str(exc.errno))
        super().__init__(f"cannot write {path}: {exc.strerror or exc} ({code}); free space or fix the "
                         "permissions, then rerun the same command (it continues from the newest checkpoint)")
        self.path, self.errno = Path(path), exc.errno
