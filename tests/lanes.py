"""How ``pytest -n 2`` (pytest-xdist) splits the suite: two lanes that share no Ray cluster.

Lane one is every test that uses the session's Ray cluster (``tests/cluster/conftest.py``): they
share that cluster and its cached worker groups, so they must run in one process, and they are
one scope. Everything else is scoped by module (so a module fixture, such as the README job of
``test_jobs.py``, runs once) and runs in the other process: the unit tests, the Triton-interpreter
scripts, and the cluster tests that start clusters of their own (the README's real
``ray start --head``, ``cluster/local_cluster.py``). The session cluster's head takes a free port,
so those clusters can come up beside it.

The two lanes are about even on the 2-core CI machine; a third worker would find no scope to take
while the session cluster's lane runs.

xdist's own ``--dist loadgroup`` cannot be used: it tags grouped tests by rewriting
``Item._nodeid``, which pytest 9 no longer reads. The scheduler here sees only node ids, so the
tests under ``tests/cluster/`` that do *not* use the session cluster are listed by name;
:func:`check_lane` fails a test (in its worker, where fixtures are known) if that list and its
fixtures disagree.
"""

from __future__ import annotations

from typing import Any

import pytest

SESSION_CLUSTER = "tests/cluster (the session's Ray cluster)"
CLUSTER_TESTS = "tests/cluster/"
OFF_SESSION_CLUSTER = (  # tests under tests/cluster that start clusters of their own, or need none
    "tests/cluster/test_data.py::test_bad_input_is_named_and_nothing_is_written",
    "tests/cluster/test_distributed_optimizer.py::test_sharded_state_at_three_ranks_equals_allreduce_adamw",
    "tests/cluster/test_jobs.py",
    "tests/cluster/test_smoke.py::test_smoke_names_a_broken_node",
    "tests/cluster/test_smoke.py::test_local_cluster_rejects_a_bad_env_node",
)


# modules that share a session fixture a test process starts on first use, scheduled as one scope
# so that only one test process starts it: the multi-PE runs (tests/conftest.py's multi_pe_run,
# ~110 s of CPU), started early by the first module and read by the second
SHARED_SCOPES = {"tests/unit/comm/test_nvshmem_kernels.py": "tests/unit/validation/test_multi_pe.py"}


def lane_scope(nodeid: str) -> str:
    """The scope a test is scheduled in: :data:`SESSION_CLUSTER`, or its module's path (or the
    module it shares a scope with, :data:`SHARED_SCOPES`)."""
    module = nodeid.split("::", 1)[0]
    module = SHARED_SCOPES.get(module, module)
    off = any(nodeid == name or nodeid.startswith((name + "::", name + "[")) for name in OFF_SESSION_CLUSTER)
    if module.startswith(CLUSTER_TESTS) and not off:
        return SESSION_CLUSTER
    return module


def check_lane(item: pytest.Item) -> None:
    """Fail ``item`` if its scope and its use of the ``ray_cluster`` fixture disagree."""
    uses = "ray_cluster" in getattr(item, "fixturenames", ())
    if uses != (lane_scope(item.nodeid) == SESSION_CLUSTER):
        pytest.fail(f"tests/lanes.py schedules {item.nodeid} in the wrong lane: it "
                    f"{'uses' if uses else 'does not use'} the session's ray_cluster"
                    f" ({'remove it from' if uses else 'list it in'} OFF_SESSION_CLUSTER)", pytrace=False)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with :func:`lane_scope` as the scope, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_scope(nodeid)

    config.option.loadscopereorder = False  # the session cluster's lane is collected first: it starts first
    return LaneScheduling(config, log)
