"""Transport validators: what every rank received and returned, against a torch reference.

Run on every rank of a live group (``group.execute(check_dispatch, case)``); each rank builds
the same seeded *global* routing (tokens, weights, destinations of every rank), runs the
transport on its own share and checks the results it can see locally against a reference
computed from the global routing. Transport-agnostic: torch/gloo, torch/NCCL and NVSHMEM.

- :func:`check_dispatch`: received rows, slots and weights (row order free, padding rows must
  have every slot -1 and weight 0); the backward of dispatch (gradients summed per source
  token and routing-weight gradients picked per k). Three dispatches run back to back and the
  first one's outputs are checked *after* the others: buffer reuse must not corrupt them. The
  second and third ask for transport-owned outputs (``reuse_outputs``): the third, of another
  routing, is checked in the storage the second filled, where the transport owns it.
- :func:`check_combine`: per-token sums of the partial rows, and the backward of combine.

Routings and edge cases: :class:`~ray_moe.validation.cases.Case` and ``EDGE_CASES``; here the
routing is forced through the destinations directly (no router).
"""

from __future__ import annotations

from typing import Any

import torch

from ray_moe.config import torch_dtype
from ray_moe.validation.cases import Case
from ray_moe.validation.errors import rel_err


def make_routing(case: Case, world_size: int) -> list[dict[str, torch.Tensor]]:
    """Per rank: x float32 [T, H], weight float32 [T, K] (distinct, positive), dest_rank and
    dest_slot int32 [T, K] (K distinct experts per token; expert e on rank e // (E/W), slot e % (E/W))."""
    E, K, W, hidden = case.num_experts, case.top_k, world_size, case.hidden
    if E % W:
        raise ValueError(f"num_experts={E} is not divisible by world_size={W}")
    n = E // W
    allowed = list(range(E))
    if case.routing == "empty_rank":
        allowed = [e for e in allowed if e // n != W - 1]
    elif case.routing == "empty_expert":
        allowed = [e for e in allowed if e != 1]
    elif case.routing == "one_expert":
        allowed = [e for e in allowed if e != 0]
    need = K - 1 if case.routing == "one_expert" else K
    if need > len(allowed):
        raise ValueError(f"top_k={K} is more than the {len(allowed)} experts routing {case.routing!r} allows")
    g = torch.Generator().manual_seed(case.seed)
    allowed_t = torch.tensor(allowed, dtype=torch.int64)
    out = []
    for r in range(W):
        T = case.tokens(r)
        pick = allowed_t[torch.rand(T, len(allowed), generator=g).argsort(1)[:, :need]]
        if case.routing == "one_expert":
            pick = torch.cat([torch.zeros(T, 1, dtype=torch.int64), pick], 1)
        out.append({
            "x": torch.randn(T, hidden, generator=g),
            "weight": torch.rand(T, K, generator=g) + 0.25,
            "dest_rank": (pick // n).to(torch.int32),
            "dest_slot": (pick % n).to(torch.int32),
        })
    return out


def _reference_received(routing: list[dict], me: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows rank ``me`` must receive: x, slots (-1 elsewhere), weights (0 elsewhere), source-major."""
    xs, slots, ws = [], [], []
    for src in routing:
        mine = src["dest_rank"] == me
        rows = mine.any(1)
        xs.append(src["x"][rows])
        slots.append(torch.where(mine, src["dest_slot"], -1)[rows])
        ws.append(torch.where(mine, src["weight"], 0.0)[rows])
    return torch.cat(xs), torch.cat(slots), torch.cat(ws)


def _canonical(x: torch.Tensor, slot: torch.Tensor, w: torch.Tensor):
    """Valid rows sorted by a key from their (exactly carried, distinct) weights."""
    valid = (slot >= 0).any(1)
    x, slot, w = x[valid], slot[valid], w[valid]
    key = (w.double() * torch.arange(1, w.shape[1] + 1, dtype=torch.float64)).sum(1)
    order = key.argsort()
    return x[order], slot[order], w[order], valid


def _setup(worker: Any, case: Case):
    rank, W = worker.transport.rank, worker.transport.world_size  # (an EP group of a rank mesh: its own)
    worker.transport.reserve(case.buffer_spec())
    routing = make_routing(case, W)
    return case, rank, W, routing, worker.device, torch_dtype(case.dtype)


def _to(t: torch.Tensor, device, dtype=None) -> torch.Tensor:
    return t.to(device=device, dtype=dtype or t.dtype).contiguous()


def _scale(rank: int) -> float:
    return float(2 ** rank)  # powers of two keep bf16 products exact


def _sync_check(transport: Any) -> None:
    if hasattr(transport, "check"):
        transport.check()


def check_dispatch(worker: Any, case: Case) -> dict[str, Any]:
    """Run on every rank. Returns {'errors': {name: rel. error}, 'rows': rows received, ...}."""
    case, me, W, routing, dev, dtype = _setup(worker, case)
    tr = worker.transport
    local = routing[me]
    x = _to(local["x"], dev, dtype)
    args = (x, _to(local["weight"], dev), _to(local["dest_rank"], dev), _to(local["dest_slot"], dev))
    recv_x, recv_slot, recv_w, layout = tr.dispatch_forward(*args)
    # two more dispatches through the same buffers before any check, with outputs the transport
    # may own (reuse_outputs): the first routing again, then another one, whose outputs then
    # overwrite the first's where the transport reuses them
    routing2 = make_routing(case.but(seed=case.seed + 1000), W)
    l2 = routing2[me]
    owned = tr.dispatch_forward(*args, reuse_outputs=True)
    out2 = tr.dispatch_forward(_to(l2["x"], dev, dtype), _to(l2["weight"], dev),
                               _to(l2["dest_rank"], dev), _to(l2["dest_slot"], dev), reuse_outputs=True)
    # backward of the first dispatch: grads scaled by this (destination) rank's power of two
    s = _scale(me)
    grad_x = recv_x.float() * s
    grad_w = recv_w * s
    gx, gw = tr.dispatch_backward(grad_x.to(dtype).contiguous(), grad_w.contiguous(), layout)
    _sync_check(tr)

    errors: dict[str, float] = {}
    for tag, (rx, rs, rw), rt in (("", (recv_x, recv_slot, recv_w), routing), ("2", out2[:3], routing2)):
        ref_x, ref_s, ref_w = _reference_received(rt, me)
        ref_x = ref_x.to(dtype)
        cx, cs, cw, valid = _canonical(rx.cpu(), rs.cpu(), rw.cpu())
        rx_, rs_, rw_, _ = _canonical(ref_x, ref_s, ref_w)
        errors[f"rows{tag}"] = 0.0 if cx.shape[0] == rx_.shape[0] else float("inf")
        if cx.shape[0] == rx_.shape[0]:
            errors[f"recv_x{tag}"] = rel_err(cx, rx_)
            errors[f"recv_slot{tag}"] = 0.0 if torch.equal(cs, rs_) else float("inf")
            errors[f"recv_w{tag}"] = rel_err(cw, rw_)
        pad = ~valid
        pad_ok = bool((rs.cpu()[pad] == -1).all()) and bool((rw.cpu()[pad] == 0).all())
        errors[f"padding{tag}"] = 0.0 if pad_ok else float("inf")
    # reference gradients at the source
    dr = local["dest_rank"].long()
    to_rank = torch.zeros(dr.shape[0], W, dtype=torch.bool)
    if dr.numel():
        to_rank.scatter_(1, dr, True)
    mult = (to_rank.double() * torch.tensor([_scale(d) for d in range(W)], dtype=torch.float64)).sum(1)
    ref_gx = (x.double().cpu() * mult[:, None])
    ref_gw = local["weight"].double() * torch.tensor([_scale(d) for d in range(W)], dtype=torch.float64)[dr]
    errors["grad_x"] = rel_err(gx, ref_gx)
    errors["grad_w"] = rel_err(gw, ref_gw)
    if getattr(tr, "owns_dispatch_outputs", False) and x.numel():  # (an empty call allocates anew)
        same = all(a.data_ptr() == b.data_ptr() for a, b in zip(owned[:3], out2[:3]))
        errors["reused_outputs"] = 0.0 if same else float("inf")
    return {"errors": errors, "rows": int((recv_slot >= 0).any(1).sum().item()), "R": int(recv_x.shape[0])}


def check_combine(worker: Any, case: Case) -> dict[str, Any]:
    """Run on every rank: combine of partial rows (received rows scaled by the expert rank's
    power of two) and its backward (output grads scaled by 3 sent back to every row)."""
    case, me, W, routing, dev, dtype = _setup(worker, case)
    tr = worker.transport
    local = routing[me]
    x = _to(local["x"], dev, dtype)
    recv_x, recv_slot, recv_w, layout = tr.dispatch_forward(
        x, _to(local["weight"], dev), _to(local["dest_rank"], dev), _to(local["dest_slot"], dev))
    valid = (recv_slot >= 0).any(1, keepdim=True)
    partial = torch.where(valid, recv_x.float() * _scale(me), 1e30).to(dtype)  # padding must be ignored
    out = tr.combine_forward(partial.contiguous(), layout)
    grad_out = (x.float() * 0.5).to(dtype).contiguous()
    grad_partial = tr.combine_backward(grad_out, layout)
    _sync_check(tr)

    dr = local["dest_rank"].long()
    to_rank = torch.zeros(dr.shape[0], W, dtype=torch.bool)
    if dr.numel():
        to_rank.scatter_(1, dr, True)
    mult = (to_rank.double() * torch.tensor([_scale(d) for d in range(W)], dtype=torch.float64)).sum(1)
    errors = {"combine": rel_err(out, x.double().cpu() * mult[:, None])}
    v = valid.squeeze(1).cpu()
    errors["combine_grad"] = rel_err(grad_partial.cpu()[v], recv_x.cpu()[v].double() * 0.5)
    pad = grad_partial.cpu()[~v]
    errors["combine_grad_padding"] = 0.0 if (pad.numel() == 0 or bool((pad == 0).all())) else float("inf")
    return {"errors": errors}

