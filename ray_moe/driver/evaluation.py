"""Validation loss measured in chunks of batches, so that an evaluation can be stopped and shown.

The driver asks the workers for a few batches per call (``EPWorker.eval_sum``), sized so that a
call lasts about :data:`EVAL_CALL_S`, and looks at the stop flag between calls: a stop signal
during an evaluation of thousands of batches is seen within about a call's time, and each call
stays far inside ``train.step_timeout_s``. Each rank's float64 running sum travels from call to
call and one ``EPWorker.eval_mean`` averages at the end, so the result has the bits of one
``eval_sum`` call over all batches: same batches, same order, same averaging.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

from ray_moe.worker.actor import EPWorker

EVAL_CALL_S = 0.5  # seconds a call aims at: a stop waits for at most about this (plus one batch)
MAX_BATCHES_PER_CALL = 1024


class EvaluationStopped(Exception):
    """A stop was asked for between two calls; ``done`` of ``batches`` batches were measured."""

    def __init__(self, done: int, batches: int) -> None:
        super().__init__(f"evaluation stopped after {done} of {batches} batches")
        self.done, self.batches = done, batches


class _Group(Protocol):
    world_size: int

    def call_each(self, method: Callable, args_per_rank: Sequence[tuple], timeout: float | None = None) -> list:
        ...


def next_chunk(done: int, batches: int, last: int, last_s: float, call_s: float, most: int) -> int:
    """Batches for the next call, ``done`` of ``batches`` measured so far and the last call
    having taken ``last_s`` seconds for ``last`` batches (0: none yet): as many as fit in
    ``call_s`` at that pace, at least 1, at most twice the last call's (one slow first call does
    not make the next one long, nor a fast one), ``most`` and what is left."""
    if last <= 0:
        size = 1
    else:
        fit = int(call_s * last / last_s) if last_s > 0 else most
        size = max(1, min(fit, 2 * last, most))
    return min(size, batches - done)


def evaluate_in_chunks(group: _Group, batches: int, timeout: float | None,
                       stop_requested: Callable[[], bool] = lambda: False,
                       progress: Callable[[int, int], None] = lambda done, batches: None,
                       call_s: float = EVAL_CALL_S, most: int = MAX_BATCHES_PER_CALL) -> float:
    """Mean validation loss over validation batches ``0 .. batches-1`` on ``group``.

    ``stop_requested`` is asked before each call: True raises :class:`EvaluationStopped` (no
    partial result is returned). ``progress(done, batches)`` follows each call. ``timeout``
    bounds each call; ``call_s`` and ``most`` size them (:func:`next_chunk`)."""
    sums = [0.0] * group.world_size
    done, last, last_s = 0, 0, 0.0
    while done < batches:
        if stop_requested():
            raise EvaluationStopped(done, batches)
        size = next_chunk(done, batches, last, last_s, call_s, most)
        t0 = time.perf_counter()
        sums = group.call_each(EPWorker.eval_sum, [(done, done + size, s) for s in sums], timeout=timeout)
        last, last_s = size, time.perf_counter() - t0
        done += size
        progress(done, batches)
    return group.call_each(EPWorker.eval_mean, [(s, batches) for s in sums], timeout=timeout)[0]


class ProgressLines:
    """``say("eval 120/5000 batches (...)")`` after a call when ``every_s`` seconds have passed
    since the evaluation began or the last line: a long evaluation shows it is alive, a short one
    prints nothing."""

    def __init__(self, say: Callable[[str], None], every_s: float) -> None:
        self.say, self.every_s = say, every_s
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, batches: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s or done >= batches:
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed * (batches - done) / done
        self.say(f"eval {done}/{batches} batches ({elapsed:.0f} s, about {left:.0f} s left)")
