"""MoELayer on one process (W=1): argument checks, sharding marks, deterministic init."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.model.moe import MoELayer, MoELayerSpec, pop_loads
from ray_moe.placement.placement import Placement, expert_shard


def test_layer_rejects_bad_shapes_and_dtypes():
    layer = MoELayer(MoELayerSpec(16, 4, 2, 8), LocalTransport())
    with pytest.raises(ValueError, match=r"shape \[T, 16\]"):
        layer(torch.randn(3, 8))
    with pytest.raises(TypeError, match="dtype torch.float32"):
        layer(torch.randn(3, 16, dtype=torch.float64))


@pytest.mark.parametrize("change, match", [
    ({"top_k": 5}, "top_k=5 must be <= num_experts=4"),
    ({"hidden": 0}, "hidden must be an integer >= 1"),
    ({"clone_slots": -1}, "clone_slots must be an integer >= 0"),
    ({"expert_impl": "fast"}, "expert_impl='fast' is not one of auto, loop"),
    ({"aux_loss_coef": -0.1}, "aux_loss_coef=-0.1 must be >= 0"),
])
def test_layer_spec_owns_the_layer_shape_rules(change, match):
    args = dict(hidden=16, num_experts=4, top_k=2, expert_hidden=8)
    with pytest.raises(ValueError, match=match):
        MoELayerSpec(**{**args, **change})


def test_validation_cases_defer_to_the_layer_spec():
    from ray_moe.validation.cases import Case

    with pytest.raises(ValueError, match="top_k=9 must be <= num_experts=8"):
        Case(top_k=9)
    assert Case(expert_impl="loop", hidden=24).layer_spec().expert_impl == "loop"
    assert Case(expert_impl="loop", hidden=24).layer_spec().hidden == 24


def test_expert_weights_carry_the_shard_mark_and_the_router_does_not():
    layer = MoELayer(MoELayerSpec(16, 4, 2, 8, clone_slots=1), LocalTransport())
    assert expert_shard(layer.w13).native_experts == (0, 1, 2, 3) == layer.native_experts
    assert expert_shard(layer.w2) is expert_shard(layer.w13)
    assert expert_shard(layer.router) is None
    assert layer.w13.shape[0] == 5  # 4 native slots + 1 clone slot
    with pytest.raises(ValueError, match="E=8, W=1; the layer has E=4"):
        layer.set_placement(Placement.native(8, 1, 1))


def test_initial_weights_do_not_touch_the_global_rng():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = MoELayer(MoELayerSpec(16, 4, 2, 8, seed=7), LocalTransport())
    assert torch.equal(torch.get_rng_state(), before)
    b = MoELayer(MoELayerSpec(16, 4, 2, 8, seed=7), LocalTransport())
    assert torch.equal(a.w13, b.w13) and torch.equal(a.router, b.router)


def test_pop_loads_reads_every_layer_at_once_and_resets_them():
    layers = [MoELayer(MoELayerSpec(16, 4, 2, 8, seed=s), LocalTransport()) for s in range(3)]
    x = torch.randn(2, 37, 16)
    for i, layer in enumerate(layers):
        for _ in range(i + 1):  # different counts per layer
            layer(x[0])
    want = [(layer.expert_tokens.clone(), layer.received_pairs.clone()) for layer in layers]
    assert all(float(t.sum()) == 37 * 2 * (i + 1) for i, (t, _) in enumerate(want))  # top-2 of 37 tokens, i+1 times
    tokens, pairs = pop_loads(layers)
    assert tokens.shape == (3, 4) and pairs.shape == (3,) and tokens.device.type == "cpu"
    assert torch.equal(tokens, torch.stack([t for t, _ in want]))
    assert torch.equal(pairs, torch.cat([p for _, p in want]))
    assert all(float(layer.expert_tokens.abs().sum() + layer.received_pairs.abs().sum()) == 0 for layer in layers)
    t1, p1 = layers[1].pop_load()  # the one-layer form after a reset
    assert t1.shape == (4,) and p1.shape == (1,) and float(t1.sum()) == 0
    assert pop_loads([])[0].numel() == 0
    with pytest.raises(ValueError, match="one expert count"):
        pop_loads([layers[0], MoELayer(MoELayerSpec(16, 8, 2, 8), LocalTransport())])
