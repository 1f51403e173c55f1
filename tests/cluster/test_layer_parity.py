"""The expert-parallel layer over real worker groups equals the single-process oracle (fp32)."""

from __future__ import annotations

import pytest

from ray_moe.validation import Case
from ray_moe.validation.layer import layer_parity

TOL = 1e-5


def assert_parity(group, **case):
    results = group.execute(layer_parity, Case(**case), timeout=180)
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank} case {case}: relative errors above {TOL}: {bad}"
    return results


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parity_random_routing(groups, world_size):
    for seed in range(2):
        assert_parity(groups(world_size, "SPREAD" if world_size == 4 else "PACK"), seed=seed, tokens_per_rank=[16, 9, 23, 5])


@pytest.mark.parametrize(
    "case",
    [
        dict(routing="empty_rank"),
        dict(routing="empty_expert"),
        dict(routing="one_expert"),
        dict(top_k=1),
        dict(top_k=8),  # K = E
        dict(num_experts=2),  # one expert per rank
        dict(tokens_per_rank=[1]),  # T_local = 1
        dict(tokens_per_rank=[1, 40]),  # uneven token counts
        dict(routing="one_expert", top_k=1, tokens_per_rank=[3, 7]),  # every token to expert 0
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_parity_edge_cases(groups, case):
    assert_parity(groups(2), seed=11, **case)


def test_parity_edge_cases_w4(groups):
    for case in (dict(routing="empty_rank"), dict(num_experts=4, top_k=1), dict(tokens_per_rank=[2, 0, 5, 1])):
        assert_parity(groups(4, "SPREAD"), seed=3, **case)
