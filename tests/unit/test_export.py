"""``ray-moe export`` never mixes two models: a non-empty --out is refused (one line, untouched)
unless --replace is given, which replaces it whole; a write that fails (a full disk) leaves --out
as it was, with no temporary directory behind."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import pytest
import torch

from ray_moe import checkpoint
from ray_moe.cli import main
from ray_moe.comm.local import LocalTransport
from ray_moe.config import Config
from tests.support import single_rank


@pytest.fixture
def run_dir(tiny_hf, tmp_path):
    """A run directory with one checkpoint of a tiny qwen3_moe model (its initial weights)."""
    from ray_moe.worker.engine import Engine

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x * 2\n" * 100)
    cfg = Config.from_dict({
        "model": {"init_from": tiny_hf("qwen3_moe"), "seq_len": 16},
        "parallel": {"world_size": 1, "device": "cpu"}, "data": {"paths": [str(corpus)]},
        "train": {"batch_size": 2, "steps": 1, "run_dir": str(tmp_path / "run")},
    })
    engine = Engine(cfg, single_rank(), LocalTransport(), torch.device("cpu"), cfg.resolve_arch())
    staging = checkpoint.new_staging_dir(cfg.train.run_dir, 1)
    files = [checkpoint.write_shard(staging, 0, engine.shard_state())]
    checkpoint.commit(staging, {"step": 1, "opt_steps": 1, "world_size": 1, "config": cfg.to_dict(),
                                "hf_config": cfg.resolve_arch().hf_config}, files)
    return cfg.train.run_dir


def _users_model(out):
    out.mkdir(parents=True)
    (out / "config.json").write_text('{"model_type": "mine"}')
    (out / "model.safetensors").write_bytes(b"my weights")
    return {p.name: p.read_bytes() for p in out.iterdir()}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_non_empty_out_is_refused_and_left_as_it_was(run_dir, tmp_path, capsys):
    out = tmp_path / "model"
    before = _users_model(out)
    assert main(["export", run_dir, "--format", "hf", "--out", str(out)]) == 2
    line = _one_line(capsys)
    assert f"--out {str(out)!r} is not empty (it holds config.json, model.safetensors)" in line
    assert "--replace" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_replace_replaces_the_directory_whole(run_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "model"
    _users_model(out)
    assert main(["export", run_dir, "--format", "hf", "--out", str(out), "--replace"]) == 0
    files = capsys.readouterr().out.split("files: ")[1].strip().split(", ")
    assert sorted(p.name for p in out.iterdir()) == sorted(files)  # the old model.safetensors is gone
    assert "model.safetensors" not in files and json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    AutoModelForCausalLM.from_pretrained(str(out))  # loads the new shards, nothing stale
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("where", ["run", "checkpoint", "inside"])
def test_replace_never_touches_the_run_it_exports(run_dir, capsys, where):
    from pathlib import Path

    ckpt = sorted((Path(run_dir) / "checkpoints").glob("step_*"))[0]
    out = {"run": Path(run_dir), "checkpoint": ckpt, "inside": Path(run_dir) / "exported"}[where]
    if where == "inside":
        _users_model(out)
    before = sorted(str(p) for p in Path(run_dir).rglob("*"))
    assert main(["export", run_dir, "--format", "hf", "--out", str(out), "--replace"]) == 2
    assert "overlaps the checkpoint it exports" in _one_line(capsys)
    assert sorted(str(p) for p in Path(run_dir).rglob("*")) == before


def test_an_empty_out_is_used_without_replace(run_dir, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["export", run_dir, "--format", "hf", "--out", str(out)]) == 0
    assert (out / "config.json").is_file()


def test_a_full_disk_leaves_out_as_it_was(run_dir, tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        out = disk / "model"
        before = _users_model(out)
        assert main(["export", run_dir, "--format", "hf", "--out", str(out), "--replace"]) == 2
        line = _one_line(capsys)
        assert f"--out {str(out)!r}: cannot write the model there" in line and "is as it was" in line
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert sorted(p.name for p in disk.iterdir()) == ["model"]  # no temporary directory left
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["umount", str(disk)], capture_output=True)
