"""Clone coherence: clones are copies, not parameters.

After backward, each clone's gradient is added onto its owner's native slot and zeroed
(:func:`reduce_clone_grads`); the owner alone steps the optimizer; before the next forward the
owner's weights are copied into every clone slot (:func:`push_clone_weights`). Both move rows
GPU-to-GPU (or CPU-to-CPU over gloo) with one all_to_all_single over the group; the layout is
derived from the placement on every rank, so no sizes are exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ray_moe.placement.placement import Placement, Replica


def _moves(placement: Placement) -> list[tuple[int, Replica]]:
    """(logical expert, clone replica) in a canonical order shared by every rank."""
    return sorted(placement.clones(), key=lambda c: (c[1].rank, c[1].slot))


class RowExchange:
    """Slot rows in flight between ranks (one ``all_to_all_single``, maybe asynchronous).

    :meth:`received` waits for them (on NCCL: the current stream waits, the host does not) and
    returns ``[(local destination slot, expert, [row per tensor])]``.
    """

    def __init__(self, recv: torch.Tensor, work, plan: list[tuple[int, int]], tensors: list[torch.Tensor]) -> None:
        self._recv, self._work, self._plan = recv, work, plan
        self._sizes = [t[0].numel() for t in tensors]
        self._shapes = [t.shape[1:] for t in tensors]

    def received(self) -> list[tuple[int, int, list[torch.Tensor]]]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        out = []
        for i, (dst_slot, e) in enumerate(self._plan):
            pieces = torch.split(self._recv[i], self._sizes)
            out.append((dst_slot, e, [p.view(shape) for p, shape in zip(pieces, self._shapes)]))
        return out


def _exchange(
    tensors: list[torch.Tensor], placement: Placement, rank: int, to_owner: bool,
    group: dist.ProcessGroup | None = None, async_op: bool = False,
) -> RowExchange:
    """Send slot rows clone→owner (to_owner) or owner→clone; :meth:`RowExchange.received` gives
    what this rank received.

    tensors: per-slot parameter-shaped tensors [S, ...] (weights or grads), same on every rank.
    The rows are copied into one send buffer before this returns (the caller may overwrite its
    tensors at once). group: the process group (default: the default group).
    """
    W, n = placement.world_size, placement.experts_per_rank
    moves = _moves(placement)
    send_rows: list[list[torch.Tensor]] = [[] for _ in range(W)]
    recv_plan: list[list[tuple[int, int]]] = [[] for _ in range(W)]  # per source: (dest slot, expert)
    for e, rep in moves:
        owner, native_slot = placement.owner(e), e % n
        src, src_slot, dst, dst_slot = (
            (rep.rank, rep.slot, owner, native_slot) if to_owner else (owner, native_slot, rep.rank, rep.slot)
        )
        if src == rank:
            send_rows[dst].append(torch.cat([t[src_slot].reshape(-1) for t in tensors]))
        if dst == rank:
            recv_plan[src].append((dst_slot, e))
    width = sum(t[0].numel() for t in tensors)
    ref = tensors[0]
    send = torch.cat([torch.stack(r) if r else ref.new_zeros(0, width) for r in send_rows])
    plan = [step for per_source in recv_plan for step in per_source]
    if W == 1 or not dist.is_initialized():
        return RowExchange(send, None, plan, tensors)
    recv = send.new_empty(len(plan), width)
    work = dist.all_to_all_single(recv, send, [len(p) for p in recv_plan], [len(r) for r in send_rows],
                                  group=group, async_op=async_op)
    return RowExchange(recv, work, plan, tensors)


def launch_clone_grads(placement: Placement, rank: int, grads: list[torch.Tensor],
                       group: dist.ProcessGroup | None = None) -> RowExchange | None:
    """Start sending every clone slot's gradient rows to their owners (asynchronously) and zero
    the clone slots; None when the placement has no clones. ``grads``: shaped like
    ``[layer.w13, layer.w2]`` ([S, ...], any float dtype)."""
    if not placement.clones():
        return None
    exchange = _exchange(grads, placement, rank, to_owner=True, group=group, async_op=True)
    for g in grads:
        g[placement.experts_per_rank:] = 0
    return exchange


@torch.no_grad()
def add_clone_grads(exchange: RowExchange, grads: list[torch.Tensor]) -> None:
    """Each owner's native slot += the gradient rows its clones sent (:func:`launch_clone_grads`),
    summed in float32 and rounded once into the gradients' dtype (exact for float32 gradients)."""
    rows_by_slot: dict[int, list[list[torch.Tensor]]] = {}
    for dst_slot, _e, rows in exchange.received():
        rows_by_slot.setdefault(dst_slot, []).append(rows)
    for dst_slot, senders in rows_by_slot.items():
        for i, g in enumerate(grads):
            total = g[dst_slot].to(torch.float32)  # (a view of g when g is float32)
            for rows in senders:
                total += rows[i]
            if total.data_ptr() != g[dst_slot].data_ptr():
                g[dst_slot].copy_(total)


@torch.no_grad()
def reduce_clone_grads(layer, placement: Placement, grads: list[torch.Tensor] | None = None,
                       group: dist.ProcessGroup | None = None) -> None:
    """Add every clone slot's gradient onto its owner's native slot, then zero the clone's.

    ``grads``: the gradients to reduce, shaped like ``layer.expert_params()`` (default their
    ``.grad``; the engine passes its float32 master gradients).
    """
    grads = [p.grad for p in _expert_params(layer)] if grads is None else grads
    if any(g is None for g in grads):
        raise RuntimeError("reduce_clone_grads needs gradients: run backward first")
    exchange = launch_clone_grads(placement, layer.rank, grads, group)
    if exchange is not None:
        add_clone_grads(exchange, grads)


@torch.no_grad()
def push_clone_weights(layer, placement: Placement, group: dist.ProcessGroup | None = None) -> int:
    """Copy owners' native weights into every clone slot. Returns bytes this rank received.
    ``group``: the layer's EP group (the placement's ranks; default: the default group)."""
    if not placement.clones():
        return 0
    moved = 0
    params = _expert_params(layer)
    for dst_slot, _e, rows in _exchange(params, placement, layer.rank, to_owner=False, group=group).received():
        for p, r in zip(params, rows):
            p[dst_slot].copy_(r)
        moved += sum(r.numel() * r.element_size() for r in rows)
    return moved


def _expert_params(layer) -> list[torch.Tensor]:
    """The layer's expert-sharded parameters ([S, ...] each): w13, w2 and any expert biases."""
    return layer.expert_params() if hasattr(layer, "expert_params") else [layer.w13, layer.w2]
