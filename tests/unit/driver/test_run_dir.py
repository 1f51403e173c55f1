"""The run directory rules: nothing an earlier run wrote is lost, every refusal is one line."""

from __future__ import annotations

import json

import pytest

from ray_moe.config import TrainConfig
from ray_moe.driver.run_dir import (
    RunDirError,
    archive_results,
    plan_start,
    resolve_run_dir,
    scan,
)


def _checkpoint(run_dir, step, corrupt=False):
    d = run_dir / "checkpoints" / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "rank00000.safetensors").write_bytes(b"x" * 8)
    import hashlib

    sha = hashlib.sha256(b"x" * 8).hexdigest()
    meta = {"step": step, "files": [{"file": "rank00000.safetensors", "bytes": 8, "sha256": sha}]}
    (d / "meta.json").write_text(json.dumps(meta))
    if corrupt:
        (d / "rank00000.safetensors").write_bytes(b"y" * 8)
    return d


def _metrics(run_dir, steps):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps))


def test_an_empty_or_new_directory_starts_fresh(tmp_path):
    for resume in ("auto", "false"):
        assert plan_start(scan(tmp_path), resume, overwrite=False) is None
    with pytest.raises(RunDirError, match="holds no checkpoint to resume from"):
        plan_start(scan(tmp_path), "true", overwrite=False)


def test_an_earlier_run_is_continued_or_refused_never_overwritten(tmp_path):
    _metrics(tmp_path, [1, 2, 3])
    good = _checkpoint(tmp_path, 2)
    assert plan_start(scan(tmp_path), "auto", False) == good
    assert plan_start(scan(tmp_path), "true", False) == good
    with pytest.raises(RunDirError) as info:
        plan_start(scan(tmp_path), "false", False)
    msg = str(info.value)
    assert "holds an earlier run" in msg and "3 step records" in msg and "train.resume=auto" in msg
    assert "train.overwrite=true" in msg and "\n" not in msg
    assert plan_start(scan(tmp_path), "false", True) is None  # the caller archives first


def test_corrupt_checkpoints_are_named_and_skipped(tmp_path):
    _metrics(tmp_path, [1, 2, 3, 4])
    good = _checkpoint(tmp_path, 2)
    bad = _checkpoint(tmp_path, 4, corrupt=True)
    state = scan(tmp_path)
    assert state.valid == [good] and [p for p, _ in state.corrupt] == [bad]
    assert "sha256" in state.corrupt[0][1] and "rank00000.safetensors" in state.corrupt[0][1]
    assert plan_start(state, "auto", False) == good


def test_all_corrupt_and_resume_asked_names_the_files_and_changes_nothing(tmp_path):
    _metrics(tmp_path, [1, 2])
    _checkpoint(tmp_path, 2, corrupt=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for resume in ("true", "auto"):
        with pytest.raises(RunDirError, match="step_00000002.*sha256"):
            plan_start(scan(tmp_path), resume, False)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_metrics_without_a_checkpoint_are_not_overwritten(tmp_path):
    _metrics(tmp_path, [1])
    with pytest.raises(RunDirError, match="no checkpoint to continue from"):
        plan_start(scan(tmp_path), "auto", False)


def test_overwrite_moves_results_to_the_archive(tmp_path):
    _metrics(tmp_path, [1, 2])
    _checkpoint(tmp_path, 2)
    (tmp_path / "loss.png").write_bytes(b"png")
    (tmp_path / "notes.txt").write_text("the user's own file")
    dest = archive_results(tmp_path)
    assert dest.parent == tmp_path / "archive"
    assert (dest / "metrics.jsonl").is_file() and (dest / "checkpoints" / "step_00000002").is_dir()
    assert (dest / "loss.png").is_file() and (tmp_path / "notes.txt").is_file()
    assert not scan(tmp_path).has_results


def test_run_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert resolve_run_dir(TrainConfig(run_dir="runs/a")) == tmp_path / "runs" / "a"
    assert resolve_run_dir(TrainConfig(run_dir="a", storage_path=str(tmp_path / "shared"))) == tmp_path / "shared" / "a"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "."}}))
    with pytest.raises(RunDirError, match="relative and this driver runs as a Ray job"):
        resolve_run_dir(TrainConfig(run_dir="runs/a"))
    assert resolve_run_dir(TrainConfig(run_dir=str(tmp_path / "abs"))) == tmp_path / "abs"


def test_run_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(RunDirError, match="train.run_dir=.*taken/run is not a writable directory"):
        resolve_run_dir(TrainConfig(run_dir=str(tmp_path / "taken" / "run")))


def test_a_second_run_into_a_run_directory_is_refused_naming_the_first(tmp_path):
    """One writer per run directory: while a run (here another process) holds the directory, a
    Trainer into it is refused before it reads or changes anything, naming the holder's pid and
    host; once that run ends, the directory is free again."""
    import socket
    import subprocess
    import sys

    from ray_moe.driver.trainer import Trainer
    from tests.support import small_config

    cfg = small_config(tmp_path, **{"train.resume": "auto"})
    run = tmp_path / "run"
    run.mkdir()
    _metrics(run, [1, 2])
    from ray_moe.driver.run_dir import RUN_LOCK

    holder = subprocess.Popen(  # the run's lock as lock_run_dir takes it, in a process without torch (fast)
        [sys.executable, "-c", "import sys, pathlib; from ray_moe import dirlock; "
         "fh = dirlock.take(pathlib.Path(sys.argv[1]) / sys.argv[2], 'training run'); dirlock.announce(fh); "
         "print('held', flush=True); "
         "sys.stdin.read()", str(run), RUN_LOCK],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p.name: p.read_bytes() for p in run.iterdir()}
        with pytest.raises(RunDirError, match=f"in use by another run \\(pid {holder.pid} on "
                                              f"{socket.gethostname()}\\).*nothing was changed"):
            Trainer(cfg, progress=False)
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    from ray_moe.driver.run_dir import lock_run_dir

    lock_run_dir(run).close()  # the holder ended: its lock went with it


def test_a_lock_is_one_per_open_file_even_in_one_process(tmp_path):
    from ray_moe.driver.run_dir import lock_run_dir

    first = lock_run_dir(tmp_path)
    with pytest.raises(RunDirError, match="in use by another run"):
        lock_run_dir(tmp_path)
    first.close()
    lock_run_dir(tmp_path).close()


def test_a_lock_file_that_cannot_be_opened_is_one_line_naming_it(tmp_path):
    """A .run.lock this process cannot open (here a directory; on shared storage, another user's
    file) is a RunDirError naming the file and the reason, not a traceback."""
    from ray_moe.driver.run_dir import RUN_LOCK, lock_run_dir

    (tmp_path / RUN_LOCK).mkdir()
    with pytest.raises(RunDirError, match=rf"{RUN_LOCK} cannot be opened for writing: Is a directory.*remove or fix"):
        lock_run_dir(tmp_path)


def test_corrupt_checkpoints_are_set_aside_under_a_name_of_their_own(tmp_path):
    from ray_moe.driver.run_dir import checkpoint_step, corrupt_aside, set_aside

    bad = _checkpoint(tmp_path, 4, corrupt=True)
    good = _checkpoint(tmp_path, 2)
    state = scan(tmp_path)
    assert state.valid == [good] and [p for p, _ in state.corrupt] == [bad]
    aside = set_aside(bad)
    assert aside.name == "corrupt-step_00000004" and not bad.exists() and checkpoint_step(aside) == 4
    again = _checkpoint(tmp_path, 4, corrupt=True)  # the same step corrupt twice: both kept
    assert set_aside(again).name == "corrupt-step_00000004.1"
    assert set_aside(aside) == aside  # already aside: left alone
    state = scan(tmp_path)
    assert state.valid == [good] and state.corrupt == []  # not a checkpoint any more, and not deleted
    assert [p.name for p in corrupt_aside(tmp_path)] == ["corrupt-step_00000004", "corrupt-step_00000004.1"]
    (tmp_path / "checkpoints" / "step_00000002").rename(tmp_path / "elsewhere")
    assert scan(tmp_path).has_results  # only corrupt ones left aside: still an earlier run's results


def test_a_run_that_fails_after_taking_the_lock_releases_it(tmp_path, monkeypatch):
    """Whatever fails after the run directory is locked (here the metrics sinks; likewise
    archiving an earlier run, the metrics log, writing config.yaml) closes the Trainer and
    releases the lock at once, not when the half-built Trainer is garbage (the traceback holds it)."""
    import ray_moe.driver.trainer as trainer_mod
    from ray_moe.driver.run_dir import lock_run_dir
    from tests.support import small_config

    cfg = small_config(tmp_path)

    def no_sinks(*_a, **_k):
        raise OSError("no space left on device")

    monkeypatch.setattr(trainer_mod, "make_sinks", no_sinks)
    with pytest.raises(OSError, match="no space") as info:
        trainer_mod.Trainer(cfg, progress=False)
    assert info.value.__traceback__ is not None  # the failed Trainer's frame is still referenced
    lock_run_dir(resolve_run_dir(cfg.train)).close()
