"""The NVSHMEM settings are config keys that reach every rank through the frozen TransportSpec the
group resolves (no environment variables): a spin limit and the direct-launch switch set in the
config are what each rank's transport and buffer run with, and the transport still passes its
validators with direct launches off (every exchange through Triton's JIT).

Run on the GPU machine (skipped without CUDA or nvshmem4py); one rank per GPU, at most two.
"""

from __future__ import annotations

import pytest

from ray_moe.validation import Case
from tests.support import run_all

pytestmark = pytest.mark.gpu


def _transport_settings(worker) -> dict:
    t = worker.transport
    return {"spin_limit": t.spin_limit, "buffer_spin_limit": t.buffer.spin_limit,
            "fast_launch": t.fast_launch, "launcher_fast": t.buffer.launcher.fast,
            "comm_programs": t.comm_programs, "num_programs": t.num_programs}


def test_config_knobs_reach_every_ranks_transport():
    pytest.importorskip("nvshmem.core")
    import ray

    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup, connect

    connect()
    W = min(2, int(ray.cluster_resources().get("GPU", 0)))
    if W < 1:
        pytest.skip("needs a GPU in the Ray cluster")
    cfg = Config.from_dict({
        "model": {"d_model": 64, "seq_len": 32, "n_heads": 4},
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 96},
        "train": {"batch_size": 2 * W},
        "parallel": {"world_size": W, "device": "cuda", "transport": "nvshmem", "startup_timeout_s": 180,
                     "nvshmem_spin_limit": 1 << 24, "fast_launch": False, "comm_programs": 8},
    })
    g = WorkerGroup(cfg)
    try:
        assert g.transport_spec.spin_limit == 1 << 24 and not g.transport_spec.fast_launch
        for s in g.execute(_transport_settings):
            assert s["spin_limit"] == s["buffer_spin_limit"] == 1 << 24, s
            assert s["fast_launch"] is False and s["launcher_fast"] is False, s
            assert s["comm_programs"] == min(8, s["num_programs"]), s
        fails = run_all(g, Case(hidden=64, dtype="bfloat16"))
        assert not fails, "\n".join(fails)
        g.execute(lambda w: w.transport.check())
    finally:
        g.close()
