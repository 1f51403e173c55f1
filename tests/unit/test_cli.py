"""The CLI's answers to inputs users have: one line naming what was wrong and what is allowed,
exit 2, nothing lost (commands that need no cluster)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from ray_moe import checkpoint
from ray_moe.cli import main
from ray_moe.config import Config


def _checkpoint(run_dir, step, config: Config):
    staging = checkpoint.new_staging_dir(run_dir, step)
    files = [checkpoint.write_shard(staging, 0, {"x": torch.zeros(1)})]
    hf = config.model.resolve_hf()[1] if config.model.arch != "byte" else None
    return checkpoint.commit(staging, {"step": step, "opt_steps": step, "world_size": 1,
                                       "config": config.to_dict(), "hf_config": hf}, files)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_export_to_an_existing_file_is_refused(tmp_path, capsys):
    (tmp_path / "model.bin").write_text("mine")
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "model.bin")]) == 2
    line = _one_line(capsys)
    assert line.startswith("ray-moe export: error: --out") and "is a file; give a directory" in line
    assert (tmp_path / "model.bin").read_text() == "mine"


def test_export_of_a_run_whose_checkpoints_are_corrupt_names_them(tmp_path, capsys):
    cfg = Config().with_overrides(["model.hf_config=qwen3_moe-tiny"])
    ckpt = _checkpoint(tmp_path / "run", 2, cfg)
    (ckpt / "rank00000.safetensors").write_bytes(b"changed")
    (tmp_path / "run" / "checkpoints" / "corrupt-step_00000001").mkdir()
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys)
    assert "holds no valid checkpoint (step_00000002: checkpoint file" in line and "corrupt-step_00000001" in line
    assert main(["export", str(tmp_path / "gone"), "--format", "hf", "--out", str(tmp_path / "o")]) == 2
    assert "'" + str(tmp_path / "gone") + "' does not exist" in _one_line(capsys)
    assert not (tmp_path / "o").exists()


def test_exported_files_are_readable_as_the_umask_allows(tmp_path, monkeypatch, capsys):
    import ray_moe.model.hf as hf

    def owner_only(out, *args, **kwargs):  # as safetensors writes its files
        out.mkdir(parents=True, exist_ok=True)
        os.close(os.open(out / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600))
        return {"files": ["model.safetensors"], "tensors": 1, "bytes": 4}

    monkeypatch.setattr(hf, "write_hf_dir", owner_only)
    cfg = Config().with_overrides(["model.hf_config=qwen3_moe-tiny"])
    _checkpoint(tmp_path / "run", 2, cfg)
    old = os.umask(0o022)
    try:
        assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "o")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "o" / "model.safetensors").stat().st_mode) == 0o644


def test_train_with_a_directory_as_config_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path)]) == 2
    assert "is a directory; give a YAML file" in _one_line(capsys)


@pytest.mark.parametrize("value", ["off", "lines"])
def test_progress_values_documented_are_taken_by_the_cli(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"train:\n  progress: {value}\n")
    assert Config.from_yaml(path, [f"train.progress={value}"]).train.progress == value


def test_a_command_started_with_sigint_ignored_is_still_stopped_by_it(tmp_path, monkeypatch, capsys):
    """Scripts start background jobs with SIGINT ignored; `kill -INT` must stop prepare anyway."""
    import signal

    import ray_moe.cli as cli

    def interrupted(args):
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.raise_signal(signal.SIGINT)
        raise AssertionError("SIGINT did not stop the command")

    monkeypatch.setattr(cli, "_prepare", interrupted)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert cli.main(["prepare", "--input", "x", "--tokenizer", "t", "--out", str(tmp_path / "o")]) == 130
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # put back as it was
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "ray-moe prepare: interrupted" in capsys.readouterr().err


def test_a_malformed_json_line_is_named_by_file_and_line(tmp_path, capsys):
    import json

    from ray_moe.data.inputs import JSONL, resolve_inputs
    from ray_moe.data.prepare import bad_row

    path = tmp_path / "a.jsonl"
    rows = [json.dumps({"text": f"row {i} " * 20}) for i in range(2000)]  # past the first 64 KiB checked first
    path.write_text("\n".join(rows[:1500] + ['{"text": broken'] + rows[1500:] + ["[1, 2]"]) + "\n")
    assert bad_row(JSONL, resolve_inputs([str(path)])) == (
        f"{path}:1501: not valid JSON (Expecting value column 10); each line of a .jsonl file must be one JSON object")
    assert main(["tokenizer", "train", "--vocab-size", "300", "--input", str(path), "--out", str(tmp_path / "t")]) == 2
    assert f"{path}:1501: not valid JSON" in _one_line(capsys)
    path.write_text("\n".join(rows + ["[1, 2]"]) + "\n")
    assert bad_row(JSONL, resolve_inputs([str(path)])).startswith(f"{path}:2001: a JSON list, not an object")


def test_a_run_past_train_steps_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """A rerun asking for fewer steps than its run has taken (``(step 50 of 20)``) would train
    nothing and rewrite the run's config.yaml: one line, exit 2, nothing started or changed."""
    import hashlib
    import json

    import ray_moe.driver.trainer as trainer_module

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000050"
    ckpt.mkdir(parents=True)
    (ckpt / "rank00000.safetensors").write_bytes(b"x" * 8)
    files = [{"file": "rank00000.safetensors", "bytes": 8, "sha256": hashlib.sha256(b"x" * 8).hexdigest()}]
    (ckpt / "meta.json").write_text(json.dumps({"step": 50, "files": files}))
    (run / "config.yaml").write_text("train: {steps: 50}\n")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}

    def no_trainer(*_a, **_k):
        raise AssertionError("a Trainer was started")

    monkeypatch.setattr(trainer_module, "Trainer", no_trainer)
    (tmp_path / "c.yaml").write_text(f"train: {{steps: 20, run_dir: {run}}}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is already at step 50, past train.steps=20: no step would be trained; set " \
        "train.steps above 50" in err[0], err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    (tmp_path / "c.yaml").write_text(f"train: {{steps: 20, run_dir: {run}, overwrite: true}}\n")
    with pytest.raises(AssertionError, match="a Trainer was started"):  # overwrite: not refused here
        main(["train", "--config", str(tmp_path / "c.yaml")])


def test_the_data_commands_outputs_are_not_left_untracked():
    """docs/DATA.md's commands write tok/ and data/ at the repository root: ignored there only
    (ray_moe/data/ is source)."""
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().split()
    assert "/tok/" in lines and "/data/" in lines and "data/" not in lines


def test_a_missing_data_path_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAY_IGNORE_UNHANDLED_ERRORS", "0")  # the CLI sets it on an error: put back after
    (tmp_path / "c.yaml").write_text(f"data: {{paths: [{tmp_path / 'nope.txt'}]}}\n"
                                     f"train: {{run_dir: {tmp_path / 'run'}}}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--address", "127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ray-moe train: error: data.paths: ") and \
        "nope.txt' does not exist" in err[0], err
    assert not (tmp_path / "run").exists()



def test_single_gpu_benchmarks_run_without_ray():
    """`ray-moe bench layer` needs no cluster: without Ray importable (a GPU machine carrying only
    SonicMoE's wheels) it still answers, here with its one-line error for a bad section."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['ray'] = None\n"  # `import ray` now raises ImportError
            "from ray_moe.cli import main\n"
            "sys.exit(main(['bench', 'layer', '--sections', 'nope']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2, done.stderr
    assert "--sections: unknown nope" in done.stderr and "Traceback" not in done.stderr, done.stderr
