"""The load tracker: EMA per layer and source rank, state round trip, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ray_moe.placement.loads import LoadTracker


def test_load_tracker_ema():
    t = LoadTracker(num_layers=2, num_experts=4, world_size=2, ema=0.75)
    assert t.loads.shape == (2, 4) and not t.loads.any() and t.source_loads is None
    a = np.arange(16.0).reshape(2, 2, 4)
    b = torch.ones(2, 2, 4, dtype=torch.int64)
    t.update(a)
    np.testing.assert_allclose(t.loads, a.sum(1))
    t.update(b)
    np.testing.assert_allclose(t.source_loads, 0.75 * a + 0.25 * 1.0)
    np.testing.assert_allclose(t.loads, (0.75 * a + 0.25).sum(1))
    state = t.state_dict()
    u = LoadTracker(2, 4, 2)
    u.load_state_dict(json.loads(json.dumps(state)))
    np.testing.assert_allclose(u.loads, t.loads)
    with pytest.raises(ValueError, match="shape"):
        t.update(np.ones((2, 4)))  # totals after per-source updates
    with pytest.raises(ValueError, match="source ranks"):
        LoadTracker(2, 4, 2).update(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="ema"):
        LoadTracker(1, 4, ema=1.0)
    totals = LoadTracker(1, 4, 2, ema=0.5)
    totals.update([[1, 2, 3, 4]])
    totals.update([[3, 2, 1, 0]])
    np.testing.assert_allclose(totals.loads, [[2, 2, 2, 2]])
    assert totals.source_loads is None
