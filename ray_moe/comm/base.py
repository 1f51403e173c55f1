"""The Transport interface: dispatch token rows to expert ranks, combine partial sums back.

A transport implements four primitives; :func:`dispatch` and :func:`combine` wrap them in
autograd so the layer above is the same for every transport (torch.distributed on CPU and GPU,
NVSHMEM on GPU):

- ``dispatch_forward``: each token row goes **once per destination rank** (rank-dedup) with its
  K (slot, weight) pairs, slot -1 where that k goes to another rank.
- ``dispatch_backward``: the dual, a combine of row gradients (summed per source token) and of
  the routing-weight gradients.
- ``combine_forward``: one partial row per (token, destination rank) goes back; the source sums.
- ``combine_backward``: the dual, a dispatch of output gradients.

The ``Layout`` returned by ``dispatch_forward`` is the per-call routing state both directions
share (which rows went where). Transports subclass it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import torch


@dataclass(frozen=True)
class BufferSpec:
    """What a transport's buffers must hold, in explicit sizes (as DeepEP's ``Buffer`` takes
    byte sizes, not a training config).

    Attributes:
        max_tokens: T_cap, the most token rows one rank passes to one dispatch.
        hidden: H, elements per row.
        elem_bytes: bytes per row element (2 for bf16, 4 for float32).
        max_top_k: the widest K of any dispatch (the per-row (slot, weight) list).
    """

    max_tokens: int
    hidden: int
    elem_bytes: int
    max_top_k: int

    def covers(self, other: "BufferSpec") -> bool:
        """True when a buffer built for ``self`` also serves ``other``."""
        return (self.max_tokens >= other.max_tokens and self.hidden == other.hidden
                and self.elem_bytes >= other.elem_bytes and self.max_top_k >= other.max_top_k)


TRANSPORTS = ("gloo", "nccl", "nvshmem")


@dataclass(frozen=True)
class TransportSpec:
    """Which transport every rank of a group builds and how, resolved once on the driver (the
    group, from ``parallel.*``) and handed to each worker, which derives nothing itself.

    Attributes:
        name: gloo | nccl | nvshmem (``parallel.transport: auto`` already resolved).
        force_remote_path: NVSHMEM: reach every peer with puts, as if it were on another node.
        comm_programs: NVSHMEM: G, the programs (SMs) the exchange kernels run on (0: every SM).
        spin_limit: NVSHMEM: polls of a flag before a device-side wait gives up and reports.
        fast_launch: NVSHMEM: repeated calls of a shape launch Triton's compiled kernel directly
            where this Triton allows it (False: every call through Triton's JIT).
        ranks_per_gpu: ranks sharing one GPU (``parallel.workers_per_gpu``): NVSHMEM divides the
            SMs among them, since every program of every rank's exchange must be resident at once.
    """

    name: str
    force_remote_path: bool = False
    comm_programs: int = 0
    spin_limit: int = 1 << 25
    fast_launch: bool = True
    ranks_per_gpu: int = 1

    def __post_init__(self) -> None:
        if self.name not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.name!r}; choose one of {', '.join(TRANSPORTS)}")
        if self.comm_programs < 0:
            raise ValueError(f"comm_programs must be >= 0 (0: every SM), got {self.comm_programs}")
        if self.spin_limit < 1:
            raise ValueError(f"spin_limit must be >= 1, got {self.spin_limit}")
        if self.ranks_per_gpu < 1:
            raise ValueError(f"ranks_per_gpu must be >= 1, got {self.ranks_per_gpu}")


class Layout:
    """Routing state of one dispatch, reused by its combine and by both backwards.

    Subclasses set ``num_tokens`` (T, tokens at the source) and ``top_k`` (K).
    """

    num_tokens: int
    top_k: int


class Transport(ABC):
    """Moves token rows between the ranks of an expert-parallel group."""

    name: str = "abstract"
    # whether dispatch_forward(..., reuse_outputs=True) returns tensors the transport owns
    owns_dispatch_outputs: bool = False

    def __init__(self, rank: int, world_size: int, peers: Sequence[int] | None = None) -> None:
        self.rank = rank  # this rank's index among its peers
        self.world_size = world_size  # the peers: the ranks token rows move between
        # the global ranks of the peers, in transport-rank order (an EP group of the rank mesh):
        # no row this transport moves ever leaves them
        self.peers = tuple(range(world_size)) if peers is None else tuple(peers)
        if len(self.peers) != world_size:
            raise ValueError(f"{len(self.peers)} peers {self.peers} for a transport of {world_size} ranks")
        self.timer = CommTimer()
        # bytes of the token-row payloads the dispatches sent (host-known sizes: no sync), rows to
        # every destination, this rank's own included; the FP8 wire's saving is read here
        self.dispatched_bytes = 0

    @abstractmethod
    def dispatch_forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        dest_rank: torch.Tensor,
        dest_slot: torch.Tensor,
        reuse_outputs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Layout]:
        """Send rows to the ranks that hold their experts.

        Args:
            x: [T, H] this rank's tokens.
            weight: float32 [T, K] routing weights.
            dest_rank: int32 [T, K] destination rank per (token, k).
            dest_slot: int32 [T, K] expert slot on that rank.
            reuse_outputs: the caller consumes the outputs (and the layout) before its next
                dispatch of the same shape and keeps none of them (a forward without autograd, e.g.
                decoding): a transport may then return tensors it owns, the same ones for every such
                call of that shape (:attr:`owns_dispatch_outputs`), and skip their allocation. The
                others ignore it.
        Returns:
            recv_x [R, H], recv_slot int32 [R, K] (-1 = not for this rank), recv_weight float32
            [R, K] (0 where recv_slot is -1), and the layout. R may be a fixed capacity (from
            the reserved ``BufferSpec.max_tokens``) with padding rows whose slots are all -1.
        """

    @abstractmethod
    def dispatch_backward(
        self, grad_recv_x: torch.Tensor, grad_recv_weight: torch.Tensor, layout: Layout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, H], [R, K] gradients of the received rows → [T, H], [T, K] gradients at the source."""

    @abstractmethod
    def combine_forward(self, partial: torch.Tensor, layout: Layout) -> torch.Tensor:
        """[R, H] partial sums on the expert side → [T, H] summed per source token."""

    @abstractmethod
    def combine_backward(self, grad_out: torch.Tensor, layout: Layout) -> torch.Tensor:
        """[T, H] output gradient at the source → [R, H] gradient of the partial rows."""

    def reserve(self, spec: BufferSpec) -> None:
        """Make the transport's buffers hold ``spec`` (collective where buffers are symmetric:
        every rank calls it with the same spec). Transports without fixed buffers ignore it."""

    def check(self) -> None:
        """Raise if a device-side wait timed out since the last check (a host sync: call it
        outside the layer's forward and backward, e.g. at the end of a step)."""

    def close(self) -> None:
        """Release communication resources. Idempotent."""

    def describe(self) -> dict[str, Any]:
        return {"transport": self.name, "rank": self.rank, "world_size": self.world_size, "peers": list(self.peers)}


class CommTimer:
    """Time spent in a transport's primitives, for the step breakdown. Off by default.

    On the CPU it adds host wall time (the collectives are synchronous). On CUDA it records an
    event pair around each primitive on the current stream and sums them in :meth:`pop`, the only
    place that waits; leave it off while capturing CUDA graphs.
    """

    def __init__(self) -> None:
        self.enabled = False
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    def start(self, like: torch.Tensor) -> Any:
        if not self.enabled:
            return None
        if like.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, mark: Any) -> None:
        if mark is None:
            return
        if isinstance(mark, float):
            self._seconds += time.perf_counter() - mark
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((mark, end))

    def pop(self) -> float:
        """Seconds since the last pop (synchronises on the recorded CUDA events)."""
        total = self._seconds
        if self._events:
            self._events[-1][1].synchronize()
            total = self._seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        self._seconds, self._events = 0.0, []
        return total


class _LayoutBox:
    """Carries the (non-tensor) layout out of the dispatch autograd node."""

    layout: Layout | None = None


def _send_rows(ctx, transport, box, rows, weight, dest_rank, dest_slot, reuse_outputs):
    """The dispatch's forward exchange of ``rows`` (x, or another payload of x's rows), timed; the
    layout goes to ``box`` and ``ctx`` for the combine and the backward."""
    mark = transport.timer.start(rows)
    recv, recv_slot, recv_w, layout = transport.dispatch_forward(rows, weight, dest_rank, dest_slot,
                                                                 reuse_outputs=reuse_outputs)
    transport.timer.stop(mark)
    ctx.transport, ctx.layout = transport, layout
    box.layout = layout
    return recv, recv_slot, recv_w


def _return_grads(ctx, grad_recv_x, grad_recv_w):
    """The dispatch's backward: the received rows' (and weights') gradients back to their tokens →
    (gx [T, H], gw [T, K])."""
    if grad_recv_x is None:
        raise RuntimeError("dispatch backward got no gradient for the received rows")
    if grad_recv_w is None:
        grad_recv_w = torch.zeros(grad_recv_x.shape[0], ctx.layout.top_k, device=grad_recv_x.device)
    mark = ctx.transport.timer.start(grad_recv_x)
    gx, gw = ctx.transport.dispatch_backward(grad_recv_x.contiguous(), grad_recv_w.contiguous(), ctx.layout)
    ctx.transport.timer.stop(mark)
    return gx, gw


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, transport, box, x, weight, dest_rank, dest_slot, reuse_outputs=False):
        recv_x, recv_slot, recv_w = _send_rows(ctx, transport, box, x, weight, dest_rank, dest_slot, reuse_outputs)
        ctx.mark_non_differentiable(recv_slot)
        return recv_x, recv_slot, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_slot, grad_recv_w):
        gx, gw = _return_grads(ctx, grad_recv_x, grad_recv_w)
        return None, None, gx, gw, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, transport, layout, partial):
        ctx.transport, ctx.layout = transport, layout
        mark = transport.timer.start(partial)
        out = transport.combine_forward(partial, layout)
        transport.timer.stop(mark)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        mark = ctx.transport.timer.start(grad_out)
        grad = ctx.transport.combine_backward(grad_out.contiguous(), ctx.layout)
        ctx.transport.timer.stop(mark)
        return None, None, grad


def dispatch(
    transport: Transport,
    x: torch.Tensor,
    weight: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_slot: torch.Tensor,
    reuse_outputs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Layout]:
    """Differentiable dispatch (see :meth:`Transport.dispatch_forward` for shapes and
    ``reuse_outputs``, which applies only with autograd off: with it on, the experts save the
    received rows for their weight gradients, so they must outlive later dispatches)."""
    box = _LayoutBox()
    reuse = reuse_outputs and not torch.is_grad_enabled()
    recv_x, recv_slot, recv_w = _Dispatch.apply(
        transport, box, x, weight, dest_rank.to(torch.int32), dest_slot.to(torch.int32), reuse,
    )
    assert box.layout is not None
    return recv_x, recv_slot, recv_w, box.layout


class _DispatchPayload(torch.autograd.Function):
    """A dispatch whose rows travel as another payload than x (e.g. FP8 rows packed with their
    scales): the payload's rows go through the transport's layout and the returned stand-in for
    the received x rows carries their gradient back, a bf16 (x.dtype) dispatch backward."""

    @staticmethod
    def forward(ctx, transport, box, x, payload, weight, dest_rank, dest_slot, reuse_outputs=False):
        recv_p, recv_slot, recv_w = _send_rows(ctx, transport, box, payload, weight, dest_rank, dest_slot,
                                               reuse_outputs)
        # [R, H] of x's dtype without storage (one element, expanded): the received rows exist
        # only as the payload; this tensor's gradient is theirs
        stand_in = x.new_zeros(()).expand(recv_p.shape[0], x.shape[1])
        ctx.mark_non_differentiable(recv_slot, recv_p)
        return stand_in, recv_p, recv_slot, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_p, _grad_slot, grad_recv_w):
        gx, gw = _return_grads(ctx, grad_recv_x, grad_recv_w)
        return None, None, gx, None, gw, None, None, None


def dispatch_payload(
    transport: Transport,
    x: torch.Tensor,
    payload: torch.Tensor,
    weight: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_slot: torch.Tensor,
    reuse_outputs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Layout]:
    """Differentiable dispatch of x whose rows travel as ``payload`` [T, P] (any dtype and width,
    e.g. x's FP8 rows and scales as bytes: :func:`ray_moe.kernels.fp8_quant.pack_rows`);
    ``reuse_outputs`` (with autograd off only) as :func:`dispatch`'s.

    Returns:
        stand_in [R, H] (x.dtype, no storage of its own: the received rows' gradient enters the
        dispatch's backward through it, which returns x's gradient [T, H] in x.dtype as
        :func:`dispatch`'s), recv_payload [R, P], recv_slot int32 [R, K], recv_weight float32
        [R, K], and the layout (the combine's, as :func:`dispatch`'s).
    """
    if payload.dim() != 2 or payload.shape[0] != x.shape[0]:
        raise ValueError(f"payload must be [T, P] with T={x.shape[0]}, got {tuple(payload.shape)}")
    box = _LayoutBox()
    reuse = reuse_outputs and not torch.is_grad_enabled()
    stand_in, recv_p, recv_slot, recv_w = _DispatchPayload.apply(
        transport, box, x, payload.contiguous(), weight, dest_rank.to(torch.int32),
        dest_slot.to(torch.int32), reuse)
    assert box.layout is not None
    return stand_in, recv_p, recv_slot, recv_w, box.layout


def combine(transport: Transport, partial: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Differentiable combine: [R, H] partial rows → [T, H] per-token sums."""
    return _Combine.apply(transport, layout, partial)
