"""Which dataset and which window each row of a global batch reads: a pure function of
(seed, step, split), independent of the world size.

Rows are given to datasets by systematic sampling: with weights w (normalised) and one uniform
offset u, row i of the sorted allocation goes to the dataset whose cumulative-weight interval
holds (i + u)/B. So every batch gives dataset k either ⌊w_k·B⌋ or ⌈w_k·B⌉ of its B rows (over n
batches its share is within 1/B of w_k), and its expected share is exactly w_k. The allocation
is then shuffled, so each rank's slice is a mixture too. Each row's window start is uniform over
its dataset's split.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

import numpy as np

SPLIT_IDS = MappingProxyType({"train": 0, "val": 1})


def batch_rng(seed: int, step: int, split: str) -> np.random.Generator:
    """The generator of global batch ``step`` of ``split`` (PCG64 from a SeedSequence)."""
    return np.random.Generator(np.random.PCG64([seed % (1 << 64), step, SPLIT_IDS[split]]))


def allocate_rows(rng: np.random.Generator, batch_size: int, weights: Sequence[float]) -> np.ndarray:
    """Dataset index of every row: int64 [batch_size], shuffled (systematic sampling, see above)."""
    w = np.asarray(weights, dtype=np.float64)
    cum = np.cumsum(w / w.sum())
    cum[-1] = 1.0
    points = (np.arange(batch_size) + rng.random()) / batch_size
    rows = np.minimum(np.searchsorted(cum, points, side="right"), len(w) - 1)
    return rows[rng.permutation(batch_size)]


def window_starts(seed: int, step: int, split: str, batch_size: int, window: int,
                  weights: Sequence[float], sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(dataset int64 [B], start int64 [B]) of the B windows of ``window`` tokens in global batch
    ``step``: start is uniform in [0, sizes[dataset] - window] (sizes ≥ window, in tokens)."""
    rng = batch_rng(seed, step, split)
    datasets = allocate_rows(rng, batch_size, weights)
    span = np.asarray(sizes, dtype=np.int64)[datasets] - window + 1
    starts = np.floor(rng.random(batch_size) * span).astype(np.int64)
    return datasets, np.minimum(starts, span - 1)
