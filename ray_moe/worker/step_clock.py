"""Where a training step's time goes, without stopping the device to find out.

A host synchronisation at each phase boundary leaves the GPU idle while the host launches the
next phase's first kernels (the short ones of a backward's or a reduction's start run only as fast
as the host issues them). :class:`StepClock` marks the boundaries instead and reads the durations
once the step's last wait has happened: CUDA events on the current stream on a GPU, host wall
time on the CPU (where every kernel is synchronous and the two agree).
"""

from __future__ import annotations

import time

import torch


class StepClock:
    """Named marks in one step; :meth:`seconds` between two of them after the step's final wait.

    On CUDA a mark is an event recorded on the current stream, so a duration is the GPU time
    between the work issued before each mark (idle time inside included); ``seconds`` must come
    after that stream was synchronised (or the later event waited for), as the engine's step does.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._marks: dict[str, object] = {}

    def mark(self, name: str) -> None:
        """Mark ``name`` here: after everything issued so far on the current stream (CUDA), or now."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._marks[name] = event
        else:
            self._marks[name] = time.perf_counter()

    def seconds(self, start: str, end: str) -> float:
        """Seconds from mark ``start`` to mark ``end`` (KeyError for a name never marked)."""
        a, b = self._marks[start], self._marks[end]
        if self.cuda:
            return a.elapsed_time(b) / 1e3  # type: ignore[attr-defined]
        return b - a  # type: ignore[operator]
