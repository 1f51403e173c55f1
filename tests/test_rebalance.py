"""Re-cloning during training: plans change, clone weights move, and training is unchanged."""

from __future__ import annotations

import pytest
import torch

from ray_moe.trainer import Trainer
from tests_support import small_config


def _state(worker):
    return worker.engine.shard_state()


def _versions(worker):
    return worker.engine.placement_versions()


def run(cfg, steps):
    with Trainer(cfg, progress=False) as t:
        losses = [t.step()["loss"] for _ in range(steps)]
        state = {}
        for shard in t.group.execute(_state):
            state.update(shard)
        events = [m for m in t.metrics if m.get("event") == "rebalance"]
        versions = t.group.execute(_versions)
        nodes = t.group.num_nodes
        imbalance = [m["imbalance"] for m in t.metrics if "imbalance" in m]
    return losses, state, events, versions, nodes, imbalance


@pytest.mark.parametrize("world_size,experts", [(2, 4), (4, 8)])
def test_training_with_cloning_equals_without(ray_cluster, tmp_path, world_size, experts):
    common = {"parallel.world_size": world_size, "moe.num_experts": experts, "moe.top_k": 2,
              "parallel.placement_strategy": "SPREAD", "train.batch_size": 8, "train.steps": 8}
    off = small_config(tmp_path / "off", **common)
    on = small_config(tmp_path / "on", **common, **{"balance.enabled": True, "balance.interval": 2,
                                                     "balance.clone_slots": 1, "balance.ema": 0.0})
    losses_off, state_off, _, _, _, _ = run(off, 8)
    losses_on, state_on, events, versions, nodes, _ = run(on, 8)
    assert nodes == 2  # the ranks span both simulated nodes
    assert len(events) == 4, events
    changed = [e for e in events if e["layers_changed"] > 0]
    assert changed and sum(e["bytes_moved"] for e in changed) > 0, events
    assert all(v == versions[0] for v in versions) and max(versions[0]) >= 1  # same version everywhere
    for e in changed:
        assert max(e["imbalance_after"]) <= max(e["imbalance_before"]) + 1e-9
    assert losses_on == pytest.approx(losses_off, rel=1e-5)
    assert set(state_on) == set(state_off)
    for k in state_off:
        torch.testing.assert_close(state_on[k], state_off[k], rtol=1e-4, atol=1e-6, msg=k)
