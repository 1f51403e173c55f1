"""The mixture sampler: each dataset gets its weight's share of every batch, W-independently."""

from __future__ import annotations

import numpy as np
import pytest

from ray_moe.data.mixture import allocate_rows, batch_rng, window_starts


@pytest.mark.parametrize("weights", [(0.7, 0.3), (1.0, 2.0, 5.0)])
def test_every_batch_gives_each_dataset_its_share(weights):
    B, steps = 16, 300
    w = np.asarray(weights) / sum(weights)
    counts = np.array([np.bincount(allocate_rows(batch_rng(0, s, "train"), B, weights), minlength=len(w))
                       for s in range(steps)])
    assert (counts >= np.floor(w * B)).all() and (counts <= np.ceil(w * B)).all()  # per batch: ⌊w·B⌋ or ⌈w·B⌉
    assert np.abs(counts.sum(0) / (B * steps) - w).max() <= 1 / B
    assert np.abs(counts.mean(0) - w * B).max() < 0.1  # unbiased: the expected share is exactly w


def test_windows_are_a_pure_function_of_seed_step_and_split():
    a = window_starts(3, 7, "train", 8, 33, [1.0, 1.0], [100, 1000])
    b = window_starts(3, 7, "train", 8, 33, [1.0, 1.0], [100, 1000])
    c = window_starts(3, 7, "val", 8, 33, [1.0, 1.0], [100, 1000])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])
    which, start = a
    assert (start >= 0).all() and (start + 33 <= np.array([100, 1000])[which]).all()
