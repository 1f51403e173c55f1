"""Transports: how token rows move between the ranks of an expert-parallel group.

``choose_transport`` resolves ``parallel.transport: auto`` (on the driver, into a frozen
:class:`TransportSpec`); ``make_transport`` builds one on a worker after torch.distributed is
initialised, from that spec, the rank's place in the group and an explicit :class:`BufferSpec`
(never from a training config).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

import torch

from ray_moe.comm.base import BufferSpec, Layout, Transport, TransportSpec, combine, dispatch, dispatch_payload
from ray_moe.topology import RankInfo

log = logging.getLogger(__name__)

__all__ = ["BufferSpec", "Layout", "Transport", "TransportSpec", "combine", "dispatch", "dispatch_payload",
           "choose_transport", "make_transport", "transport_bootstrap_id"]


def nvshmem_available() -> bool:
    return importlib.util.find_spec("nvshmem") is not None and importlib.util.find_spec("nvshmem.core") is not None


def choose_transport(requested: str, use_gpu: bool) -> tuple[str, str]:
    """(transport name, why) for ``parallel.transport`` on a group with or without GPUs. Whether
    an explicit choice fits the device is ``ray_moe.config.transport_device_error``'s rule,
    checked before (by the config and by the group)."""
    if requested != "auto":
        return requested, "requested in the config"
    if not use_gpu:
        return "gloo", "no GPUs in the group: torch.distributed over gloo"
    if nvshmem_available():
        return "nvshmem", "every worker has a GPU and nvshmem4py imports"
    return "nccl", "GPUs present but nvshmem4py is not installed (pip install 'ray-moe[gpu]')"


def transport_bootstrap_id(name: str, device: torch.device) -> bytes | None:
    """Rank 0: what every rank needs to initialise transport ``name`` (NVSHMEM's unique id)."""
    if name == "nvshmem":
        from ray_moe.comm.nvshmem import create_unique_id

        return create_unique_id(device)
    return None


def make_transport(
    spec: TransportSpec,
    rank_info: RankInfo,
    device: torch.device,
    buffers: BufferSpec,
    bootstrap_id: bytes | None = None,
    peers: Sequence[int] | None = None,
    group: Any = None,
) -> Transport:
    """Build the transport ``spec`` names (gloo | nccl | nvshmem) for this rank, its buffers sized
    by ``buffers``. ``peers``: the global ranks token rows move between (this rank's EP group,
    in EP-rank order; default the whole world); ``group``: their torch.distributed process group
    (default the world's). The transport's ``rank`` and ``world_size`` are this rank's place in
    ``peers`` and their number."""
    peers = tuple(range(rank_info.world_size)) if peers is None else tuple(peers)
    if rank_info.rank not in peers:
        raise ValueError(f"rank {rank_info.rank} is not among its transport's peers {peers}")
    if spec.name in ("gloo", "nccl"):
        from ray_moe.comm.torch_a2a import TorchA2ATransport

        return TorchA2ATransport(peers.index(rank_info.rank), len(peers), group=group, peers=peers)
    from ray_moe.comm.nvshmem import NVSHMEMTransport

    return NVSHMEMTransport(rank_info, device, bootstrap_id, buffers, spec, peers=peers, group=group)
