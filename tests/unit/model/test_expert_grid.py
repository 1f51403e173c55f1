"""``moe.expert_grid``: the Triton experts' row GEMMs on a persistent grid or one program per tile
(for experts beside an exchange that holds SMs). The kernels of both grids are checked against
the reference on the GPU (tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

import pytest
import torch


def test_the_tile_grid_plan_has_no_persistent_gemm(monkeypatch):
    """On Hopper the default plan's down and dx GEMMs are persistent (gate_up is the one-dot pointer
    kernel, one program per tile either way); ``persistent=False`` makes
    every GEMM one program per tile and changes nothing else."""
    from ray_moe.kernels import grouped_swiglu as gs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    roles = ("gate_up", "down", "dact", "dx", "wgrad13", "wgrad2", "gate_up_split")
    persistent = gs.default_plan(torch.bfloat16, cuda)
    tiles = gs.default_plan(torch.bfloat16, cuda, persistent=False)
    assert {r for r in roles if getattr(persistent, r).persistent} == {"down", "dx"}
    assert not any(getattr(tiles, r).persistent or getattr(tiles, r).flatten for r in roles)
    for r in roles:
        assert getattr(tiles, r).tma == getattr(persistent, r).tma
        assert (getattr(tiles, r).block_m, getattr(tiles, r).block_n) == (getattr(persistent, r).block_m,
                                                                          getattr(persistent, r).block_n)


def test_the_layer_hands_its_grid_to_the_experts(monkeypatch):
    from ray_moe.comm.local import LocalTransport
    from ray_moe.model import moe
    from ray_moe.model.experts import expert_ffn

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("grid"))
        return expert_ffn(*args, **kwargs)

    monkeypatch.setattr(moe, "expert_ffn", spy)
    for grid in ("persistent", "tiles"):
        layer = moe.MoELayer(moe.MoELayerSpec(16, 4, 2, 8, expert_grid=grid), LocalTransport())
        layer(torch.randn(6, 16))
    assert seen == ["persistent", "tiles"]
    with pytest.raises(ValueError, match="expert_grid='wide' is not one of persistent, tiles"):
        moe.MoELayerSpec(16, 4, 2, 8, expert_grid="wide")
    with pytest.raises(ValueError, match="grid 'wide' is not one of persistent, tiles"):
        expert_ffn(torch.randn(2, 16), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1),
                   torch.randn(1, 16, 16), torch.randn(1, 8, 16), impl="triton", grid="wide")
