"""One local Ray cluster of two simulated nodes for the whole test run, and shared worker groups.

Two Ray nodes on one host (``ray.cluster_utils.Cluster``) make every group test a two-node
test: ranks are ordered by node, and STRICT_SPREAD groups span both nodes. Worker groups are
cached by (world size, strategy) and shared by the layer, transport and training tests (a
``Trainer`` takes an existing group); tests that kill or hang workers start their own.
"""

from __future__ import annotations

import pytest

CPUS_PER_NODE = 8  # logical CPUs (idle actors cost memory, not cores); actors ask for fractions


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node local Ray cluster; yields its address."""
    import ray
    from ray.cluster_utils import Cluster

    # Ray's per-node agent port is fixed by default (52365): give each node a free one, so other
    # Ray instances on this host keep theirs (a user's, a concurrent test run, and the README's
    # `ray start --head` of test_jobs.py, which may run beside this cluster).
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": CPUS_PER_NODE, "include_dashboard": False,
                        "dashboard_agent_listen_port": free_port()},
    )
    cluster.add_node(num_cpus=CPUS_PER_NODE, dashboard_agent_listen_port=free_port())
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def groups(ray_cluster):
    """groups(world_size, strategy="PACK") → a cached CPU WorkerGroup of that size (gloo transport).

    The suite asks for four: (1, PACK), (2, PACK), (2, STRICT_SPREAD) and (4, SPREAD) (the last
    two span both simulated nodes); all four stay up for the whole run.

    A test may train on it (``Trainer(config, group=groups(2))``) but must leave it healthy: tests
    that kill, hang or poison workers start their own group.
    """
    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup

    made: dict[tuple, WorkerGroup] = {}
    keep = 4  # live cached groups at most: the rest of the suite needs CPUs too

    def get(world_size: int, strategy: str = "PACK") -> WorkerGroup:
        key = (world_size, strategy)
        if key not in made:
            while len(made) >= keep:
                made.pop(next(iter(made))).close()
            cfg = Config.from_dict({
                "parallel": {"world_size": world_size, "device": "cpu", "cpu_per_worker": 0.5,
                             "placement_strategy": strategy, "startup_timeout_s": 240},
                "moe": {"num_experts": 8},
            })
            made[key] = WorkerGroup(cfg)
        else:
            made[key] = made.pop(key)  # most recently used last
        return made[key]

    yield get
    for g in made.values():
        g.close()


@pytest.fixture
def group_for_new(groups, monkeypatch):
    """group_for_new(world_size, strategy) → the cached group; code under test that starts a
    ``WorkerGroup`` of that world size (a benchmark's ``main``) gets this one instead, left open at
    its ``with`` block's end: the code path runs on a real group without paying ~4.5 s of CPU per
    new actor on the 2-core CI machine."""
    import contextlib

    import ray_moe.driver.group as group_module

    chosen: dict[int, object] = {}  # world size -> cached group (a test may ask for several sizes)

    def instead(cfg, **_kwargs):
        assert cfg.parallel.world_size in chosen, (cfg.parallel.world_size, sorted(chosen))
        return contextlib.nullcontext(chosen[cfg.parallel.world_size])

    def use(world_size: int, strategy: str = "PACK"):
        chosen[world_size] = groups(world_size, strategy)
        monkeypatch.setattr(group_module, "WorkerGroup", instead)
        return chosen[world_size]

    return use
