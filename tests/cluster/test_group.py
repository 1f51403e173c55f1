"""Worker group: real groups on the session's two-node Ray cluster (two Ray nodes on one host, so
they share an IP): topology, typed calls, execute, placement failures, clean-up."""

from __future__ import annotations

import os
import sys
import time

import pytest
from ray import cloudpickle  # the cloudpickle Ray serialises with

from ray_moe.config import Config
from ray_moe.worker.actor import EPWorker

# Functions sent with group.execute travel by value (workers cannot import this test module).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

def where(worker, tag=None, *, scale=1):
    """Runs on a worker: what it knows about itself and where it actually is."""
    import ray
    import torch.distributed as dist

    return {
        "rank": worker.rank_info.rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "tag": tag,
        "scaled": worker.rank_info.rank * scale,
    }


def all_reduce_ranks(worker):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(worker.rank_info.rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


def fail_on_rank(worker, bad_rank):
    if worker.rank_info.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return worker.rank_info.rank


def cfg_for(world_size: int, **parallel) -> Config:
    # 240 s as conftest's groups: actors start slowly beside the interpreter runs on two cores (one CI
    # run under a load average near 10 took more than 120 s, 2026-11-26)
    p = {"world_size": world_size, "device": "cpu", "cpu_per_worker": 0.5, "startup_timeout_s": 240}
    p.update(parallel)
    # num_experts and batch_size must be multiples of world_size
    return Config.from_dict({"parallel": p, "moe": {"num_experts": 2 * world_size, "top_k": 1},
                             "train": {"batch_size": 2 * world_size}})


def cluster_nodes():
    import ray

    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}


def live_pg_ids() -> set[str]:
    from ray.util import placement_group_table

    return {pid for pid, pg in placement_group_table().items() if pg["state"] != "REMOVED"}


def wait_for(pred, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def available_cpu() -> float:
    import ray

    return ray.available_resources().get("CPU", 0.0)


def test_strict_spread_two_ranks_on_two_nodes_same_ip(groups):
    g = groups(2, "STRICT_SPREAD")
    ranks = g.ranks
    nodes = cluster_nodes()
    assert len(nodes) == 2
    assert [r.rank for r in ranks] == [0, 1]
    assert len({r.node_id for r in ranks}) == 2
    assert {r.node_id for r in ranks} == set(nodes)
    assert ranks[0].ip == ranks[1].ip  # two Ray nodes on one host
    assert [r.node_rank for r in ranks] == [0, 1]
    assert [r.local_rank for r in ranks] == [0, 0]
    assert [r.local_world_size for r in ranks] == [1, 1]
    assert [r.num_nodes for r in ranks] == [2, 2] and g.num_nodes == 2
    assert ranks[0].node_id < ranks[1].node_id  # node_rank follows node id order
    assert all(r.gpu_id == -1 and r.world_size == 2 for r in ranks)
    assert g.transport_name == "gloo"
    # What the driver recorded is where the actors really run.
    seen = g.execute(where)
    assert [s["node_id"] for s in seen] == [r.node_id for r in ranks]
    assert [s["pid"] for s in seen] == [r.pid for r in ranks]


def test_ping_and_execute_in_rank_order(groups):
    g = groups(2, "STRICT_SPREAD")
    assert g.call(EPWorker.ping) == [0, 1]
    out = g.execute(where, "t", scale=3)
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["dist_rank"] for o in out] == [0, 1]  # rendezvous gave torch.distributed the same ranks
    assert {o["dist_world"] for o in out} == {2}
    assert {o["tag"] for o in out} == {"t"}
    assert [o["scaled"] for o in out] == [0, 3]
    assert len({o["pid"] for o in out}) == 2
    # a collective across the two nodes works (gloo rendezvous through rank 0's TCP store)
    assert g.execute(all_reduce_ranks) == [3.0, 3.0]
    g.health_check(timeout=30)


def test_execute_error_names_rank_and_group_survives(groups):
    from ray_moe.driver.group import WorkerFailure

    g = groups(2, "STRICT_SPREAD")
    with pytest.raises(WorkerFailure) as info:
        g.execute(fail_on_rank, 1, timeout=60)
    assert info.value.rank == 1 and info.value.cause == "error"
    assert "rank 1" in str(info.value) and "deliberate failure on rank 1" in str(info.value)
    assert g.call(EPWorker.ping) == [0, 1]


def test_execute_on_one_rank_returns_its_result_and_names_its_failure(groups):
    from ray_moe.driver.group import WorkerFailure

    g = groups(2, "STRICT_SPREAD")
    assert g.execute_on(1, where, "one", scale=2)["scaled"] == 2
    assert g.execute_on(0, where, "zero")["rank"] == 0
    with pytest.raises(WorkerFailure) as info:
        g.execute_on(1, fail_on_rank, 1, timeout=60)
    assert info.value.rank == 1 and info.value.cause == "error" and "rank 1" in str(info.value)
    with pytest.raises(ValueError, match="rank 2 is not in this group of 2"):
        g.execute_on(2, where, "x")
    assert g.call(EPWorker.ping) == [0, 1]


def test_calls_take_worker_methods_by_reference_only(groups):
    g = groups(2, "STRICT_SPREAD")
    assert g.call_each(EPWorker.ping, [(), ()]) == [0, 1]
    for bad in ("ping", where, print):
        with pytest.raises(TypeError, match="not a method of EPWorker"):
            g.call(bad)  # refused on the driver: nothing reaches a worker
    with pytest.raises(ValueError, match="arguments for 1 ranks"):
        g.call_each(EPWorker.ping, [()])
    assert g.call(EPWorker.ping) == [0, 1]


def test_four_ranks_ordered_by_node(groups):
    g = groups(4, "SPREAD")
    ranks = g.ranks
    assert [r.rank for r in ranks] == [0, 1, 2, 3]
    assert g.num_nodes == 2  # SPREAD on an idle two-node cluster uses both nodes
    node_ids = [r.node_id for r in ranks]
    assert node_ids == sorted(node_ids)  # ranks follow node id order
    assert [r.node_rank for r in ranks] == sorted(r.node_rank for r in ranks)
    assert {r.node_rank for r in ranks} == {0, 1}
    for node in set(node_ids):
        local = [r for r in ranks if r.node_id == node]
        assert [r.local_rank for r in local] == list(range(len(local)))
        assert {r.local_world_size for r in local} == {len(local)}
    assert len({r.ip for r in ranks}) == 1
    assert g.call(EPWorker.ping) == [0, 1, 2, 3]
    seen = g.execute(where)
    assert [s["node_id"] for s in seen] == node_ids
    assert [s["dist_rank"] for s in seen] == [0, 1, 2, 3]
    assert g.execute(all_reduce_ranks) == [10.0] * 4


# ------------------------------------------------------------------------ placement failures
def test_world_size_beyond_cluster_cpus_fails_fast(ray_cluster):
    from ray_moe.driver.group import GroupError, WorkerGroup

    total = cluster_cpus = sum(n["Resources"].get("CPU", 0) for n in cluster_nodes().values())
    world = 64
    assert world * 0.5 > total
    before = live_pg_ids()
    t0 = time.monotonic()
    with pytest.raises(GroupError) as info:
        WorkerGroup(cfg_for(world, startup_timeout_s=60))
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 10, f"took {elapsed:.1f}s; should fail before waiting for placement"
    assert "CPU" in msg and f"parallel.world_size={world}" in msg
    assert f"{world * 0.5:g} CPU" in msg and f"{cluster_cpus:g} CPU" in msg
    assert live_pg_ids() == before  # nothing left behind


def test_gpu_request_on_cpu_cluster_fails_fast(ray_cluster):
    from ray_moe.driver.group import GroupError, WorkerGroup

    before = live_pg_ids()
    t0 = time.monotonic()
    with pytest.raises(GroupError) as info:
        WorkerGroup(cfg_for(2, device="cuda", startup_timeout_s=60))
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 10, f"took {elapsed:.1f}s; should fail before waiting for placement"
    assert "GPU" in msg and "0 GPU" in msg and "2 GPU" in msg
    assert live_pg_ids() == before


def test_unplaceable_strict_spread_times_out_clearly(ray_cluster):
    from ray_moe.driver.group import GroupError, WorkerGroup

    cpu0 = available_cpu()
    before = live_pg_ids()
    timeout = 3.0
    t0 = time.monotonic()
    # 3 bundles, each on its own node, on a 2-node cluster: fits the totals, can never be placed.
    with pytest.raises(GroupError) as info:
        WorkerGroup(cfg_for(3, placement_strategy="STRICT_SPREAD", startup_timeout_s=timeout))
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < timeout + 10, f"took {elapsed:.1f}s with startup_timeout_s={timeout}"
    assert "STRICT_SPREAD" in msg and "parallel.startup_timeout_s=3" in msg
    assert "not placed" in msg and "2 node(s)" in msg
    # the pending placement group was removed and nothing is held
    wait_for(lambda: live_pg_ids() == before, what="the pending placement group to be removed")
    wait_for(lambda: available_cpu() == cpu0, what="CPUs to be available again")


def test_bundle_bigger_than_any_node_times_out_clearly(ray_cluster):
    from ray_moe.driver.group import GroupError, WorkerGroup

    per_node = max(n["Resources"].get("CPU", 0) for n in cluster_nodes().values())
    before = live_pg_ids()
    cpus = per_node + 1  # less than the cluster total, more than any one node has
    t0 = time.monotonic()
    with pytest.raises(GroupError) as info:
        WorkerGroup(cfg_for(1, cpu_per_worker=cpus, startup_timeout_s=2))
    elapsed = time.monotonic() - t0
    assert elapsed < 12
    assert "not placed within parallel.startup_timeout_s=2" in str(info.value)
    assert "CPU" in str(info.value)
    wait_for(lambda: live_pg_ids() == before, what="the pending placement group to be removed")


def test_close_removes_placement_group(ray_cluster):
    from ray_moe.driver.group import WorkerGroup

    cpu0 = available_cpu()
    before = live_pg_ids()
    g = WorkerGroup(cfg_for(2, placement_strategy="STRICT_SPREAD"))
    try:
        assert g.call(EPWorker.ping) == [0, 1]
        mine = live_pg_ids() - before
        assert len(mine) == 1
        wait_for(lambda: available_cpu() <= cpu0 - 1.0, what="the group's CPUs to be reserved")
    finally:
        g.close()
    assert g.actors == []
    wait_for(lambda: not (live_pg_ids() & mine), what="the placement group to be removed")
    wait_for(lambda: available_cpu() == cpu0, what="CPUs to be available again")
    g.close()  # idempotent


def test_context_manager_closes(ray_cluster):
    from ray_moe.driver.group import WorkerGroup

    cpu0 = available_cpu()
    before = live_pg_ids()
    with WorkerGroup(cfg_for(1)) as g:
        assert g.call(EPWorker.ping) == [0]
        assert g.ranks[0].num_nodes == 1 and g.ranks[0].local_world_size == 1
        mine = live_pg_ids() - before
    wait_for(lambda: not (live_pg_ids() & mine), what="the placement group to be removed")
    wait_for(lambda: available_cpu() == cpu0, what="CPUs to be available again")


def test_an_address_of_another_cluster_is_refused_while_attached(ray_cluster):
    """A process attached to one cluster that is asked for another (a notebook's second Trainer)
    gets one line, not a run on the cluster it happens to be attached to."""
    from ray_moe.connect import ConnectError, connect

    assert connect(ray_cluster) is False and connect("auto") is False and connect() is False
    with pytest.raises(ConnectError, match=r"--address '127.0.0.1:9': this process is attached to the Ray cluster at"):
        connect("127.0.0.1:9")
