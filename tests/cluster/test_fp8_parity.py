"""The EP layer with FP8 experts (``moe.expert_precision: fp8``, the CPU path emulating the FP8
numerics) against the single-process float32 oracle at W=2 and W=4 (across two simulated nodes)
over gloo: every output and gradient within FP8's error, the outputs and input gradients clearly
off float32's (so FP8 really ran), the load statistics exact, experts without tokens with exactly
zero gradients (a rank may get no tokens for its experts: that must not stop it)."""

from __future__ import annotations

import pytest

from ray_moe.validation import Case
from ray_moe.validation.layer import layer_parity

FP8_TOL = 0.1  # E4M3 keeps 3 mantissa bits: ~3.6 % RMS per rounded operand, several per GEMM chain
# the router's gradient is Σ_k softmax'·<a, G>: a difference of nearly equal FP8 terms (10.2 % seen at W=2)
ROUTER_TOL = 0.25
EXACT = ("expert_tokens", "received_pairs", "unrouted_expert_grad")


@pytest.mark.parametrize("world_size", [2, 4])  # W=1: tests/unit/kernels/test_fp8.py
def test_fp8_layer_parity(groups, world_size):
    group = groups(2) if world_size == 2 else groups(4, "SPREAD")  # the suite's cached groups
    for seed, routing, top_k in ((0, "random", 2), (1, "empty_expert", 2)):
        case = Case(seed=seed, routing=routing, top_k=top_k, hidden=64, expert_hidden=128, num_experts=4,
                    tokens_per_rank=(16, 9, 23, 5), expert_precision="fp8")
        for rank, errs in enumerate(group.execute(layer_parity, case, timeout=180)):
            for name in EXACT:
                assert errs.pop(name, 0.0) == 0.0, (rank, name)
            if routing != "random":
                errs.pop("grad_router")  # a saturated router's gradient is round-off (layer_parity's floor)
            # (a rank whose experts got no tokens has exactly zero expert gradients on both sides: error 0)
            low = {"out": 1e-3, "out_no_grad": 1e-3, "grad_x": 1e-3}
            bad = {k: v for k, v in errs.items()
                   if not low.get(k, -1.0) < v < (ROUTER_TOL if k == "grad_router" else FP8_TOL)}
            assert not bad, f"rank {rank} {routing}: errors outside their bounds: {bad}"


WIRE_ROUND_OFF = 1e-5


@pytest.mark.parametrize("world_size", [2, 3])  # W=1: tests/unit/model/test_fp8_wire.py
def test_fp8_wire_equals_the_fp8_layer_over_gloo(groups, world_size):
    """FP8 rows on the wire (the dispatch sends E4M3 rows and their scales) against the FP8 layer
    without it, within float32 round-off on every rank (tests.fp8_wire), and the
    bytes the gloo dispatch moves: (H + 4·H/128) / (2·H) of bf16's."""
    from tests.fp8_wire import dispatch_bytes, fp8_wire_parity

    case = Case(seed=2, routing="random", top_k=2, hidden=128, expert_hidden=128, num_experts=6,
                tokens_per_rank=(11, 6, 9), expert_precision="fp8")
    group = groups(world_size)
    for rank, errs in enumerate(group.execute(fp8_wire_parity, case, timeout=180)):
        assert errs and all(v <= WIRE_ROUND_OFF for v in errs.values()), (rank, errs)
    H = case.hidden
    for rank, sizes in enumerate(group.execute(dispatch_bytes, case, timeout=60)):
        # every row goes to top_k = 2 distinct ranks (rank-dedup: one copy each)
        assert sizes["bf16"] == case.tokens(rank) * 2 * 2 * H, (rank, sizes)
        assert sizes["fp8"] * (2 * H) == sizes["bf16"] * (H + 4 * H // 128), (rank, sizes)
