"""Transport validators on CPU groups (gloo)."""

from __future__ import annotations

from ray_moe.validation import Case
from ray_moe.validation.transport import check_combine, check_dispatch
from tests.support import run_all


def test_validators_pass_on_gloo_w2(groups):
    assert run_all(groups(2)) == []


def test_validators_pass_on_gloo_w4(groups):
    group = groups(4, "SPREAD")
    for extra in (dict(routing="empty_rank"), dict(tokens_per_rank=[2, 0, 5, 1], top_k=3)):
        for fn in (check_dispatch, check_combine):
            for res in group.execute(fn, Case(**extra), timeout=120):
                assert all(v <= 1e-6 for v in res["errors"].values()), res


def test_validator_catches_a_broken_transport(groups):
    """A transport that drops a row must fail check_dispatch (the validator is not vacuous)."""

    def broken(worker, case):
        real = worker.transport.dispatch_forward

        def drop_one(*args, **kwargs):
            rx, rs, rw, layout = real(*args, **kwargs)
            rs = rs.clone()
            if rs.shape[0]:
                rs[0] = -1
            return rx, rs, rw, layout

        worker.transport.dispatch_forward = drop_one
        try:
            return check_dispatch(worker, case)
        finally:
            del worker.transport.dispatch_forward

    res = groups(2).execute(broken, Case(tokens_per_rank=[8]), timeout=120)
    assert any(r["errors"]["rows"] == float("inf") for r in res)


