"""A small byte-level BPE, trained once per session on a slice of the standard library."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from ray_moe.data.tokenizer import train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SAMPLE = ("abc.py", "bisect.py", "colorsys.py", "copyreg.py", "keyword.py", "heapq.py")


@pytest.fixture(scope="session")
def sample_texts() -> list[str]:
    return [(STDLIB / name).read_text(encoding="utf-8") for name in SAMPLE]


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory, sample_texts) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_bpe(sample_texts, 320, out)
    return out
