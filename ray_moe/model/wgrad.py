"""The experts' weight gradients on a side stream (``moe.delay_wgrad``).

In backward, the Triton experts' Function computes dx first and hands its two weight-gradient
GEMMs to a :class:`WgradDeferral`; autograd then runs the dispatch's backward (the exchange that
returns dx to the sources) while those GEMMs run beside it, neither shrunk. The dispatch's
backward joins the deferral once its exchange is launched, so a layer's backward still ends with
its weight gradients in ``.grad`` and still captures in one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class WgradDeferral:
    """The experts' weight gradients of one layer, on a side stream beside what follows them in
    backward (Megatron's delayed weight-gradient compute, keeping every GEMM whole).

    :meth:`launch` runs ``fn`` (→ gradients shaped like ``params``) on the side stream after the
    current stream's work so far and adds its results into ``params``' ``.grad`` there (autograd
    gets None for them); :meth:`join` makes the current stream wait for it, capturable in a CUDA
    graph (a fork and a join of streams). Off CUDA it runs inline. One deferral per layer; a
    launch without a join before the next launch is joined by that launch.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._grads: list[torch.Tensor] = []  # produced on the side stream, used after the join

    def launch(self, params: tuple[torch.Tensor, ...], fn: Callable[[], tuple[torch.Tensor | None, ...]],
               inputs: tuple[torch.Tensor, ...]) -> None:
        """``params``: leaf parameters (e.g. w13 [S, H, 2I], w2 [S, I, H]); ``fn()`` → one gradient
        per parameter, shaped and typed like it (None: none); ``inputs``: the tensors ``fn`` reads
        that the current stream made (kept from reuse until the side stream is done with them)."""
        if self.stream is None:
            _accumulate(params, fn())
            return
        self.join()
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            _accumulate(params, fn())
        grads = [p.grad for p in params if p.grad is not None]
        for t in (*inputs, *grads):
            t.record_stream(self.stream)
        self._grads = grads

    def join(self) -> None:
        """The current stream waits for the launched weight gradients (no-op when none)."""
        if self.stream is None or not self._grads:
            return
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        for g in self._grads:  # they were allocated on the side stream and are used on this one
            g.record_stream(current)
        self._grads = []


def _accumulate(params: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]) -> None:
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
