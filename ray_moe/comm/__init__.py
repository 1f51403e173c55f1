"""Transports: how token rows move between the ranks of an expert-parallel group.

``choose_transport`` resolves ``parallel.transport: auto``; ``make_transport`` builds one on a
worker after torch.distributed is initialised, from the rank's place in the group and an
explicit :class:`BufferSpec` (never from a training config).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from ray_moe.comm.base import BufferSpec, Layout, Transport, combine, dispatch
from ray_moe.topology import RankInfo

log = logging.getLogger(__name__)

__all__ = ["BufferSpec", "Layout", "Transport", "combine", "dispatch", "choose_transport",
           "make_transport", "transport_bootstrap_id"]


def nvshmem_available() -> bool:
    return importlib.util.find_spec("nvshmem") is not None and importlib.util.find_spec("nvshmem.core") is not None


def choose_transport(requested: str, use_gpu: bool) -> tuple[str, str]:
    """(transport name, why) for ``parallel.transport`` on a group with or without GPUs."""
    if requested == "auto":
        if not use_gpu:
            return "gloo", "no GPUs in the group: torch.distributed over gloo"
        if nvshmem_available():
            return "nvshmem", "every worker has a GPU and nvshmem4py imports"
        return "nccl", "GPUs present but nvshmem4py is not installed (pip install 'ray-moe[gpu]')"
    if requested in ("nvshmem", "nccl") and not use_gpu:
        raise ValueError(f"parallel.transport={requested} needs GPUs but the group runs on CPU")
    if requested == "gloo" and use_gpu:
        raise ValueError("parallel.transport=gloo cannot move CUDA tensors; use nccl, nvshmem or auto")
    return requested, "requested in the config"


def transport_bootstrap_id(name: str, device: torch.device) -> bytes | None:
    """Rank 0: what every rank needs to initialise transport ``name`` (NVSHMEM's unique id)."""
    if name == "nvshmem":
        from ray_moe.comm.nvshmem import create_unique_id

        return create_unique_id(device)
    return None


def make_transport(
    name: str,
    rank_info: RankInfo,
    device: torch.device,
    spec: BufferSpec,
    bootstrap_id: bytes | None = None,
    force_remote_path: bool = False,
    comm_programs: int = 0,
    ranks_per_gpu: int = 1,
) -> Transport:
    """Build transport ``name`` (gloo | nccl | nvshmem) for this rank, its buffers sized by ``spec``;
    NVSHMEM's exchange kernels on ``comm_programs`` SMs (0: all of this rank's share of its GPU,
    which ``ranks_per_gpu`` ranks share)."""
    if name in ("gloo", "nccl"):
        from ray_moe.comm.torch_a2a import TorchA2ATransport

        return TorchA2ATransport(rank_info.rank, rank_info.world_size)
    if name == "nvshmem":
        from ray_moe.comm.nvshmem import NVSHMEMTransport

        return NVSHMEMTransport(rank_info, device, bootstrap_id, spec, force_remote_path=force_remote_path,
                                comm_programs=comm_programs, ranks_per_gpu=ranks_per_gpu)
    raise ValueError(f"unknown transport {name!r}; choose one of gloo, nccl, nvshmem")
