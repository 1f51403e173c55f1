"""Rank assignment: by node (Ray node id, not IP), then GPU."""

from __future__ import annotations

from ray_moe.topology import RankInfo, WorkerInfo, assign_ranks, node_of_rank

IP = "10.0.0.7"


def w(node: str, gpus: tuple[int, ...] = (), pid: int = 0, ip: str = IP) -> WorkerInfo:
    return WorkerInfo(node_id=node, ip=ip, hostname="host", pid=pid, gpu_ids=gpus)


def test_assign_ranks_orders_by_node_then_gpu():
    workers = [
        w("node-b", (1,), pid=1),
        w("node-a", (3,), pid=2),
        w("node-b", (0,), pid=3),
        w("node-a", (2,), pid=4),
    ]
    ranks = assign_ranks(workers)
    assert len(ranks) == 4
    # result[i] describes workers[i]
    assert [r.pid for r in ranks] == [1, 2, 3, 4]
    assert [r.rank for r in ranks] == [3, 1, 2, 0]
    assert [r.node_rank for r in ranks] == [1, 0, 1, 0]
    assert [r.local_rank for r in ranks] == [1, 1, 0, 0]
    assert [r.gpu_id for r in ranks] == [1, 3, 0, 2]
    assert all(r.local_world_size == 2 and r.num_nodes == 2 and r.world_size == 4 for r in ranks)
    by_rank = sorted(ranks, key=lambda r: r.rank)
    assert [(r.node_id, r.gpu_id) for r in by_rank] == [
        ("node-a", 2), ("node-a", 3), ("node-b", 0), ("node-b", 1)]
    assert node_of_rank(ranks) == [0, 0, 1, 1]


def test_assign_ranks_uneven_nodes():
    workers = [w("n2", (0,)), w("n1", (0,)), w("n1", (1,)), w("n1", (2,)), w("n3", (5,))]
    ranks = sorted(assign_ranks(workers), key=lambda r: r.rank)
    assert [r.node_id for r in ranks] == ["n1", "n1", "n1", "n2", "n3"]
    assert [r.node_rank for r in ranks] == [0, 0, 0, 1, 2]
    assert [r.local_rank for r in ranks] == [0, 1, 2, 0, 0]
    assert [r.local_world_size for r in ranks] == [3, 3, 3, 1, 1]
    assert {r.num_nodes for r in ranks} == {3}
    assert [r.rank for r in ranks] == list(range(5))


def test_assign_ranks_cpu_workers_keep_input_order_within_a_node():
    workers = [w("y", pid=10), w("x", pid=11), w("y", pid=12), w("x", pid=13)]
    ranks = assign_ranks(workers)
    by_rank = sorted(ranks, key=lambda r: r.rank)
    assert [r.pid for r in by_rank] == [11, 13, 10, 12]
    assert all(r.gpu_id == -1 for r in ranks)
    assert [r.local_rank for r in by_rank] == [0, 1, 0, 1]


def test_assign_ranks_two_nodes_one_ip_are_distinct_nodes():
    # Two Ray nodes on one host: same IP and hostname, different node ids, both with GPU 0.
    workers = [w("ffff", (0,), pid=1), w("0000", (0,), pid=2)]
    ranks = assign_ranks(workers)
    assert ranks[0].ip == ranks[1].ip
    assert {r.num_nodes for r in ranks} == {2}
    assert (ranks[1].rank, ranks[1].node_rank, ranks[1].local_rank) == (0, 0, 0)
    assert (ranks[0].rank, ranks[0].node_rank, ranks[0].local_rank) == (1, 1, 0)
    assert all(r.local_world_size == 1 for r in ranks)


def test_assign_ranks_different_ips_same_node_id_is_one_node():
    ranks = assign_ranks([w("n", (0,), ip="1.1.1.1"), w("n", (1,), ip="2.2.2.2")])
    assert {r.num_nodes for r in ranks} == {1}
    assert [r.local_rank for r in ranks] == [0, 1]


def test_assign_ranks_single_and_empty():
    (only,) = assign_ranks([w("n", (4,))])
    assert only == RankInfo(rank=0, world_size=1, node_id="n", node_rank=0, num_nodes=1,
                            local_rank=0, local_world_size=1, ip=IP, hostname="host", pid=0,
                            gpu_id=4)
    assert only.to_dict()["gpu_id"] == 4
    assert assign_ranks([]) == []
