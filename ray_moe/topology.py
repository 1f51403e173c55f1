"""Ranks, nodes and local ranks of a worker group.

Nodes are keyed by Ray node id, not IP: two Ray nodes can run on one host (that is how two-node
behaviour is tested on one machine), and they share an IP.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WorkerInfo:
    """What an actor reports about itself before it has a rank."""

    node_id: str
    ip: str
    hostname: str
    pid: int
    gpu_ids: tuple[int, ...]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    node_id: str
    node_rank: int
    num_nodes: int
    local_rank: int
    local_world_size: int
    ip: str
    hostname: str
    pid: int
    gpu_id: int  # -1 on CPU

    def to_dict(self) -> dict:
        return asdict(self)


def assign_ranks(workers: list[WorkerInfo]) -> list[RankInfo]:
    """Rank order: by node (node id order), then GPU id, then the order the workers were given.

    Returns one RankInfo per input worker, in the input order (``result[i]`` is worker i's).
    """
    def gpu(w: WorkerInfo) -> int:
        return min(w.gpu_ids) if w.gpu_ids else -1

    order = sorted(range(len(workers)), key=lambda i: (workers[i].node_id, gpu(workers[i]), i))
    nodes = sorted({w.node_id for w in workers})
    local_sizes = {n: sum(w.node_id == n for w in workers) for n in nodes}
    infos: list[RankInfo | None] = [None] * len(workers)
    local_seen: dict[str, int] = {}
    for rank, i in enumerate(order):
        w = workers[i]
        local = local_seen.get(w.node_id, 0)
        local_seen[w.node_id] = local + 1
        infos[i] = RankInfo(
            rank=rank,
            world_size=len(workers),
            node_id=w.node_id,
            node_rank=nodes.index(w.node_id),
            num_nodes=len(nodes),
            local_rank=local,
            local_world_size=local_sizes[w.node_id],
            ip=w.ip,
            hostname=w.hostname,
            pid=w.pid,
            gpu_id=gpu(w),
        )
    return [i for i in infos if i is not None]


def node_of_rank(ranks: list[RankInfo]) -> list[int]:
    """node_rank of every rank, indexed by rank."""
    return [r.node_rank for r in sorted(ranks, key=lambda r: r.rank)]
