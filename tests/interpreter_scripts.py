"""Triton-interpreter scripts run in the background of a test session (see InterpreterScripts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable

from tests.interpreter_runner import MARK


class InterpreterScripts:
    """Scripts that run Triton kernels under Triton's interpreter on the CPU.

    ``TRITON_INTERPRET=1`` must be set before triton is imported, so the scripts run in a
    process of their own: one runner (tests/interpreter_runner.py) that runs them one after
    another and pays the imports once. They are queued as soon as the session's tests are collected (tests
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
        self._runner: subprocess.Popen | None = None  # tests/interpreter_runner.py, kept between scripts

    def start(self, scripts: Iterable[tuple[str, ...]]) -> None:
        """Queue ``scripts`` (argv tuples; repeats and known ones ignored) and start running them."""
        with self._cv:
            for argv in scripts:
                if argv not in self._queue and argv not in self._results:
                    self._queue.append(argv)
            if self._queue and self._thread is None:
                self._thread = threading.Thread(target=self._run_queue, name="interpreter-scripts", daemon=True)
                self._thread.start()

    def result(self, *argv: str) -> subprocess.CompletedProcess:
        """The finished process of ``argv`` (queued now if it was not), stdout and stderr as text."""
        self.start([argv])
        with self._cv:
            # past timeout_s the runner is killed and the result says so: wait a little longer
            if not self._cv.wait_for(lambda: argv in self._results, timeout=self.timeout_s + 10):
                raise TimeoutError(f"interpreter script {argv[:2]} did not finish within {self.timeout_s:.0f} s")
            done = self._results[argv]
        if isinstance(done, str):
            raise RuntimeError(f"interpreter script {argv[:2]} could not run: {done}")
        return done

    def assert_prints(self, script: str, marker: str) -> None:
        """The Python ``script`` (run with this interpreter, ``python -c``) ended printing
        ``marker``; its stderr's tail otherwise. Skips without Triton."""
        import sys

        import pytest

        pytest.importorskip("triton")
        r = self.result(sys.executable, "-c", script)
        assert marker in r.stdout, r.stderr[-3000:]

    def json_or_skip(self, *argv: str) -> dict:
        """The JSON object on the last stdout line of ``argv`` (a script of checks that prints its
        results); skips the asking test without Triton. A script that ends with an error fails
        the test (its stderr's tail says why): a kernel crashing under the interpreter is a
        failure, not a skip."""
        import pytest

        pytest.importorskip("triton")
        proc = self.result(*argv)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
            pytest.fail(f"interpreter script {argv[1:2]} exited with {proc.returncode}: " + " | ".join(tail))
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        """End the runner process (at the end of the test session)."""
        with self._cv:
            runner, self._runner = self._runner, None
        if runner is not None and runner.poll() is None:
            runner.stdin.close()
            try:
                runner.wait(timeout=30)
            except subprocess.TimeoutExpired:
                runner.kill()
                runner.wait()

    def _run_queue(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    self._thread = None  # under the lock: a script queued from now on starts a new thread
                    return
                argv = self._queue.pop(0)
                runner = self._runner
                try:
                    if runner is None or runner.poll() is not None:
                        runner = self._runner = self._start_runner()
                except OSError as exc:
                    self._results[argv] = f"the interpreter runner could not start: {exc}"
                    self._cv.notify_all()
                    continue
            done = self._ask(runner, argv)
            with self._cv:
                if isinstance(done, str):  # crashed, timed out or unreadable: the next script gets a new one
                    runner.kill()
                    runner.wait()
                    if self._runner is runner:
                        self._runner = None
                self._results[argv] = done
                self._cv.notify_all()

    @staticmethod
    def _start_runner() -> subprocess.Popen:
        env = dict(os.environ, TRITON_INTERPRET="1")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # stderr to a file: the runner's C-level warnings must never fill a pipe nobody reads
        return subprocess.Popen([sys.executable, "-m", "tests.interpreter_runner"], env=env, text=True, cwd=root,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=tempfile.TemporaryFile("w+"))

    def _ask(self, runner: subprocess.Popen, argv: tuple[str, ...]) -> subprocess.CompletedProcess | str:
        """``argv``'s result from ``runner``, or why there is none (the runner is then unusable)."""
        timer = threading.Timer(self.timeout_s, runner.kill)
        timer.start()
        try:
            runner.stdin.write(json.dumps(list(argv)) + "\n")
            runner.stdin.flush()
            for line in runner.stdout:  # lines without the mark: output that bypassed sys.stdout
                if line.startswith(MARK):
                    answer = json.loads(line[len(MARK):])
                    return subprocess.CompletedProcess(list(argv), answer["returncode"], answer["stdout"],
                                                       answer["stderr"])
        except (OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            timer.cancel()
        runner.wait()
        why = f"killed after {self.timeout_s:.0f} s" if runner.returncode == -9 else f"exit code {runner.returncode}"
        return f"the interpreter runner ended ({why}) during this script"
