"""The benchmarks' own instruments on a GPU: what they report must be able to show a problem."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_the_steady_loop_counter_sees_a_host_synchronisation():
    """The positive control of `bench layer`'s `host_syncs_per_step`: a `.item()` inside the
    counted region is one line naming where it came from; device work alone is none."""
    from ray_moe.bench.ep_layer import _host_syncs

    dev = torch.device("cuda")
    x = torch.ones(1024, device=dev)
    with _host_syncs(dev) as none:
        (x * 2).sum()
    with _host_syncs(dev) as one:
        (x * 2).sum().item()
    assert none == [] and len(one) == 1 and "test_bench_gpu.py" in one[0], (none, one)
    assert torch.cuda.get_sync_debug_mode() == 0  # restored
