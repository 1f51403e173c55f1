"""MoELayer on one process (W=1): argument checks, sharding marks, deterministic init."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.model.moe import MoELayer
from ray_moe.placement.placement import Placement, expert_shard


def test_layer_rejects_bad_shapes_and_dtypes():
    layer = MoELayer(16, 4, 2, 8, LocalTransport())
    with pytest.raises(ValueError, match=r"shape \[T, 16\]"):
        layer(torch.randn(3, 8))
    with pytest.raises(TypeError, match="dtype torch.float32"):
        layer(torch.randn(3, 16, dtype=torch.float64))


def test_expert_weights_carry_the_shard_mark_and_the_router_does_not():
    layer = MoELayer(16, 4, 2, 8, LocalTransport(), clone_slots=1)
    assert expert_shard(layer.w13).native_experts == (0, 1, 2, 3) == layer.native_experts
    assert expert_shard(layer.w2) is expert_shard(layer.w13)
    assert expert_shard(layer.router) is None
    assert layer.w13.shape[0] == 5  # 4 native slots + 1 clone slot
    with pytest.raises(ValueError, match="E=8, W=1; the layer has E=4"):
        layer.set_placement(Placement.native(8, 1, 1))


def test_initial_weights_do_not_touch_the_global_rng():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = MoELayer(16, 4, 2, 8, LocalTransport(), seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = MoELayer(16, 4, 2, 8, LocalTransport(), seed=7)
    assert torch.equal(a.w13, b.w13) and torch.equal(a.router, b.router)
