"""Real data end to end: a BPE trained on standard-library sources, ``prepare`` with Ray Data on
the session cluster (checked token for token against ``tokenizers``), an interrupted run that
resumes to the same bytes, training from the shards (learns; resumes at other world sizes), and
bad input stopped before anything is written or trained."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from ray_moe import cli
from ray_moe.checkpoint import latest_checkpoint
from ray_moe.data.errors import DataError
from ray_moe.data.prepare import prepare
from ray_moe.data.shards import META_FILE, val_mask
from ray_moe.data.tokenizer import train_bpe
from ray_moe.data.writer import ShardWriter
from ray_moe.driver.trainer import Trainer
from tests.support import small_config

STDLIB = Path(sysconfig.get_paths()["stdlib"])
INPUTS = (str(STDLIB / "a*.py"), str(STDLIB / "json" / "*.py"))  # 12 files, ~280 KB
VOCAB = 512
PREPARE = {"workers": 2, "shard_tokens": 16_384, "val_fraction": 0.1, "progress": False}


def _documents() -> list[str]:
    return [Path(f).read_bytes().decode("utf-8", "replace") for f in _files()]


def _files() -> list[str]:
    return sorted({os.path.realpath(f) for pattern in INPUTS for f in glob.glob(pattern)})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_bpe(_documents()[::2], VOCAB, out)  # trained on part of the sources
    return out


@pytest.fixture(scope="module")
def dataset(ray_cluster, tokenizer_dir, tmp_path_factory) -> Path:
    """Prepared once, the hard way: the first run dies after three shards, the rerun resumes."""
    out = tmp_path_factory.mktemp("prepared") / "ds"
    finish_shard, finished = ShardWriter._finish_shard, []

    def crash_after_three(self, split):
        finish_shard(self, split)
        finished.append(split)
        if len(finished) == 3:
            raise KeyboardInterrupt("simulated crash")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ShardWriter, "_finish_shard", crash_after_three)
        with pytest.raises(KeyboardInterrupt):
            prepare(list(INPUTS), str(tokenizer_dir), str(out), address=ray_cluster, **PREPARE)
    assert not (out / META_FILE).exists()
    assert sorted(f.name for f in out.glob("*.bin")) == ["train-00000.bin", "train-00001.bin", "train-00002.bin"]
    assert all(f.stat().st_size == 2 * PREPARE["shard_tokens"] for f in out.glob("*.bin"))  # no half shard

    report = prepare(list(INPUTS), str(tokenizer_dir), str(out), address=ray_cluster, **PREPARE)
    assert report.workers == 2 and report.skipped_files > 0 and not report.up_to_date
    assert 0 < report.tokens < report.meta["tokens"]  # the rerun wrote only what was missing
    return out


def test_prepare_writes_what_tokenizers_gives(dataset, tokenizer_dir, ray_cluster):
    """The resumed dataset is, token for token, the EOS-joined documents as tokenizers encodes
    them, cut into fixed-size shards (so any rerun writes the same bytes); a rerun does nothing."""
    oracle = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    oracle.encode_special_tokens = True  # special-token text inside a document is text
    docs = [oracle.encode(t, add_special_tokens=False).ids + [0] for t in _documents()]  # EOS = id 0
    is_val = val_mask(np.arange(len(docs)), PREPARE["val_fraction"])
    for split in ("train", "val"):
        want = [i for d, v in zip(docs, is_val) if v == (split == "val") for i in d]
        shards = [np.fromfile(f, dtype="<u2") for f in sorted(dataset.glob(f"{split}-*.bin"))]
        assert all(len(s) == PREPARE["shard_tokens"] for s in shards[:-1])
        assert np.concatenate(shards).tolist() == want, split
    meta = json.loads((dataset / META_FILE).read_text())
    assert meta["tokens"] == sum(map(len, docs)) and meta["documents"] == len(docs) == 12
    assert meta["vocab_size"] == VOCAB and meta["dtype"] == "<u2" and meta["splits"]["val"]["documents"] == 1
    assert [(f["path"], f["bytes"]) for f in meta["inputs"]] == [(f, os.path.getsize(f)) for f in _files()]
    before = {f.name: f.stat().st_mtime_ns for f in dataset.iterdir()}
    again = prepare(list(INPUTS), str(tokenizer_dir), str(dataset), address=ray_cluster, **PREPARE)
    assert again.up_to_date and again.tokens == 0
    assert {f.name: f.stat().st_mtime_ns for f in dataset.iterdir() if f.name != META_FILE} == {
        k: v for k, v in before.items() if k != META_FILE}


def _train_config(tmp_path, dataset, tokenizer_dir, **over):
    return small_config(tmp_path, **{"model.vocab_size": VOCAB, "data.max_bytes": 0,
                                     "data.datasets": f"[{{path: {dataset}}}]", "data.tokenizer": str(tokenizer_dir),
                                     **over})


def test_training_on_the_prepared_dataset_learns_and_resumes_at_any_world_size(groups, dataset, tokenizer_dir,
                                                                                tmp_path):
    cfg = _train_config(tmp_path, dataset, tokenizer_dir, **{"train.steps": 50, "train.batch_size": 16,
                                                               "train.lr": 0.01})
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        initial = t.evaluate()
        t.train()  # saves a checkpoint at the end
        final = t.evaluate()
        saved = latest_checkpoint(tmp_path / "run")
        uninterrupted = t.step()["loss"]
    assert abs(initial - np.log(VOCAB)) < 0.3, initial  # untrained ≈ uniform over the vocabulary
    assert final < initial - 1.0, (initial, final)
    for world_size, strategy in ((1, "PACK"), (4, "SPREAD")):
        other = cfg.with_overrides([f"parallel.world_size={world_size}", f"train.run_dir={tmp_path / f'w{world_size}'}"])
        with Trainer(other, progress=False, group=groups(world_size, strategy)) as t2:
            assert t2.restore(saved) == 50
            assert t2.step()["loss"] == pytest.approx(uninterrupted, rel=1e-5)


@pytest.mark.parametrize("case", ["tokenizer", "vocab"])
def test_a_mismatched_dataset_stops_the_trainer_before_any_step(groups, dataset, tokenizer_dir, tmp_path, case):
    if case == "tokenizer":  # the same vocabulary size, one merge less
        other = json.loads((tokenizer_dir / "tokenizer.json").read_text())
        other["model"]["merges"].pop()
        (tmp_path / "tokenizer.json").write_text(json.dumps(other))
        cfg, message = _train_config(tmp_path, dataset, tmp_path), "was prepared with another tokenizer"
    else:
        cfg = _train_config(tmp_path, dataset, tokenizer_dir, **{"model.vocab_size": 300})
        message = "tokenizer of 512 tokens but model.vocab_size=300"
    with pytest.raises(DataError, match=message) as err:
        Trainer(cfg, progress=False, group=groups(2))
    assert str(dataset) in str(err.value)
    assert latest_checkpoint(tmp_path / "run") is None


def test_binary_content_found_by_a_worker_is_named_and_nothing_is_kept(tokenizer_dir, ray_cluster, tmp_path):
    """Past the part the driver checks first: the worker's DataError reaches the caller as one."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("text " * 1000)
    (tmp_path / "in" / "b.txt").write_bytes(b"x" * 70_000 + b"\x00\x01")
    with pytest.raises(DataError, match=r"b.txt: binary content \(a NUL byte at offset 70000\); expected UTF-8"):
        prepare([str(tmp_path / "in")], str(tokenizer_dir), str(tmp_path / "out"), address=ray_cluster,
                **{**PREPARE, "workers": 1})
    assert not (tmp_path / "out").exists()


def test_bad_input_is_named_and_nothing_is_written(tokenizer_dir, tmp_path, capsys):
    """Each is caught before the pipeline starts: one line, exit code 2 from the CLI, no output."""
    binary = Path(sys.executable).resolve()  # an ELF executable given as text
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "ray_moe.cli", "prepare", "--input", str(binary), "--tokenizer",
                           str(tokenizer_dir), "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"ray-moe prepare: error: {binary}: binary content (a NUL byte at offset 7); "
                                   "expected UTF-8 text")
    assert not out.exists()

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"the 1 input file\(s\) are all empty"):
        prepare([str(tmp_path / "empty")], str(tokenizer_dir), str(out))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        prepare([str(tmp_path / "nothing")], str(tokenizer_dir), str(out))
    assert not out.exists()

    assert cli.main(["tokenizer", "train", "--vocab-size", "300", "--input", str(binary), "--out",
                     str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "binary content" in err[0] and not (tmp_path / "t").exists()
    assert cli.main(["tokenizer", "train", "--vocab-size", "300", "--input", INPUTS[1], "--out",
                     str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "tokenizer.json").is_file()


def test_a_malformed_json_line_found_by_ray_data_is_named_by_file_and_line(tokenizer_dir, ray_cluster, tmp_path):
    """Past the first 64 KiB the driver checks, Ray Data's reader fails on a broken line without
    naming it: prepare names the file and the line, and leaves nothing behind."""
    path = tmp_path / "rows.jsonl"
    rows = [json.dumps({"text": f"row {i} " * 20}) for i in range(2000)]
    path.write_text("\n".join(rows[:1500] + ['{"text": broken'] + rows[1500:]) + "\n")
    with pytest.raises(DataError, match=f"^{path}:1501: not valid JSON"):
        prepare([str(path)], str(tokenizer_dir), str(tmp_path / "out"), address=ray_cluster,
                **{**PREPARE, "workers": 1})
    assert not (tmp_path / "out").exists()
