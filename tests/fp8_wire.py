"""FP8 rows on the wire against the FP8 experts without it, on every rank of a live group.

The wire changes where the rows are quantised (at the source, before the dispatch, instead of on
the expert side), not the quantisation: the forward, dX, the routing-weight and router gradients
and dW2 are the FP8 layer's to float32 round-off. The weight gradient dW13 = xᵀ dh13 reads the
rows the experts hold, the dequantised FP8 rows on the wire: it equals the FP8 layer's run on
those rows, ``dequantize_rows(quantize_rows(x))`` (the wire's values are what the experts see).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ray_moe.comm.base import dispatch, dispatch_payload
from ray_moe.config import torch_dtype
from ray_moe.kernels.fp8_expert_ffn import default_ops
from ray_moe.kernels.fp8_quant import dequantize_rows, pack_rows
from ray_moe.model.moe import MoELayer
from ray_moe.placement.placement import Placement
from ray_moe.validation.cases import Case
from ray_moe.validation.errors import rel_err
from ray_moe.validation.layer import make_problem


def _run(worker: Any, case: Case, wire: bool, x_in: torch.Tensor, P: dict, mine: slice,
         expert_rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One FP8 layer (wire on or off) on this rank's rows ``x_in``: its output and gradients.
    ``expert_rows``: the rows dispatched to the experts instead of x_in (the router still sees
    x_in)."""
    rank, W = worker.transport.rank, worker.transport.world_size
    placement = Placement.native(case.num_experts, W)
    layer = MoELayer(replace(case.layer_spec(), fp8_wire=wire), worker.transport, placement, device=worker.device)
    with torch.no_grad():
        layer.router.copy_(P["router"])
        for slot, e in enumerate(placement.slot_experts()[rank].tolist()):
            if e >= 0:
                layer.load_expert(slot, P["w13"][e], P["w2"][e])
    x = x_in.detach().clone().to(worker.device).requires_grad_()
    with torch.no_grad():  # as decoding runs it: the transport may hand out its own outputs
        out_no_grad, _ = layer(x)
    if expert_rows is not None:
        rows = expert_rows.to(worker.device)
        layer._dispatch = lambda _x, routed: MoELayer._dispatch(layer, rows, routed)
    out, _ = layer(x)
    (out.float() * P["grad_out"][mine].to(worker.device)).sum().backward()
    router = layer.router.grad.detach().clone()
    if W > 1:
        dist.all_reduce(router)
    return {"out": out.detach(), "out_no_grad": out_no_grad, "grad_x": x.grad, "grad_router": router,
            "grad_w13": layer.w13.grad, "grad_w2": layer.w2.grad}


def dispatch_bytes(worker: Any, case: Case) -> dict[str, int]:
    """Bytes the transport's counter adds for one dispatch of this rank's rows in bf16 and one as
    FP8 rows on the wire (``pack_rows``), the same routing (every k to rank (token + k) % W, so
    every destination gets rows)."""
    t = worker.transport
    t.reserve(case.buffer_spec())
    P = make_problem(case, t.world_size)
    start = sum(P["counts"][: t.rank])
    x = P["x"][start: start + P["counts"][t.rank]].to(device=worker.device, dtype=torch.bfloat16)
    T, K = x.shape[0], case.top_k
    dest_rank = ((torch.arange(T)[:, None] + torch.arange(K)[None, :]) % t.world_size).to(torch.int32).to(x.device)
    dest_slot = torch.zeros(T, K, dtype=torch.int32, device=x.device)
    weight = torch.full((T, K), 1.0 / K, device=x.device)
    sizes = {}
    for name in ("bf16", "fp8"):
        before = t.dispatched_bytes
        if name == "bf16":
            dispatch(t, x, weight, dest_rank, dest_slot)
        else:
            dispatch_payload(t, x, pack_rows(x, default_ops(x.device).quantize_rows), weight, dest_rank, dest_slot)
        sizes[name] = t.dispatched_bytes - before
    return sizes


def fp8_wire_parity(worker: Any, case: Case) -> dict[str, float]:
    """Run on every rank (``group.execute(fp8_wire_parity, case)``, ``case.expert_precision`` fp8):
    relative errors of the wire layer against the FP8 layer without it ({name: error}), and
    against the layer without the wire whose experts get the wire's values (the router x):
    ``*_on_wire_values``."""
    if case.expert_precision != "fp8":
        raise ValueError(f"fp8_wire_parity needs a case with expert_precision fp8, got {case.expert_precision!r}")
    rank, W = worker.transport.rank, worker.transport.world_size
    worker.transport.reserve(case.buffer_spec())
    P = make_problem(case, W)
    start = sum(P["counts"][:rank])
    mine = slice(start, start + P["counts"][rank])
    x = P["x"][mine].to(device=worker.device, dtype=torch_dtype(case.dtype))
    # the values FP8 rows on the wire carry, quantised as the layer does on this device
    x_wire = dequantize_rows(*default_ops(x.device).quantize_rows(x)).to(x.dtype)
    on = _run(worker, case, True, x, P, mine)
    off = _run(worker, case, False, x, P, mine)
    off_wire = _run(worker, case, False, x, P, mine, expert_rows=x_wire)
    errors = {name: rel_err(on[name], off[name]) for name in ("out", "out_no_grad", "grad_x", "grad_router", "grad_w2")}
    errors["grad_w13_on_wire_values"] = rel_err(on["grad_w13"], off_wire["grad_w13"])
    errors["grad_w2_on_wire_values"] = rel_err(on["grad_w2"], off_wire["grad_w2"])
    errors["out_on_wire_values"] = rel_err(on["out"], off_wire["out"])
    return errors
