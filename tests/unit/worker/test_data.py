"""The engine's batch sources: the byte corpus and prepared token datasets (windows,
W-independence, mixtures); every bad input is named."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ray_moe.config import DataConfig
from ray_moe.worker.data import Corpus, DataError, TokenShards
from tests.unit.data.shard_helpers import random_files, write_dataset


def test_corpus_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="data.paths: the pattern .* matches no file"):
        Corpus.load(DataConfig(paths=[str(tmp_path / "*.nothing")]))


def test_a_capped_corpus_counts_the_files_it_read(tmp_path):
    for i in range(50):
        (tmp_path / f"f{i:02d}.txt").write_text("x" * 1000)
    corpus = Corpus.load(DataConfig(paths=[str(tmp_path)], max_bytes=2500, val_fraction=0.2))
    assert corpus.files == 3  # the other 47 files are never opened
    assert len(corpus.train) + len(corpus.val) == 2500 + 2  # capped, plus a newline between files


def test_the_byte_corpus_refuses_binary_files(tmp_path):
    (tmp_path / "lib.so").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 40)
    with pytest.raises(DataError, match=r"lib.so' is not text \(binary content \(a NUL byte at offset 7\)\)"):
        Corpus.load(DataConfig(paths=[str(tmp_path / "lib.so")]))


# ---------------------------------------------------------------- prepared token datasets
def _stream(out, split):
    return np.concatenate([np.fromfile(f, dtype="<u2") for f in sorted(out.glob(f"{split}-*.bin"))])


def _shards(*paths, weights=None, tokenizer="", vocab_size=1000, seq_len=16) -> TokenShards:
    entries = [{"path": str(p), "weight": w} for p, w in zip(paths, weights or [1.0] * len(paths))]
    return TokenShards.open(DataConfig(datasets=entries, tokenizer=str(tokenizer) if tokenizer else ""),
                            vocab_size, seq_len)


def test_token_windows_read_the_stream_whatever_the_world_size(tmp_path):
    write_dataset(tmp_path / "ds", random_files(np.random.default_rng(0), 24), shard_tokens=200)
    reader, stream = _shards(tmp_path / "ds"), _stream(tmp_path / "ds", "train")
    text = stream.astype(np.int64).tobytes()
    for step in (0, 5):
        x, y = reader.batch("train", 1, step, 8, 16)
        assert x.dtype == torch.int64 and x.shape == (8, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, last in zip(x.numpy(), y[:, -1].numpy()):  # windows cross shard and document boundaries
            assert np.append(row, last).astype(np.int64).tobytes() in text
        for world_size in (2, 4):
            parts = [reader.batch("train", 1, step, 8, 16, r, world_size) for r in range(world_size)]
            assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert not torch.equal(reader.batch("val", 1, 0, 8, 16)[0], reader.batch("train", 1, 0, 8, 16)[0])


def test_a_mixture_reads_each_dataset_at_its_weight(tmp_path):
    rng = np.random.default_rng(1)
    write_dataset(tmp_path / "low", random_files(rng, 30, 1, 100), shard_tokens=1000, val_fraction=0.1)  # ids < 100 (EOS 0)
    write_dataset(tmp_path / "high", random_files(rng, 30, 500, 600), eos_id=500, shard_tokens=1000,
                  val_fraction=0.1)
    reader = _shards(tmp_path / "low", tmp_path / "high", weights=[3.0, 1.0], seq_len=8)
    B, steps = 8, 100
    high = np.array([(reader.batch("train", 0, s, B, 8)[0] >= 100).any(1).sum().item() for s in range(steps)])
    assert set(high.tolist()) <= {2}  # 1/4 of 8 rows, every batch (stated bound: within one row of w·B)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "train-00001.bin").unlink(), r"train-00001.bin is missing \(index.json lists it"),
    (lambda d: os.truncate(d / "train-00000.bin", 30), r"train-00000.bin is truncated or damaged: 30 bytes"),
    (lambda d: os.truncate(d / "index.json", 100), r"index.json is not valid JSON .* truncated"),
    (lambda d: (d / "meta.json").unlink(), r"preparation did not finish \(meta.json is missing\)"),
])
def test_a_damaged_dataset_is_named(tmp_path, damage, message):
    write_dataset(tmp_path / "ds", random_files(np.random.default_rng(2), 30), shard_tokens=300)
    damage(tmp_path / "ds")
    with pytest.raises(DataError, match=message):
        _shards(tmp_path / "ds")


def test_a_dataset_of_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    files = random_files(np.random.default_rng(3), 30)
    write_dataset(tmp_path / "ds", files, shard_tokens=1000)
    with pytest.raises(DataError, match=r"tokenizer of 1000 tokens but model.vocab_size=512; set model.vocab_size >= 1000"):
        _shards(tmp_path / "ds", vocab_size=512)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    with pytest.raises(DataError, match=r"another tokenizer \(sha256 hhhhhhhhhhhh.*than data.tokenizer=.*tok"):
        _shards(tmp_path / "ds", tokenizer=tmp_path / "tok")
    write_dataset(tmp_path / "other", files, shard_tokens=1000, tokenizer_hash="0" * 64)
    with pytest.raises(DataError, match="other was prepared with another tokenizer"):
        _shards(tmp_path / "ds", tmp_path / "other")


def test_token_ids_beyond_the_vocabulary_are_named(tmp_path):
    files = random_files(np.random.default_rng(4), 30, 1, 1000)
    write_dataset(tmp_path / "small", files, vocab_size=300, shard_tokens=1000)  # claims 300 tokens, holds ids up to 999
    with pytest.raises(DataError, match=r"train-00000.bin holds token id 9\d\d but model.vocab_size=500"):
        _shards(tmp_path / "small", vocab_size=500)
    write_dataset(tmp_path / "ds", files, shard_tokens=10_000)
    reader = _shards(tmp_path / "ds")
    np.full(100, 0xFFFF, dtype="<u2").tofile(tmp_path / "ds" / "train-00000.bin")  # damaged after opening
    os.truncate(tmp_path / "ds" / "train-00000.bin", reader.datasets[0].split("train").tokens * 2)
    with pytest.raises(DataError, match=r"train-00000.bin holds token id 65535 at token \d+ but model.vocab_size=1000"):
        reader.batch("train", 0, 0, 4, 16)


def test_an_hf_architecture_names_its_own_vocabulary_key(tmp_path):
    """With an HF architecture V is the HF config's: a dataset that does not fit names
    model.hf.vocab_size (model.vocab_size would be refused as a conflict with the HF config)."""
    from ray_moe.config import Config
    from ray_moe.worker.data import open_corpus

    write_dataset(tmp_path / "ds", random_files(np.random.default_rng(3), 30), shard_tokens=1000)
    cfg = Config.from_dict({"model": {"hf_config": "qwen3_moe-tiny", "seq_len": 16},
                            "data": {"datasets": [{"path": str(tmp_path / "ds")}]}, "parallel": {"world_size": 1}})
    with pytest.raises(DataError, match=r"tokenizer of 1000 tokens but model.hf.vocab_size=\d+; "
                                        r"set model.hf.vocab_size >= 1000"):
        open_corpus(cfg, 512)
