"""The byte corpus: errors name the path."""

from __future__ import annotations

import pytest

from ray_moe.config import DataConfig
from ray_moe.worker.data import Corpus, DataError


def test_corpus_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="no file"):
        Corpus.load(DataConfig(paths=[str(tmp_path / "*.nothing")]))
