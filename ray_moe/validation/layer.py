"""Validators run on every rank of a live group: the EP layer against the single-process oracle.

Each rank builds the same global problem from a seed (tokens of every rank, router, all E
experts), runs the expert-parallel layer on its own tokens, runs the oracle
(:func:`ray_moe.model.experts.reference_moe`) on all tokens, and reports relative errors of its slice
of the output and of every gradient. Used by the tests, the GPU tests and the cluster smoke test.

Routing cases (:class:`~ray_moe.validation.cases.Case`) force the edge cases through the router
itself (a large constant feature times a large router column).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ray_moe.config import torch_dtype
from ray_moe.model.experts import reference_moe
from ray_moe.model.moe import MoELayer
from ray_moe.placement.clones import reduce_clone_grads
from ray_moe.placement.placement import Placement
from ray_moe.validation.cases import Case
from ray_moe.validation.errors import rel_err


def make_problem(case: Case, world_size: int) -> dict[str, Any]:
    """The global problem every rank builds identically (float32, CPU): tokens x [T_all, H],
    router [H, E], experts w13 [E, H, 2I] / w2 [E, I, H], grad_out [T_all, H], counts per rank."""
    g = torch.Generator().manual_seed(case.seed)
    E, H, I = case.num_experts, case.hidden, case.expert_hidden
    counts = [case.tokens(r) for r in range(world_size)]
    x = torch.randn(sum(counts), H, generator=g)
    router = torch.randn(H, E, generator=g) / math.sqrt(H)
    w13 = torch.randn(E, H, 2 * I, generator=g) / math.sqrt(H)
    w2 = torch.randn(E, I, H, generator=g) / math.sqrt(I)
    grad_out = torch.randn(sum(counts), H, generator=g)
    if case.routing != "random":
        x[:, 0] = 4.0
        router[0] = 0.0
        n = E // world_size
        if case.routing == "one_expert":
            router[0, 0] = 8.0
        elif case.routing == "empty_rank":
            router[0, (world_size - 1) * n:] = -8.0
        elif case.routing == "empty_expert":
            router[0, 1] = -8.0
    return {"x": x, "router": router, "w13": w13, "w2": w2, "grad_out": grad_out, "counts": counts}


def layer_parity(worker: Any, case: Case) -> dict[str, float]:
    """Run on every rank of a group (``group.execute(layer_parity, case)``): the EP layer over
    the worker's transport vs the oracle, its forward without autograd too (``out_no_grad``, with
    the dispatch outputs a transport may own, as decoding runs it). Returns {name: relative
    error} for this rank. On a rank mesh each EP group (the transport's peers) runs the problem
    on its own: ranks and sums are the group's."""
    rank, W = worker.transport.rank, worker.transport.world_size
    groups = getattr(worker, "groups", None)
    ep_group = groups.ep if groups is not None else None
    device, dtype = worker.device, torch_dtype(case.dtype)
    worker.transport.reserve(case.buffer_spec())
    P = make_problem(case, W)
    start = sum(P["counts"][:rank])
    mine = slice(start, start + P["counts"][rank])

    # Oracle on all tokens, float32 on the CPU, from the same (dtype-rounded) tokens the layer
    # sees: otherwise a near-tie in the router picks different experts on the two sides.
    x_ref = P["x"].to(dtype).float().clone().requires_grad_()
    router_ref = P["router"].clone().requires_grad_()
    w13_ref = P["w13"].clone().requires_grad_()
    w2_ref = P["w2"].clone().requires_grad_()
    out_ref, _, ids_ref = reference_moe(x_ref, router_ref, w13_ref, w2_ref, case.top_k)
    (out_ref * P["grad_out"]).sum().backward()

    placement = (
        Placement.from_dict(case.placement)
        if case.placement
        else Placement.native(case.num_experts, W)
    )
    layer = MoELayer(case.layer_spec(dtype), worker.transport, placement, device=device)
    with torch.no_grad():
        layer.router.copy_(P["router"])
        for slot, e in enumerate(placement.slot_experts()[rank].tolist()):
            if e >= 0:
                layer.load_expert(slot, P["w13"][e], P["w2"][e])
    x = P["x"][mine].to(device=device, dtype=dtype).requires_grad_()
    with torch.no_grad():  # as decoding runs it: no autograd, dispatch outputs the transport may own
        out_no_grad, _ = layer(x)
        layer.expert_tokens.zero_()
        layer.received_pairs.zero_()
    out, _ = layer(x)
    (out.float() * P["grad_out"][mine].to(device)).sum().backward()

    reduce_clone_grads(layer, placement, group=ep_group)
    router_grad = layer.router.grad.detach().clone()
    if W > 1:
        dist.all_reduce(router_grad, group=ep_group)
    natives = list(layer.native_experts)
    n = len(natives)
    errors = {
        "out": rel_err(out, out_ref[mine]),
        "out_no_grad": rel_err(out_no_grad, out_ref[mine]),
        "grad_x": rel_err(x.grad, x_ref.grad[mine]),
        # A forced routing saturates the softmax (p ~ 1 - 1e-14) and top-1 renormalises to exactly
        # 1: the router gradient is ~0 and round-off decides its direction, so it gets an
        # absolute floor there. The random case checks it strictly.
        "grad_router": rel_err(router_grad, router_ref.grad,
                               floor=1e-3 if case.top_k == 1 or case.routing != "random" else 0.0),
        "grad_w13": rel_err(layer.w13.grad[:n], w13_ref.grad[natives]),
        "grad_w2": rel_err(layer.w2.grad[:n], w2_ref.grad[natives]),
    }
    # Load statistics: tokens per logical expert from this rank, pairs computed over all ranks.
    want_tokens = torch.bincount(ids_ref[mine].flatten(), minlength=case.num_experts).float()
    errors["expert_tokens"] = 0.0 if torch.equal(layer.expert_tokens.cpu(), want_tokens) else math.inf
    pairs = layer.received_pairs.detach().clone()
    if W > 1:
        dist.all_reduce(pairs, group=ep_group)
    errors["received_pairs"] = 0.0 if int(pairs.item()) == ids_ref.numel() else math.inf
    # Experts that got no tokens must have exactly zero gradients.
    routed = torch.zeros(case.num_experts, dtype=torch.bool)
    routed[ids_ref.flatten().unique()] = True
    for i, e in enumerate(natives):
        if not routed[e] and (layer.w13.grad[i].abs().sum() != 0 or layer.w2.grad[i].abs().sum() != 0):
            errors["unrouted_expert_grad"] = math.inf
    return errors
