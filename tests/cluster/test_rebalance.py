"""Re-cloning during training: plans change, clone weights move, training is unchanged, and a
resumed run continues exactly (placements and load statistics are checkpointed)."""

from __future__ import annotations

import pytest
import torch

from ray_moe.driver.trainer import Trainer
from tests.support import check_clone_grads_three_ways, clone_grads_three_ways, small_config


def _state(worker):
    return worker.engine.shard_state()


def _versions(worker):
    return [layer.placement.version for layer in worker.engine.model.moe_layers()]


def run(cfg, steps, group):
    with Trainer(cfg, progress=False, group=group) as t:
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
def test_training_with_cloning_equals_without(groups, tmp_path, world_size, experts):
    common = {"parallel.world_size": world_size, "moe.num_experts": experts, "moe.top_k": 2,
              "parallel.placement_strategy": "SPREAD", "train.batch_size": 8, "train.steps": 8}
    off = small_config(tmp_path / "off", **common)
    on = small_config(tmp_path / "on", **common, **{"balance.enabled": True, "balance.interval": 2,
                                                     "balance.clone_slots": 1, "balance.ema": 0.0})
    group = groups(world_size, "SPREAD" if world_size == 4 else "STRICT_SPREAD")
    losses_off, state_off, _, _, _, _ = run(off, 8, group)
    losses_on, state_on, events, versions, nodes, _ = run(on, 8, group)
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


def _plan_fields(event):
    return {k: event[k] for k in ("step", "layers_changed", "imbalance_before", "imbalance_after", "versions")}


@pytest.mark.parametrize("dtype", ["bfloat16"])  # (float32 resumes exactly too: the harder case is kept)
def test_resume_with_recloning_continues_exactly(groups, tmp_path, dtype):
    """Stopped at step 5 (between two re-plans, loads pending in the window) and resumed by a new
    Trainer: the next steps' losses, the re-plans and the final weights are bit-identical (bf16:
    the checkpoint holds the float32 masters, from which the bf16 parameters are rebuilt)."""
    common = {"moe.num_experts": 4, "train.steps": 9, "balance.enabled": True, "balance.interval": 2,
              "balance.clone_slots": 1, "balance.ema": 0.5, "parallel.placement_strategy": "SPREAD",
              "model.dtype": dtype}
    group = groups(2, "STRICT_SPREAD")
    whole = small_config(tmp_path / "whole", **common)
    with Trainer(whole, progress=False, group=group) as t:
        losses = [t.step()["loss"] for _ in range(9)]
        plans = [_plan_fields(e) for e in t.metrics if e.get("event") == "rebalance"]
        final = {}
        for shard in t.group.execute(_state):
            final.update(shard)
    assert any(p["layers_changed"] for p in plans), plans  # clones were really placed

    parts = small_config(tmp_path / "parts", **common)
    with Trainer(parts, progress=False, group=group) as t:
        first = [t.step()["loss"] for _ in range(5)]
        t.save()
    with Trainer(parts.with_overrides(["train.resume=true"]), progress=False, group=group) as t:
        assert t.step_count == 5
        assert t.group.execute(_versions) == [[p["versions"] for p in plans if p["step"] == 4][0]] * 2
        rest = [t.step()["loss"] for _ in range(4)]
        later = [_plan_fields(e) for e in t.metrics if e.get("event") == "rebalance" and e["step"] > 5]
        resumed = {}
        for shard in t.group.execute(_state):
            resumed.update(shard)
    assert first + rest == losses  # exactly, not approximately
    assert later == [p for p in plans if p["step"] > 5]
    assert set(resumed) == set(final)
    for k in final:
        if not k.startswith("rng."):
            assert torch.equal(resumed[k], final[k]), k


def test_clone_gradients_leave_during_backward(groups, tmp_path):
    """bf16 model, W=2, one clone slot, after re-plans placed clones: the clone gradients launched
    from backward's hooks (one exchange per layer, both layers launched by backward itself) equal the in-place reduction after backward, bit for bit with float32 sums, and within one
    bf16 rounding of the sum with rounded ones (``parallel.grad_reduce_dtype: bfloat16``)."""
    cfg = small_config(tmp_path, **{"moe.num_experts": 4, "balance.enabled": True, "balance.interval": 2,
                                    "balance.clone_slots": 1, "balance.ema": 0.0, "model.dtype": "bfloat16",
                                    "parallel.placement_strategy": "SPREAD"})
    with Trainer(cfg, progress=False, group=groups(2, "STRICT_SPREAD")) as t:
        for _ in range(3):
            t.step()
        for out in t.group.execute(clone_grads_three_ways):
            check_clone_grads_three_ways(out, layers=2, exact=True)
