"""Triton-interpreter scripts run in the background of a test session (see InterpreterScripts)."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterable


class InterpreterScripts:
    """Scripts that run Triton kernels under Triton's interpreter on the CPU.

    ``TRITON_INTERPRET=1`` must be set before triton is imported, so each script runs in a
    process of its own. They are queued as soon as the session's tests are collected (tests
    carrying ``@pytest.mark.interpreter_script(*argv)``) and run one after another on a
    background thread, beside the rest of the suite instead of in front of it (the CI machine has
    two cores and the suite's own process mostly uses one). Under ``pytest -n`` an xdist worker
    does not know at collection which tests it will get, so there each script starts when a test
    first asks for it. A test asks for its script's result and waits for it, bounded by
    ``timeout_s``.
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._queue: list[tuple[str, ...]] = []
        self._results: dict[tuple[str, ...], subprocess.CompletedProcess | str] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self, scripts: Iterable[tuple[str, ...]]) -> None:
        """Queue ``scripts`` (argv tuples; repeats and known ones ignored) and start running them."""
        with self._cv:
            for argv in scripts:
                if argv not in self._queue and argv not in self._results:
                    self._queue.append(argv)
            if self._queue and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run_queue, name="interpreter-scripts", daemon=True)
                self._thread.start()

    def result(self, *argv: str) -> subprocess.CompletedProcess:
        """The finished process of ``argv`` (queued now if it was not), stdout and stderr as text."""
        self.start([argv])
        with self._cv:
            if not self._cv.wait_for(lambda: argv in self._results, timeout=self.timeout_s):
                raise TimeoutError(f"interpreter script {argv[:2]} did not finish within {self.timeout_s:.0f} s")
            done = self._results[argv]
        if isinstance(done, str):
            raise RuntimeError(f"interpreter script {argv[:2]} could not run: {done}")
        return done

    def _run_queue(self) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        while True:
            with self._cv:
                if not self._queue:
                    return
                argv = self._queue.pop(0)
            try:
                done: subprocess.CompletedProcess | str = subprocess.run(
                    list(argv), env=env, capture_output=True, text=True, timeout=self.timeout_s)
            except (OSError, subprocess.TimeoutExpired) as exc:
                done = f"{type(exc).__name__}: {exc}"
            with self._cv:
                self._results[argv] = done
                self._cv.notify_all()
