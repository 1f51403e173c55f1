"""The process groups of a rank mesh (:class:`~ray_moe.mesh.MeshSpec`): this rank's EP group (the
token exchange, clone rows) and DP group (the replicas' expert gradients, ZeRO over them).

``dist.new_group`` is collective over the whole world even for ranks outside the new group, so
every rank makes every EP group and every DP group, in the same order, and keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ray_moe.mesh import MeshSpec


@dataclass
class MeshGroups:
    """This rank's EP and DP process groups (None on a single rank, or without torch.distributed).

    Attributes:
        mesh: the group's mesh.
        rank: this rank (global).
        ep: the process group of ``mesh.peers(rank)``.
        dp: the process group of ``mesh.dp_group(mesh.ep_rank(rank))``.
    """

    mesh: MeshSpec
    rank: int
    ep: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None

    @classmethod
    def create(cls, mesh: MeshSpec, rank: int) -> "MeshGroups":
        """Every rank calls this with the same mesh (collective)."""
        if mesh.world == 1 or not dist.is_initialized():
            return cls(mesh, rank, None, None)
        ep = dp = None
        for ranks in mesh.ep_groups():
            g = dist.new_group(list(ranks))
            if rank in ranks:
                ep = g
        for ranks in mesh.dp_groups():
            g = dist.new_group(list(ranks))
            if rank in ranks:
                dp = g
        return cls(mesh, rank, ep, dp)

    def destroy(self) -> None:
        """Release this rank's groups (local; every rank calls it). Idempotent."""
        if dist.is_initialized():
            for g in (self.ep, self.dp):
                if g is not None:
                    dist.destroy_process_group(g)
        self.ep = self.dp = None
