"""Logical ↔ physical expert maps: native experts, clone slots, versioned placements (pure torch).

Physical layout: every rank has ``slots_per_rank = E/W + clone_slots`` expert slots. Slots
``0 .. E/W-1`` hold the rank's *native* experts (logical expert ``e`` lives on rank ``e // (E/W)``
at slot ``e % (E/W)`` and that rank owns its weights and optimizer state). Slots from ``E/W`` on
hold *clones*: copies of other ranks' experts that take a share of their tokens.

A token routed to logical expert ``e`` from source rank ``s`` picks one replica of ``e``: replica
``r`` with probability ``share[s, e, r]``. The pick is a deterministic hash of (token index,
expert), evaluated on the device, so no host sync is needed and every run picks the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Replica:
    """One physical copy of a logical expert: slot ``slot`` of rank ``rank``."""

    rank: int
    slot: int


@dataclass(frozen=True)
class ExpertShard:
    """Marks a parameter as sharded by expert (expert parallel), set by the layer that owns it.

    Dim 0 of the parameter indexes the rank's slots; slots ``[0, len(native_experts))`` hold the
    rank's native experts (the logical ids listed, which it owns: weights, gradients, optimizer
    state), the remaining slots hold clones (copies, never checkpointed or stepped on their own).
    Everything without this mark is replicated (data parallel).
    """

    native_experts: tuple[int, ...]


def expert_shard(param: torch.Tensor) -> ExpertShard | None:
    """The :class:`ExpertShard` of a parameter, or None for a replicated one."""
    return getattr(param, "expert_shard", None)


@dataclass
class Placement:
    """Where every logical expert lives, and how each source rank splits its tokens among replicas.

    Attributes:
        num_experts: E, logical experts per layer.
        world_size: W.
        clone_slots: extra slots per rank for clones.
        replicas: for each logical expert, its replicas; replica 0 is always the native owner.
        shares: float64 tensor [W, E, R_max]: for source rank s, the fraction of its tokens for
            expert e that go to replica r (rows sum to 1 over the valid replicas).
        version: increases by one with every new placement; all ranks must hold the same one.
    """

    num_experts: int
    world_size: int
    clone_slots: int = 0
    replicas: list[list[Replica]] = field(default_factory=list)
    shares: torch.Tensor | None = None
    version: int = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def native(cls, num_experts: int, world_size: int, clone_slots: int = 0) -> "Placement":
        """Every expert on its owner only (no clones)."""
        if num_experts % world_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by world_size={world_size}"
            )
        n = num_experts // world_size
        replicas = [[Replica(e // n, e % n)] for e in range(num_experts)]
        shares = torch.ones(world_size, num_experts, 1, dtype=torch.float64)
        return cls(num_experts, world_size, clone_slots, replicas, shares, version=0)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def slots_per_rank(self) -> int:
        return self.experts_per_rank + self.clone_slots

    @property
    def max_replicas(self) -> int:
        return max(len(r) for r in self.replicas)

    def owner(self, expert: int) -> int:
        return expert // self.experts_per_rank

    # ------------------------------------------------------------------ views
    def slot_experts(self) -> torch.Tensor:
        """int64 [W, slots_per_rank]: the logical expert held by each physical slot (-1 = empty)."""
        table = torch.full((self.world_size, self.slots_per_rank), -1, dtype=torch.int64)
        for e, reps in enumerate(self.replicas):
            for rep in reps:
                table[rep.rank, rep.slot] = e
        return table

    def clones(self) -> list[tuple[int, Replica]]:
        """(logical expert, replica) for every clone (non-native replica)."""
        return [(e, rep) for e, reps in enumerate(self.replicas) for rep in reps[1:]]

    def tables(self, device: torch.device | str = "cpu") -> "PlacementTables":
        """Dense device tensors used by :meth:`PlacementTables.route` on the hot path."""
        R = self.max_replicas
        rank = torch.full((self.num_experts, R), -1, dtype=torch.int32)
        slot = torch.full((self.num_experts, R), -1, dtype=torch.int32)
        for e, reps in enumerate(self.replicas):
            for r, rep in enumerate(reps):
                rank[e, r] = rep.rank
                slot[e, r] = rep.slot
        assert self.shares is not None
        shares = self.shares[:, :, :R].clone()
        cdf = shares.cumsum(-1)
        # Guard against rounding: the last valid replica always closes the interval.
        valid = (rank >= 0).unsqueeze(0).expand_as(cdf)
        cdf = torch.where(valid, cdf, torch.full_like(cdf, 2.0))
        last = (rank >= 0).sum(-1) - 1  # [E]
        cdf.scatter_(2, last.view(1, -1, 1).expand(self.world_size, -1, 1), 2.0)
        return PlacementTables(
            rank=rank.to(device),
            slot=slot.to(device),
            cdf=cdf.to(torch.float32).to(device),
            version=self.version,
        )

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError if the placement is inconsistent (a slot used twice, a bad share...)."""
        W, E, n = self.world_size, self.num_experts, self.experts_per_rank
        if len(self.replicas) != E:
            raise ValueError(f"placement has {len(self.replicas)} expert entries, expected {E}")
        used: dict[tuple[int, int], int] = {}
        for e, reps in enumerate(self.replicas):
            if not reps:
                raise ValueError(f"expert {e} has no replica")
            if reps[0] != Replica(e // n, e % n):
                raise ValueError(f"expert {e}: replica 0 must be its native slot {(e // n, e % n)}")
            for rep in reps:
                if not (0 <= rep.rank < W and 0 <= rep.slot < self.slots_per_rank):
                    raise ValueError(f"expert {e}: replica {rep} is outside {W} ranks x "
                                     f"{self.slots_per_rank} slots")
                if rep.slot < n and rep != reps[0]:
                    raise ValueError(f"expert {e}: clone {rep} sits in a native slot")
                if (rep.rank, rep.slot) in used:
                    raise ValueError(f"slot {(rep.rank, rep.slot)} holds experts "
                                     f"{used[(rep.rank, rep.slot)]} and {e}")
                used[(rep.rank, rep.slot)] = e
        assert self.shares is not None
        if self.shares.shape[:2] != (W, E) or self.shares.shape[2] < self.max_replicas:
            raise ValueError(f"shares has shape {tuple(self.shares.shape)}, expected "
                             f"({W}, {E}, >= {self.max_replicas})")
        for e, reps in enumerate(self.replicas):
            s = self.shares[:, e, : len(reps)]
            if (s < -1e-9).any() or ((s.sum(-1) - 1).abs() > 1e-6).any():
                raise ValueError(f"expert {e}: shares {s.tolist()} must be >= 0 and sum to 1")
            if (self.shares[:, e, len(reps):].abs() > 0).any():
                raise ValueError(f"expert {e}: shares beyond its {len(reps)} replicas must be 0")

    def to_dict(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "world_size": self.world_size,
            "clone_slots": self.clone_slots,
            "version": self.version,
            "replicas": [[(r.rank, r.slot) for r in reps] for reps in self.replicas],
            "shares": self.shares.tolist() if self.shares is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        p = cls(
            num_experts=d["num_experts"],
            world_size=d["world_size"],
            clone_slots=d["clone_slots"],
            replicas=[[Replica(*r) for r in reps] for reps in d["replicas"]],
            shares=torch.tensor(d["shares"], dtype=torch.float64),
            version=d["version"],
        )
        p.validate()
        return p


@dataclass
class PlacementTables:
    """Device tensors of a placement. rank/slot: int32 [E, R]; cdf: float32 [W, E, R]."""

    rank: torch.Tensor
    slot: torch.Tensor
    cdf: torch.Tensor
    version: int

    def route(
        self, expert_ids: torch.Tensor, src_rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Map logical expert ids to physical (rank, slot), picking a replica per (token, k).

        Args:
            expert_ids: int [T, K] logical expert ids of this rank's tokens.
            src_rank: this rank (selects the row of share cdfs).
        Returns:
            dest_rank, dest_slot: int32 [T, K]. Sync-free: pure indexing on ``expert_ids``'s device.
        """
        T, K = expert_ids.shape
        ids = expert_ids.long()
        if self.rank.shape[1] == 1:  # no clones: a plain gather
            return self.rank[ids, 0], self.slot[ids, 0]
        tok = torch.arange(T, device=ids.device, dtype=torch.int64).view(T, 1)
        u = _uniform_hash(tok, ids)  # [T, K] in [0, 1)
        cdf = self.cdf[src_rank][ids]  # [T, K, R]
        r = (cdf <= u.unsqueeze(-1)).sum(-1).clamp_max(self.rank.shape[1] - 1)  # [T, K]
        return self.rank[ids, r], self.slot[ids, r]


def _uniform_hash(token: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """A deterministic, well-mixed float32 in [0, 1) per (token, expert); int64 in, same shape out."""
    x = (token * 0x9E3779B1 + expert * 0x85EBCA77 + 0x27D4EB2F) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    x = ((x ^ (x >> 12)) * 0x297A2D39) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))
