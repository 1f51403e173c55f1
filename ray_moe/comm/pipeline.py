"""The exchange overlapped with expert compute: each rank's tokens in chunks, software-pipelined.

An MoE layer's sequential form is dispatch → experts → combine over all T tokens of a rank, so the
GPU idles on the link twice per layer. :func:`pipelined_exchange` splits the rank's tokens into
``C`` chunks (:func:`token_chunks`; C is a shape constant, the same on every rank, so every rank
makes the same sequence of collective calls, empty chunks included) and issues

    comm (side stream):  D0 D1 C0 D2 C1 D3 C2 ...        D = dispatch, C = combine of chunk i
    compute (current):      E0 E1 E2 ...                  E = experts of chunk i

so chunk i+1 arrives and chunk i-1 goes back while chunk i's experts run. Only the first
dispatch and the last combine run with nothing beside them, so chunks may be of unequal sizes
(``moe.pipeline_chunks: [1, 6, 1]``): small ends, a large middle whose GEMMs stay large. A chunk's
experts take ~8x its exchange at H=4096 on H200s at W=4, so a neighbour up to that much larger
still hides. It stays opt-in: chunking alone costs the expert step 5-17 % (``bench layer
--sections chunking``), more than the exchange it hides at W=2 and as much at W=4
(docs/BENCHMARKS.md, session 16). Backward is the same
pipeline over the duals: the combine's backward (a dispatch of output gradients) of chunk i+1
and the dispatch's backward (a combine of row and weight gradients) of chunk i-1 run while chunk
i's expert backward does. Communication stays on one side stream per transport
(:meth:`Transport.comm_stream`), in one order on every rank: the persistent NVSHMEM kernels of
two exchanges never run at once. On the CPU there are no streams and the same schedule runs in
order; the results are those of the sequential layer (tested on gloo at W=1, 2, 4).

Autograd: the chunks' dispatch, experts and combine are one autograd node whose backward runs
that schedule (autograd alone would run each chunk's backward to the end before the next, which
serialises communication and compute). Each chunk's experts build their own small graph inside
the node's forward, on detached inputs; backward differentiates it with ``torch.autograd.grad``
and sums the weight gradients over chunks (C - 1 extra additions of each expert weight gradient).
With a :class:`~ray_moe.model.wgrad.WgradDeferral` (``moe.delay_wgrad``) the Triton experts hand
each chunk's weight-gradient GEMMs to its side stream instead: they run beside the next chunk's
activation gradients and, for the last chunk, beside its return exchange, which otherwise runs
alone.
No host synchronisation and no data-dependent control flow: capturable in a CUDA graph.

Activation checkpointing: its recomputation is keyed by autograd's graph task, and each
``torch.autograd.grad`` above is a graph task of its own (it would recompute the layer again per
chunk). Under saved-tensor hooks the chunks are therefore composed of the ordinary per-chunk
autograd nodes (:func:`ray_moe.comm.base.dispatch` / ``combine``): the forward and its replay
overlap as above, backward runs chunk by chunk.

Streams: tensors made on one stream and used on the other are ``record_stream``-ed, so the
caching allocator never hands their memory out while the other stream may still use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ray_moe.chunks import chunk_weights, token_chunks
from ray_moe.comm.base import combine, dispatch
from ray_moe.comm.streams import run_on

Compute = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class _Plan:
    """What one pipelined exchange needs besides its tensors."""

    transport: Any
    chunks: tuple[int, ...]  # relative chunk sizes (chunk_weights)
    capacities: list[int] | None  # rows per source of each chunk's dispatch (Transport.chunk_capacity)
    compute: Compute  # (recv_x, recv_slot, recv_w, *params[, deferral=]) -> partial [R, H]
    side: Any  # the comm stream, None on the CPU
    deferral: Any = None  # a WgradDeferral: each chunk's weight gradients beside what follows them

    @property
    def n(self) -> int:
        return len(self.chunks)

    def capacity(self, i: int) -> int | None:
        return None if self.capacities is None else self.capacities[i]


def pipelined_exchange(
    transport: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_slot: torch.Tensor,
    params: Sequence[torch.Tensor],
    compute: Compute,
    chunks: int | Sequence[int],
    deferral: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch → ``compute`` → combine over ``chunks`` chunks of this rank's tokens, overlapped.

    Args:
        transport: the :class:`~ray_moe.comm.base.Transport`.
        x: [T, H] this rank's tokens; weight float32 [T, K]; dest_rank, dest_slot int [T, K]
            (as for :func:`ray_moe.comm.base.dispatch`, with the replica already picked per token).
        params: tensors ``compute`` differentiates besides its rows (the expert weights).
        compute: ``compute(recv_x [R, H], recv_slot int32 [R, K], recv_w float32 [R, K], *params)
            -> partial [R, H]`` (padding rows have every slot -1), differentiable in recv_x,
            recv_w and params; called once per chunk, on the current stream.
        chunks: C >= 1 equal chunks, or one relative size per chunk (e.g. ``[1, 6, 1]``: the
            first dispatch and the last combine, which nothing hides, move a small chunk); the
            same on every rank.
        deferral: a :class:`~ray_moe.model.wgrad.WgradDeferral` or None. With one, ``compute``
            is called with ``deferral=`` and may hand its weight gradients to it (the Triton
            experts do): each chunk's then run on the deferral's stream beside the next chunk's
            backward and the last chunk's return exchange, instead of before them.
    Returns:
        out [T, H] (x.dtype): per token the sum of its partial rows from every rank, as
        ``combine(compute(dispatch(...)))`` gives; received_pairs: int64 scalar, the (row, k)
        pairs with a slot on this rank over all chunks (a load statistic, no gradient).
    """
    side = transport.comm_stream(x.device)
    weights = chunk_weights(chunks)
    plan = _Plan(transport, weights, transport.chunk_capacity(weights), compute, side, deferral)
    args = (x, weight.float(), dest_rank.to(torch.int32), dest_slot.to(torch.int32), *params)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, *params))):
        with torch.no_grad():
            out, pairs, _, _ = _forward(plan, *args, mode="plain")
        return out, pairs
    if _saved_tensors_hooks_active():
        # Activation checkpointing (or another saved-tensor hook): its recomputation is keyed by
        # autograd's graph task, and the fused node's backward differentiates each chunk in a
        # graph task of its own, which would recompute again. Compose per-chunk autograd nodes
        # instead: the forward overlaps as above, backward runs chunk by chunk (not overlapped).
        out, pairs, _, _ = _forward(plan, *args, mode="autograd")
        return out, pairs
    return _Exchange.apply(plan, *args)


def _saved_tensors_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, x, weight, dest_rank, dest_slot, *params):
        needs = ctx.needs_input_grad[1:]
        out, pairs, graphs, leaves = _forward(plan, x, weight, dest_rank, dest_slot, *params, mode="graphs",
                                              needs=needs)
        ctx.plan, ctx.graphs, ctx.leaves, ctx.T = plan, graphs, leaves, x.shape[0]
        ctx.needs_x, ctx.needs_w, ctx.needs_params = needs[0], needs[1], needs[4:]
        ctx.mark_non_differentiable(pairs)
        return out, pairs

    @staticmethod
    def backward(ctx, grad_out, _grad_pairs):
        plan, graphs = ctx.plan, ctx.graphs
        tr = plan.transport
        bounds = token_chunks(ctx.T, plan.chunks)
        deferred = plan.deferral is not None
        grad_out = grad_out.contiguous()
        sends_back = ctx.needs_x or ctx.needs_w
        wanted = [j for j, n in enumerate(ctx.needs_params) if n]
        acc: dict[int, torch.Tensor] = {}

        def send(i):  # the combine's backward: output gradients to the expert ranks
            t0, t1 = bounds[i]
            return (_timed(tr, tr.combine_backward, grad_out[t0:t1], graphs[i].layout),)

        def work(i, sent):  # the experts' backward of chunk i
            g = graphs[i]
            inputs = [t for t, n in ((g.recv_x, ctx.needs_x), (g.recv_w, ctx.needs_w)) if n]
            inputs += [g.params[j] for j in wanted]
            grads = [None] * len(inputs)
            if inputs and g.partial.requires_grad:
                grads = list(torch.autograd.grad(g.partial, inputs, sent[0], allow_unused=True))
            grx = grads.pop(0) if ctx.needs_x else None
            grw = grads.pop(0) if ctx.needs_w else None
            for j, gp in zip(wanted, grads):
                if gp is not None:
                    acc[j] = gp.contiguous() if j not in acc else acc[j].add_(gp)  # expanded: copied
            grx = grx if grx is not None else torch.zeros_like(g.recv_x)
            grw = grw if grw is not None else torch.zeros_like(g.recv_w)
            g.release()
            return grx, grw

        def back(i, worked):  # the dispatch's backward: row and weight gradients to the sources
            if not sends_back:
                return (None, None)
            return _timed(tr, tr.dispatch_backward, worked[0].contiguous(), worked[1].float().contiguous(),
                          graphs[i].layout)

        results = _schedule(plan.n, send, work, back, plan.side)
        gx = torch.cat([r[0] for r in results]) if ctx.needs_x else None
        gw = torch.cat([r[1] for r in results]) if ctx.needs_w else None
        if deferred:  # the weight gradients the deferral accumulated into the leaves' .grad
            plan.deferral.join()
            for j, leaf in enumerate(ctx.leaves):
                if leaf.grad is not None:
                    acc[j] = leaf.grad if j not in acc else acc[j].add_(leaf.grad)
                    leaf.grad = None
        param_grads = [(acc[j] if j in acc else torch.zeros_like(ctx.leaves[j])) if n else None
                       for j, n in enumerate(ctx.needs_params)]
        ctx.graphs = ctx.leaves = None
        return (None, gx, gw, None, None, *param_grads)


class _ChunkGraph:
    """One chunk's expert graph (detached leaves in, ``partial`` out) and its exchange layout."""

    __slots__ = ("layout", "recv_x", "recv_w", "params", "partial")

    def __init__(self, layout, recv_x, recv_w, params, partial) -> None:
        self.layout, self.recv_x, self.recv_w, self.params, self.partial = layout, recv_x, recv_w, params, partial

    def release(self) -> None:
        self.recv_x = self.recv_w = self.partial = None  # type: ignore[assignment]


def _forward(plan: _Plan, x, weight, dest_rank, dest_slot, *params, mode: str,
             needs: Sequence[bool] = ()):
    """The forward schedule. ``mode``: "plain" (no gradients), "graphs" (each chunk's experts
    build a graph of their own on detached leaves, for :class:`_Exchange`; ``needs``: which of
    (x, weight, dest_rank, dest_slot, *params) need gradients), "autograd" (differentiable
    dispatch and combine per chunk in the caller's graph). Returns (out [T, H], received pairs,
    per-chunk graphs, the parameters' leaves); the last two only for "graphs"."""
    tr = plan.transport
    bounds = token_chunks(x.shape[0], plan.chunks)
    graphs: list[Any] = [None] * plan.n
    leaves = [p.detach().requires_grad_(n) for p, n in zip(params, needs[4:])] if mode == "graphs" else params
    pairs = torch.zeros((), dtype=torch.int64, device=x.device)

    def send(i):
        t0, t1 = bounds[i]
        chunk = (x[t0:t1], weight[t0:t1], dest_rank[t0:t1], dest_slot[t0:t1])
        if mode == "autograd":
            return dispatch(tr, *chunk, capacity=plan.capacity(i))
        return _timed(tr, tr.dispatch_forward, *chunk, capacity=plan.capacity(i))

    def work(i, sent):
        nonlocal pairs
        recv_x, recv_slot, recv_w, layout = sent
        pairs = pairs + (recv_slot >= 0).sum()
        if mode != "graphs":
            return plan.compute(recv_x, recv_slot, recv_w, *params), layout
        rx = recv_x.detach().requires_grad_(needs[0])
        rw = recv_w.detach().requires_grad_(needs[1])
        with torch.enable_grad():
            extra = {"deferral": plan.deferral} if plan.deferral is not None else {}
            partial = plan.compute(rx, recv_slot, rw, *leaves, **extra)
        graphs[i] = _ChunkGraph(layout, rx, rw, leaves, partial)
        return partial.detach(), layout

    def back(i, worked):
        if mode == "autograd":
            return (combine(tr, worked[0], worked[1]),)
        return (_timed(tr, tr.combine_forward, worked[0].contiguous(), worked[1]),)

    results = _schedule(plan.n, send, work, back, plan.side)
    out = torch.cat([r[0] for r in results])
    return out, pairs, graphs, leaves


def _schedule(n: int, send: Callable, work: Callable, back: Callable, side: Any) -> list[tuple]:
    """Issue ``send(i)`` and ``back(i, work_result)`` on ``side`` and ``work(i, send_result)`` on
    the current stream, in the order send(0), send(1), work(0), back(0), send(2), work(1),
    back(1), ...: send(i+1) overlaps work(i) and back(i) overlaps work(i+1); events order each
    stage after the one it consumes. Returns the back results in chunk order. ``side`` None (the
    CPU): the same calls in the same order, no streams."""
    main = torch.cuda.current_stream() if side is not None else None
    if side is not None:
        side.wait_stream(main)  # the inputs (routing, tokens) are made on the current stream

    sent: list[Any] = [None] * n
    done: list[Any] = [None] * n
    if n:
        sent[0] = run_on(side, main, send, 0)
    for i in range(n):
        if i + 1 < n:
            sent[i + 1] = run_on(side, main, send, i + 1)
        worked = run_on(main, side, work, i, sent[i][0], after=sent[i][1])
        done[i] = run_on(side, main, back, i, worked[0], after=worked[1])[0]
        sent[i] = None
    if side is not None:
        main.wait_stream(side)
    return done


def _timed(tr: Any, fn: Callable, first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``fn(first, *args)`` inside the transport's CommTimer (on the side stream where there is one)."""
    mark = tr.timer.start(first)
    out = fn(first, *args, **kwargs)
    tr.timer.stop(mark)
    return out
