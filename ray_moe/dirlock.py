"""One writer per directory: an exclusive ``fcntl.flock`` on a lock file inside it, held for the
writer's life (released on close or when the process ends, however it ends).

Shared by ``ray-moe prepare`` (a dataset directory, :mod:`ray_moe.data.writer`) and training (a
run directory, :mod:`ray_moe.driver.run_dir`). The lock file's text names the holder
(``pid N on HOST``), so a second writer is refused with a message naming the first.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

# flock is not supported on this file system (some network file systems): warn, do not refuse.
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class LockHeld(RuntimeError):
    """Another process holds the lock; ``holder`` is its lock file's text (``pid N on HOST``)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


class LockReplaced(RuntimeError):
    """The lock file was removed or replaced while this process opened it (its holder was ending)."""


class LockUnusable(RuntimeError):
    """The lock file cannot be opened or locked (not writable, a directory, ...): the message names
    the file and the operating system's reason."""


def take(path: str | Path, what: str = "writer") -> IO[str] | None:
    """Open ``path`` (created if missing) and lock it exclusively without waiting; returns the open
    file, which holds the lock until closed. None when the directory holding ``path`` does not
    exist. Raises :class:`LockHeld` (naming the holder), :class:`LockReplaced` or
    :class:`LockUnusable`. ``what`` names the writer in the warning given where the file system
    has no locks."""
    path = Path(path)
    try:
        fh = open(path, "a+")  # noqa: SIM115 - held for the writer's life
    except FileNotFoundError:
        if path.parent.exists():
            raise LockUnusable(f"{path} cannot be created") from None
        return None
    except OSError as exc:
        raise LockUnusable(f"{path} cannot be opened for writing: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "a process that did not say which"
        fh.close()
        raise LockHeld(path, holder) from None
    except OSError as exc:
        if exc.errno not in _NO_FLOCK:
            fh.close()
            raise LockUnusable(f"{path} cannot be locked: {exc.strerror or exc}") from None
        log.warning("%s: this file system does not support file locks (%s); nothing stops a second "
                    "%s from writing the directory at the same time", path.parent, exc.strerror, what)
    try:  # a holder that was ending removed the file it held: this lock would then be no one's
        replaced = os.fstat(fh.fileno()).st_ino != os.stat(path).st_ino
    except FileNotFoundError:
        replaced = True
    if replaced:
        fh.close()
        raise LockReplaced(str(path))
    return fh


def announce(fh: IO[str]) -> None:
    """Write this process's name (``pid N on HOST``) into the held lock file."""
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    fh.flush()
