"""Test fixtures: one local Ray cluster of two simulated nodes for the whole session.

Two Ray nodes on one host (``ray.cluster_utils.Cluster``) make every group test a two-node
test: ranks are ordered by node, and STRICT_SPREAD groups span both nodes.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway cluster owned by this test session
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

CPUS_PER_NODE = 8  # logical CPUs (idle actors cost memory, not cores); actors ask for fractions


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node local Ray cluster; yields its address."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": CPUS_PER_NODE, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=CPUS_PER_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def groups(ray_cluster):
    """groups(world_size) → a cached CPU WorkerGroup of that size (gloo transport)."""
    from ray_moe.config import Config
    from ray_moe.group import WorkerGroup

    made: dict[tuple, WorkerGroup] = {}
    keep = 2  # live cached groups at most: the rest of the suite needs CPUs too

    def get(world_size: int, strategy: str = "PACK") -> WorkerGroup:
        key = (world_size, strategy)
        if key not in made:
            while len(made) >= keep:
                made.pop(next(iter(made))).close()
            cfg = Config.from_dict({
                "parallel": {"world_size": world_size, "device": "cpu", "cpu_per_worker": 0.5,
                             "placement_strategy": strategy, "startup_timeout_s": 120},
                "moe": {"num_experts": 8},
            })
            made[key] = WorkerGroup(cfg)
        return made[key]

    yield get
    for g in made.values():
        g.close()


def pytest_collection_finish(session):
    """Functions defined in test modules travel to workers by value (workers can't import tests)."""
    import ray.cloudpickle as cloudpickle

    for module in {getattr(item, "module", None) for item in session.items} - {None}:
        cloudpickle.register_pickle_by_value(module)
