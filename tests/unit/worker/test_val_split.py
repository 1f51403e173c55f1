"""The byte corpus's validation split spreads over the corpus (a fraction of its blocks, by
``ray-moe prepare``'s rule for documents) instead of being its last part: with the default
corpus that last part was one kind of file (encodings/cp*.py codec tables), and validation loss
measured those."""

from __future__ import annotations

import numpy as np
import pytest

from ray_moe.config import DataConfig
from ray_moe.worker.data import VAL_BLOCK, Corpus, val_bytes


@pytest.mark.parametrize("n, fraction", [(10_000_000, 0.05), (300_000, 0.05), (2_702, 0.05), (10_000_000, 0.01)])
def test_the_validation_bytes_are_the_fraction_asked_for_spread_evenly(n, fraction):
    mask = val_bytes(n, fraction)
    assert mask.shape == (n,) and abs(mask.mean() - fraction) < 0.01
    tenths = mask.reshape(-1)[: n - n % 10].reshape(10, -1).mean(axis=1)
    assert (tenths > 0).all(), tenths  # every tenth of the corpus has validation bytes
    assert not mask[-int(n * fraction):].all()  # not the last part


def test_a_corpus_of_two_kinds_of_file_validates_on_both(tmp_path):
    """Files of 'a's then files of 'b's (as the stdlib walk ends in one kind of file): the old rule
    put only 'b's in the validation split."""
    for i in range(20):
        (tmp_path / f"{i:02d}.txt").write_text(("a" if i < 15 else "b") * 20_000)
    corpus = Corpus.load(DataConfig(paths=[str(tmp_path / "*.txt")], val_fraction=0.05))
    val = bytes(corpus.val.numpy())
    assert 0.7 < val.count(b"a") / len(val) < 0.8  # 15 of 20 files are 'a's
    assert len(corpus.val) == int(val_bytes(20 * 20_000 + 19, 0.05).sum())
    assert len(corpus.train) + len(corpus.val) == 20 * 20_000 + 19
    assert VAL_BLOCK == 4096


def test_val_fraction_zero_leaves_no_validation_bytes():
    assert not val_bytes(100_000, 0.0).any()
    assert np.array_equal(val_bytes(100_000, 0.05), val_bytes(100_000, 0.05))  # a pure function
