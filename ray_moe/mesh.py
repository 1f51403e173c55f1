"""The rank mesh: W = EP × DP, expert parallelism inside a group of consecutive ranks, data
parallelism across the groups.

Rank r (in the group's node-then-GPU order, :func:`ray_moe.topology.assign_ranks`) is EP rank
``r % EP`` of EP group ``r // EP`` (its DP rank). An EP group holds every expert once (E/EP per
rank, plus clone slots); the DP replicas of an EP rank (``ep_rank, ep_rank + EP, ...``) hold the
same experts and average their gradients. Token rows move only inside an EP group.

``parallel.expert_parallel``: 0 (``auto``) is the ranks of one node when the world spans several
nodes on GPUs (every exchange inside a node), else the whole world (today's layout: one node, or
any CPU group); N > 0 is N. The driver resolves it once into a frozen :class:`MeshSpec`
(:func:`resolve_mesh`) before any worker starts and hands it to every worker.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = 0  # parallel.expert_parallel: the ranks of one node (several GPU nodes), else the world


class MeshError(ValueError):
    """A mesh that cannot be built; the message is one line naming what is wrong and what is allowed."""


@dataclass(frozen=True)
class MeshSpec:
    """W = ``ep`` × ``dp`` ranks; rank r is (dp_rank r // ep, ep_rank r % ep).

    Attributes:
        world: W, the group's ranks.
        ep: EP, ranks of one expert-parallel group (consecutive ranks).
        dp: DP, the replicas of each EP group (W / EP).
    """

    world: int
    ep: int
    dp: int

    def __post_init__(self) -> None:
        if self.ep < 1 or self.dp < 1 or self.ep * self.dp != self.world:
            raise MeshError(f"a mesh of {self.world} ranks cannot be EP {self.ep} x DP {self.dp}")

    @classmethod
    def whole(cls, world: int) -> "MeshSpec":
        """Expert parallelism over the whole world (DP 1): the layout before the mesh."""
        return cls(world, world, 1)

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, ep_rank) of global ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world}")
        return rank // self.ep, rank % self.ep

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def dp_rank(self, rank: int) -> int:
        return rank // self.ep

    def ep_group(self, dp_rank: int) -> tuple[int, ...]:
        """Global ranks of EP group ``dp_rank`` (consecutive), in EP-rank order."""
        return tuple(range(dp_rank * self.ep, (dp_rank + 1) * self.ep))

    def dp_group(self, ep_rank: int) -> tuple[int, ...]:
        """Global ranks holding EP rank ``ep_rank``'s experts, in DP-rank order (the replicas)."""
        return tuple(ep_rank + d * self.ep for d in range(self.dp))

    def ep_groups(self) -> list[tuple[int, ...]]:
        return [self.ep_group(d) for d in range(self.dp)]

    def dp_groups(self) -> list[tuple[int, ...]]:
        return [self.dp_group(e) for e in range(self.ep)]

    def peers(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` exchanges token rows with: its EP group (itself included)."""
        return self.ep_group(self.dp_rank(rank))

    def to_dict(self) -> dict[str, int]:
        return {"world": self.world, "ep": self.ep, "dp": self.dp}

    def __str__(self) -> str:
        return f"EP {self.ep} x DP {self.dp}"


def mesh_error(world: int, expert_parallel: int, num_experts: int | None) -> str | None:
    """Why ``parallel.expert_parallel`` cannot split ``world`` ranks (None: it can), without
    knowing the nodes: N must divide the world and the experts. ``auto`` (0) is checked as the
    whole world (on several nodes it becomes a divisor of the world, which E/W experts per rank
    make a divisor of E too)."""
    ep = world if expert_parallel == AUTO else expert_parallel
    if expert_parallel < 0:
        return f"parallel.expert_parallel={expert_parallel} must be >= 0 (0: auto, the ranks of one node)"
    if world % ep:
        return (f"parallel.expert_parallel={expert_parallel} does not divide the world of {world} ranks; "
                "choose a divisor of it (0: auto)")
    if num_experts is not None and num_experts % ep:
        return (f"moe.num_experts={num_experts} is not divisible by parallel.expert_parallel={ep}; "
                "choose an EP degree that divides the experts")
    return None


def resolve_mesh(node_of_rank: list[int] | tuple[int, ...], expert_parallel: int, use_gpu: bool,
                 num_experts: int | None = None) -> MeshSpec:
    """The mesh of a group whose rank r runs on node ``node_of_rank[r]`` (ranks in node order).

    ``auto`` (0): on GPUs over several nodes, the ranks of one node (every node must hold the same
    number); otherwise the world. An EP group either lies inside one node or is made of whole
    nodes (a group asked to span several nodes, e.g. whole-world EP, stays allowed); one that
    straddles a node boundary is refused. Raises :class:`MeshError` with one line."""
    world = len(node_of_rank)
    if list(node_of_rank) != sorted(node_of_rank):
        raise MeshError("ranks are not in node order; the mesh needs consecutive ranks per node")
    counts: dict[int, int] = {}
    for n in node_of_rank:
        counts[n] = counts.get(n, 0) + 1
    ep = expert_parallel
    if ep == AUTO:
        if use_gpu and len(counts) > 1:
            sizes = sorted(set(counts.values()))
            if len(sizes) > 1:
                raise MeshError(f"parallel.expert_parallel=0 (auto) takes the ranks of one node, but the nodes hold "
                                f"{', '.join(str(counts[n]) for n in sorted(counts))} ranks; set "
                                "parallel.expert_parallel to a divisor of the world")
            ep = sizes[0]
        else:
            ep = world
    error = mesh_error(world, ep, num_experts)
    if error:
        raise MeshError(error if expert_parallel != AUTO else f"{error} (parallel.expert_parallel=0 chose {ep})")
    mesh = MeshSpec(world, ep, world // ep)
    for group in mesh.ep_groups():
        nodes = sorted({node_of_rank[r] for r in group})
        whole_nodes = sum(counts[n] for n in nodes) == len(group)
        if len(nodes) > 1 and not whole_nodes:
            raise MeshError(
                f"parallel.expert_parallel={mesh.ep} puts EP group {group[0]}..{group[-1]} across nodes "
                f"{nodes} without holding them whole (ranks per node: "
                f"{', '.join(str(counts[n]) for n in sorted(counts))}); choose a divisor of the ranks per node "
                "or a multiple of them")
    return mesh
