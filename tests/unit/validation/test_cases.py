"""The validation cases: routings honour their edge case; cases are checked and sized."""

from __future__ import annotations

import pytest
import torch

from ray_moe.validation import EDGE_CASES, Case
from ray_moe.validation.transport import make_routing


@pytest.mark.parametrize("extra", EDGE_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_routing_respects_the_edge_case(extra):
    case = Case(hidden=4).but(**extra)
    W, E = 2, case.num_experts
    routing = make_routing(case, W)
    ids = torch.cat([r["dest_rank"].long() * (E // W) + r["dest_slot"].long() for r in routing])
    if ids.numel():
        assert all(len(set(row)) == case.top_k for row in ids.tolist())  # distinct experts per token
    if case.routing == "empty_rank":
        assert not (ids // (E // W) == W - 1).any()
    if case.routing == "empty_expert":
        assert not (ids == 1).any()
    if case.routing == "one_expert":
        assert (ids[:, 0] == 0).all()


def test_case_rejects_an_unknown_routing_and_sizes_its_buffer():
    with pytest.raises(ValueError, match="routing 'sideways' is not one of"):
        Case(routing="sideways")
    spec = Case(hidden=64, tokens_per_rank=[3, 17], dtype="bfloat16", top_k=4).buffer_spec()
    assert (spec.max_tokens, spec.hidden, spec.elem_bytes, spec.max_top_k) == (17, 64, 2, 4)
    assert Case(tokens_per_rank=[0]).buffer_spec().max_tokens == 1
