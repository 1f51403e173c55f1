"""make_transport builds what the driver's TransportSpec says, on CPU: the NVSHMEM transport's
knobs come from the spec alone (the library, the device queries and the buffer are stubbed; the
GPU test tests/gpu/test_transport_spec_gpu.py runs the real thing)."""

from __future__ import annotations

import torch

from ray_moe.comm import BufferSpec, TransportSpec, make_transport
from ray_moe.comm import nvshmem
from tests.support import single_rank

BUFFERS = BufferSpec(max_tokens=64, hidden=32, elem_bytes=2, max_top_k=2)


def _stub_nvshmem(monkeypatch) -> None:
    monkeypatch.setattr(nvshmem, "NVSHMEMRuntime", lambda *args: object())
    monkeypatch.setattr(nvshmem, "_gather_node_ranks", lambda rank_info, device: [0] * rank_info.world_size)
    monkeypatch.setattr(nvshmem, "_num_programs", lambda device, ranks_per_gpu=1: 132 // ranks_per_gpu)
    monkeypatch.setattr(nvshmem, "fast_launch_works", lambda device: True)
    monkeypatch.setattr(nvshmem.NVSHMEMTransport, "reserve", lambda self, spec: None)


def test_the_nvshmem_transport_takes_its_settings_from_the_spec_not_the_environment(monkeypatch):
    _stub_nvshmem(monkeypatch)
    monkeypatch.setenv("RAY_MOE_FAST_LAUNCH", "0")  # the old knobs: no longer read
    monkeypatch.setenv("RAY_MOE_NVSHMEM_SPIN_LIMIT", "5")
    cuda = torch.device("cuda", 0)
    t = make_transport(TransportSpec("nvshmem"), single_rank(2), cuda, BUFFERS, b"uid")
    assert (t.name, t.spin_limit, t.fast_launch, t.comm_programs, t.force_remote) == (
        "nvshmem", 1 << 25, True, 132, False)
    spec = TransportSpec("nvshmem", force_remote_path=True, comm_programs=200, spin_limit=7, fast_launch=False)
    t = make_transport(spec, single_rank(2), cuda, BUFFERS, b"uid")
    assert (t.name, t.spin_limit, t.fast_launch, t.comm_programs, t.force_remote) == (
        "nvshmem-remote", 7, False, 132, True)  # G capped at the SMs
    assert make_transport(TransportSpec("nvshmem", comm_programs=8), single_rank(2), cuda, BUFFERS,
                          b"uid").comm_programs == 8


def test_gloo_and_nccl_are_torch_distributed_all_to_all():
    from ray_moe.comm.torch_a2a import TorchA2ATransport

    for name in ("gloo", "nccl"):
        t = make_transport(TransportSpec(name), single_rank(2, 1), torch.device("cpu"), BUFFERS)
        assert isinstance(t, TorchA2ATransport) and (t.rank, t.world_size) == (1, 2)
