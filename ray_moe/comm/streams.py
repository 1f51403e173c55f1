"""Work on the exchange's side stream beside the current one: one stage at a time, ordered by
events, its tensors kept from reuse until the other stream is done with them.

Used by the overlapped exchanges (:mod:`ray_moe.comm.pipeline`'s chunks, the MoE layer's staged
calls under ``moe.two_batch_overlap``). Off CUDA there are no streams: a stage runs inline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def run_on(stream: Any, consumer: Any, fn: Callable[..., Any], *args: Any, after: Any = None) -> tuple[Any, Any]:
    """``fn(*args)`` issued on ``stream`` once ``after`` (an event, or None) has happened; its
    tensor results (a tuple, or one tensor) are ``record_stream``-ed on ``consumer``, the stream
    that uses them next. Returns (result, an event recorded on ``stream`` after it). ``stream``
    None (the CPU): ``(fn(*args), None)``."""
    if stream is None:
        return fn(*args), None
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        result = fn(*args)
        done = torch.cuda.Event()
        done.record(stream)
    used_on(result, consumer)
    return result, done


def used_on(result: Any, stream: Any) -> None:
    """record_stream the CUDA tensors of ``result`` (a tuple, or one tensor) on ``stream``."""
    for t in result if isinstance(result, tuple) else (result,):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


def wait(stream: Any, event: Any) -> None:
    """``stream`` waits for ``event`` (no-op without either: the CPU, or nothing in flight)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def current(t: torch.Tensor) -> Any:
    """The current CUDA stream of t's device (None on the CPU)."""
    return torch.cuda.current_stream(t.device) if t.is_cuda else None


def made(t: torch.Tensor) -> Any:
    """An event on the current stream after the work queued so far, t's making among it (None on
    the CPU): what a stage on another stream waits for before it reads t."""
    if not t.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event
