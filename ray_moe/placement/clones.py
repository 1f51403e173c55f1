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


def _exchange(
    tensors: list[torch.Tensor], placement: Placement, rank: int, to_owner: bool
) -> list[tuple[int, int, list[torch.Tensor]]]:
    """Send slot rows clone→owner (to_owner) or owner→clone; return what this rank received.

    tensors: per-slot parameter-shaped tensors [S, ...] (weights or grads), same on every rank.
    Returns [(local destination slot, expert, [row per tensor])].
    """
    W, n = placement.world_size, placement.experts_per_rank
    moves = _moves(placement)
    if not moves:
        return []
    sizes = [t[0].numel() for t in tensors]
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
    width = sum(sizes)
    ref = tensors[0]
    send = torch.cat([torch.stack(r) if r else ref.new_zeros(0, width) for r in send_rows])
    send_splits = [len(r) for r in send_rows]
    recv_splits = [len(p) for p in recv_plan]
    if W == 1 or not dist.is_initialized():
        recv = send
    else:
        recv = send.new_empty(sum(recv_splits), width)
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
    out, i = [], 0
    for plan in recv_plan:
        for dst_slot, e in plan:
            pieces = list(torch.split(recv[i], sizes))
            out.append((dst_slot, e, [p.view_as(t[0]) for p, t in zip(pieces, tensors)]))
            i += 1
    return out


@torch.no_grad()
def reduce_clone_grads(layer, placement: Placement, grads: list[torch.Tensor] | None = None) -> None:
    """Add every clone slot's gradient onto its owner's native slot, then zero the clone's.

    ``grads``: the gradients to reduce, shaped like ``[layer.w13, layer.w2]`` (default their
    ``.grad``; the engine passes its float32 master gradients).
    """
    if not placement.clones():
        return
    rank, n = layer.rank, placement.experts_per_rank
    grads = [layer.w13.grad, layer.w2.grad] if grads is None else grads
    if any(g is None for g in grads):
        raise RuntimeError("reduce_clone_grads needs gradients: run backward first")
    received = _exchange(grads, placement, rank, to_owner=True)
    for dst_slot, _e, rows in received:
        for g, row in zip(grads, rows):
            g[dst_slot] += row
    for g in grads:
        g[n:] = 0


@torch.no_grad()
def push_clone_weights(layer, placement: Placement) -> int:
    """Copy owners' native weights into every clone slot. Returns bytes this rank received."""
    received = _exchange([layer.w13, layer.w2], placement, layer.rank, to_owner=False)
    moved = 0
    for dst_slot, _e, rows in received:
        layer.w13[dst_slot].copy_(rows[0])
        layer.w2[dst_slot].copy_(rows[1])
        moved += sum(r.numel() * r.element_size() for r in rows)
    return moved
