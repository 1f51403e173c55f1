"""A transport's peers (an EP group of the rank mesh): explicit, and the only ranks it reaches."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm import TransportSpec, make_transport
from ray_moe.comm.base import BufferSpec
from ray_moe.comm.nvshmem import NVSHMEMRuntime
from tests.support import single_rank

BUFFERS = BufferSpec(max_tokens=8, hidden=4, elem_bytes=4, max_top_k=2)


def test_torch_transport_ranks_are_its_place_among_its_peers():
    tr = make_transport(TransportSpec("gloo"), single_rank(world_size=4, rank=3), torch.device("cpu"), BUFFERS,
                        peers=(2, 3))
    assert (tr.rank, tr.world_size, tr.peers) == (1, 2, (2, 3))
    assert tr.describe()["peers"] == [2, 3]
    whole = make_transport(TransportSpec("gloo"), single_rank(world_size=4, rank=3), torch.device("cpu"), BUFFERS)
    assert (whole.rank, whole.world_size, whole.peers) == (3, 4, (0, 1, 2, 3))  # the layout before the mesh
    with pytest.raises(ValueError, match="rank 3 is not among its transport's peers"):
        make_transport(TransportSpec("gloo"), single_rank(world_size=4, rank=3), torch.device("cpu"), BUFFERS,
                       peers=(0, 1))


class _Bindings:
    """Records the PEs NVSHMEM's host calls are given."""

    class Signal_op:  # noqa: N801 - nvshmem's name
        SIGNAL_ADD = 0

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def ptr(self, addr, pe):
        self.calls.append(("ptr", pe))
        return addr + pe

    def putmem_signal_on_stream(self, dst, src, nbytes, sig, value, op, pe, stream):
        self.calls.append(("put", pe))

    def signal_op_on_stream(self, sig, value, op, pe, stream):
        self.calls.append(("signal", pe))


def test_nvshmem_runtime_translates_peer_indices_to_the_jobs_pes(monkeypatch):
    """The exchange's tables and puts name peers 0..EP-1; NVSHMEM is one job over the world: every
    PE handed to it is the peer's global rank (EP group 1 of a 2 x 2 mesh: PEs 2 and 3)."""
    rt = NVSHMEMRuntime.__new__(NVSHMEMRuntime)
    rt.bindings, rt.peers = _Bindings(), (2, 3)
    monkeypatch.setattr(rt, "stream", lambda: 0)
    assert rt.peer_ptr(1000, 1) == 1003
    rt.put_signal(0, 0, 8, 0, 1, 0)
    rt.signal_add(0, 1, 1)
    assert rt.bindings.calls == [("ptr", 3), ("put", 2), ("signal", 3)]  # never PE 0 or 1: the other group
