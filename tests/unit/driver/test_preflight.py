"""Checks on the driver before any worker starts: one line naming the key, the value and what is
allowed, at once (the workers would refuse the same inputs after seconds of start-up)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ray_moe import arch
from ray_moe.config import Config, ConfigError
from ray_moe.data.errors import DataError
from ray_moe.driver.preflight import check_init_from, preflight
from ray_moe.driver.trainer import Trainer
from tests.support import small_config

NOWHERE = "127.0.0.1:9"  # a Trainer that got past its checks would fail here, not start Ray


def test_a_missing_data_path_is_refused_before_any_worker(tmp_path):
    cfg = small_config(tmp_path, **{"data.paths": str(tmp_path / "nope.txt")})
    with pytest.raises(DataError, match="nope.txt' does not exist"):
        Trainer(cfg, address=NOWHERE, progress=False)


def test_a_binary_data_path_is_refused_before_any_worker(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 1000)
    cfg = small_config(tmp_path, **{"data.paths": str(tmp_path / "blob.bin")})
    with pytest.raises(DataError, match="blob.bin' is not text"):
        Trainer(cfg, address=NOWHERE, progress=False)


def test_a_large_corpus_is_checked_on_its_first_part(tmp_path, monkeypatch):
    import ray_moe.driver.preflight as pf

    monkeypatch.setattr(pf, "DRIVER_READ_BYTES", 1000)
    (tmp_path / "a.txt").write_text("text " * 1000)
    (tmp_path / "b.txt").write_bytes(b"\x00" * 100)  # past the first part: left to the workers
    cfg = small_config(tmp_path, **{"data.paths": str(tmp_path), "data.max_bytes": 0})
    preflight(cfg, cfg.resolve_arch())


def _model_dir(tmp_path, **changes):
    hf = arch.preset("qwen3_moe-tiny") | changes
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))  # a readable header: its tensors are the workers' to read
    return d


def test_init_from_weights_that_are_not_safetensors_are_named_before_any_worker(tmp_path):
    d = _model_dir(tmp_path)
    cfg = Config().with_overrides([f"model.init_from={d}"])
    (d / "model.safetensors").write_bytes(b"not safetensors" * 10)
    with pytest.raises(ConfigError, match=r"model.init_from: .*/model.safetensors is not a readable safetensors "
                                          r"file \(.*\); expected weights as transformers' save_pretrained"):
        check_init_from(cfg, cfg.resolve_arch())
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match=r"model-00001-of-00002.safetensors, listed in model.safetensors.index.json, "
                                          "does not exist"):
        check_init_from(cfg, cfg.resolve_arch())
    save_file({"a": torch.zeros(1)}, str(d / "model-00001-of-00002.safetensors"))
    check_init_from(cfg, cfg.resolve_arch())
    (d / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ConfigError, match="is not a safetensors index with a weight_map"):
        check_init_from(cfg, cfg.resolve_arch())


def test_init_from_that_does_not_exist_says_so(tmp_path):
    with pytest.raises(ConfigError, match="model.init_from='.*/gone' does not exist; expected a Hugging Face"):
        Config().with_overrides([f"model.init_from={tmp_path / 'gone'}"])
    cfg = Config().with_overrides(["model.hf_config=qwen3_moe-tiny"])
    cfg.model.init_from = str(tmp_path / "gone")  # with hf_config, config validation passes: the driver says it
    with pytest.raises(ConfigError, match="model.init_from='.*/gone' does not exist"):
        check_init_from(cfg, cfg.resolve_arch())
    (tmp_path / "file").write_text("")
    cfg.model.init_from = str(tmp_path / "file")
    with pytest.raises(ConfigError, match="is a file; expected a Hugging Face model directory"):
        check_init_from(cfg, cfg.resolve_arch())


def test_init_from_whose_config_differs_from_hf_config_names_the_conflict_and_the_fix(tmp_path):
    d = _model_dir(tmp_path, hidden_size=arch.preset("qwen3_moe-tiny")["hidden_size"] * 2)
    cfg = Config().with_overrides(["model.hf_config=qwen3_moe-tiny"])
    cfg.model.init_from = str(d)
    with pytest.raises(ConfigError, match=r"differs from model.hf_config='qwen3_moe-tiny' \(hidden_size .* there, "
                                          r".* in model.hf_config.*clear model.hf_config"):
        check_init_from(cfg, cfg.resolve_arch())
    (d / "config.json").write_text(json.dumps(arch.preset("qwen3_moe-tiny")))
    check_init_from(cfg, cfg.resolve_arch())  # the same config: taken
    (d / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="holds no weights \\(neither model.safetensors nor model.safetensors.index.json"):
        check_init_from(cfg, cfg.resolve_arch())


def test_arch_of_an_unknown_source_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "ray_moe.arch", "UNKNOWN"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "neither a preset" in r.stderr


def test_a_refused_input_leaves_no_run_directory(tmp_path, fresh_driver):
    cfg = small_config(tmp_path, **{"data.paths": str(tmp_path / "nope.txt")})
    with pytest.raises(DataError):
        Trainer(cfg, address=NOWHERE, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_start_that_fails_after_its_checks_leaves_no_files_behind(tmp_path, fresh_driver):
    """Past the checks (here: nothing listens at the address) a fresh run that wrote nothing removes
    its own lock file and empty metrics.jsonl, and the run directory if it made it; a directory
    that holds anything else is left as it is."""
    from ray_moe.driver.group import GroupError

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on\n" * 100)
    cfg = small_config(tmp_path, **{"data.paths": str(corpus)})
    with pytest.raises(GroupError, match="nothing listens"):
        Trainer(cfg, address=NOWHERE, progress=False)
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(GroupError, match="nothing listens"):
        Trainer(cfg, address=NOWHERE, progress=False)
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_an_overwritten_runs_corrupt_checkpoint_is_archived_not_reported_as_this_runs(tmp_path, caplog, monkeypatch):
    import ray_moe.driver.trainer as trainer_mod
    from tests.unit.driver.stand_in import StandInGroup

    monkeypatch.setattr(trainer_mod, "WorkerGroup", lambda config, world_size=None, arch=None: StandInGroup(2))
    monkeypatch.setattr(trainer_mod, "connect", lambda *a, **k: None)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on\n" * 100)
    bad = tmp_path / "run" / "checkpoints" / "step_00000004"
    bad.mkdir(parents=True)
    (bad / "meta.json").write_text("{")  # corrupt
    cfg = small_config(tmp_path, **{"data.paths": str(corpus), "train.overwrite": True})
    Trainer(cfg, progress=False).close()
    assert list((tmp_path / "run" / "archive").glob("*/checkpoints/step_00000004/meta.json"))
    assert "corrupt" not in (tmp_path / "run" / "metrics.jsonl").read_text() and "skipping corrupt" not in caplog.text
