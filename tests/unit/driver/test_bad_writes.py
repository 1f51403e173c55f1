"""Writes that fail and names that are odd: a full disk is one line naming the path and the errno
with no half-written metrics line; a rerun of the same run that never checkpointed starts over
cleanly; SIGHUP stops like SIGTERM (checkpoint, then exit); a run directory with a non-ASCII name
gets an ASCII metric tag; a binary --config is one line."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ray_moe.driver.metrics as metrics_mod
import ray_moe.driver.trainer as trainer_mod
from ray_moe.config import ConfigError
from ray_moe.driver.errors import TrainingInterrupted, WriteError
from ray_moe.driver.loggers import metric_tag
from ray_moe.driver.metrics import MetricsLog, append_line
from ray_moe.driver.run_dir import RunDirError, plan_start, scan
from tests.support import small_config
from tests.unit.driver.stand_in import StandInGroup

REPO = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def _full_disk(tmp_path: Path):
    """A 64 KiB tmpfs at tmp_path/disk, filled up (skips where this process cannot mount one)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        (disk / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')  # its page has room for more
        with open(disk / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"x" * 4096)
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_full_disk_leaves_no_half_written_line_and_names_path_and_errno(tmp_path):
    with _full_disk(tmp_path) as disk:
        path = disk / "metrics.jsonl"
        before = path.read_bytes()
        with pytest.raises(WriteError) as info:
            append_line(path, json.dumps({"step": 2, "loss": 1.0, "pad": "y" * 20_000}) + "\n")
        assert path.read_bytes() == before  # the part that fitted was cut away
        assert f"cannot write {path}: No space left on device (ENOSPC)" in str(info.value)
        assert info.value.errno == errno.ENOSPC and "\n" not in str(info.value)


def test_a_write_that_fails_midway_is_cut_back_and_the_record_not_kept(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.start_fresh()
    log.record({"step": 1, "loss": 2.0})
    before = log.path.read_bytes()
    real_write = os.write

    def half_then_full(fd, data):  # as a disk that fills mid-line does
        if len(data) > 4:
            real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics_mod.os, "write", half_then_full)
    with pytest.raises(WriteError, match="ENOSPC"):
        log.record({"step": 2, "loss": 1.5})
    monkeypatch.undo()
    assert log.path.read_bytes() == before and [r["step"] for r in log.records] == [1]
    log.record({"step": 2, "loss": 1.5})  # space freed: the log goes on, whole lines only
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [1, 2]


def _trainer(tmp_path, monkeypatch, **over):
    monkeypatch.setattr(trainer_mod, "WorkerGroup", lambda config, world_size=None, arch=None: StandInGroup(2))
    monkeypatch.setattr(trainer_mod, "connect", lambda *a, **k: None)
    return trainer_mod.Trainer(small_config(tmp_path, **{"train.resume": "auto", **over}), progress=False)


def test_the_same_run_stopped_before_its_first_checkpoint_starts_over_and_another_is_refused(tmp_path, monkeypatch):
    with _trainer(tmp_path, monkeypatch) as t:
        t.step()
        t.step()  # then the disk filled at the first checkpoint: no checkpoint was saved
        run_dir = t.run_dir
    with _trainer(tmp_path, monkeypatch) as t:  # the same command again
        assert t.step_count == 0 and t.log.steps == []
        archived = list((run_dir / "archive").iterdir())
        assert len(archived) == 1 and len((archived[0] / "metrics.jsonl").read_text().splitlines()) == 2
        t.step()
    with pytest.raises(RunDirError, match="holds an earlier run with no checkpoint"):
        _trainer(tmp_path, monkeypatch, **{"train.lr": 1e-3})  # another config: not this run's to restart
    state = scan(run_dir)
    with pytest.raises(RunDirError):
        plan_start(state, "auto", False, same_config=False)
    assert plan_start(state, "auto", False, same_config=True) is None


def test_sighup_stops_like_sigterm_after_a_checkpoint(tmp_path, monkeypatch):
    saved = []
    with _trainer(tmp_path, monkeypatch, **{"train.steps": 6}) as t:
        t.save = lambda: saved.append(t.step_count) or t.run_dir
        step = t.group.call_each

        def hung_up_at_2(method, args, **kwargs):
            out = step(method, args, **kwargs)
            if t.group.step == 2:
                os.kill(os.getpid(), signal.SIGHUP)
            return out

        t.group.call_each = hung_up_at_2
        with pytest.raises(TrainingInterrupted, match="stopped by SIGHUP at step 2") as info:
            t.train()
        assert info.value.signum == signal.SIGHUP and saved == [2]
        assert t.log.events("preempted")[-1]["signal"] == "SIGHUP"
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # restored


@pytest.mark.parametrize("name", ["über-lauf", "训练", "run\u200b1"])
def test_a_run_name_ray_cannot_encode_gets_an_ascii_tag_that_stays_distinct(name):
    tag = metric_tag(name)
    assert tag.isascii() and tag.isprintable() and tag != metric_tag(name + "x")
    assert metric_tag("plain-run_1") == "plain-run_1"


def test_a_non_ascii_run_directory_trains_with_ray_metrics(tmp_path, monkeypatch):
    """Ray's gauge refuses a non-ASCII tag (UnicodeEncodeError at step 1 before): the sink's tag is
    ASCII, and a sink error never stops training."""
    from ray_moe.driver.loggers import RayMetricsSink

    with _trainer(tmp_path, monkeypatch, **{"train.run_dir": str(tmp_path / "läuft")}) as t:
        assert any(isinstance(s, RayMetricsSink) for s in t.log.sinks)
        t.step()
        assert t.step_count == 1 and t.run_dir.name == "läuft"


def test_a_binary_config_file_is_one_line(tmp_path):
    config = tmp_path / "model.bin"
    config.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    r = subprocess.run([sys.executable, "-m", "ray_moe.cli", "train", "--config", str(config)],
                       capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"ray-moe train: error: config file {str(config)!r} is not UTF-8 text (byte 0: "
                                "b'\\x89'); give a YAML file (e.g. jobs/tiny.yaml)")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        from ray_moe.config import Config

        Config.from_yaml(config)


def test_a_second_stop_signal_stops_at_once(tmp_path, monkeypatch):
    """A second signal stops at once, even inside the call in flight of a long evaluation."""
    with _trainer(tmp_path, monkeypatch, **{"train.steps": 2}) as t:
        steps = t.group.call_each

        def long_evaluation(method, args, **kwargs):
            if method.__name__ != "eval_sum":
                return steps(method, args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the user insists, within one call
            pytest.fail("the evaluation went on after the second signal")

        t.group.call_each = long_evaluation
        with pytest.raises(KeyboardInterrupt):
            t.train()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_under_nohup_sighup_stays_ignored(tmp_path, monkeypatch):
    """`nohup ray-moe train ...` asked the run to outlive the terminal: SIGHUP is not taken over."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _trainer(tmp_path, monkeypatch) as t, trainer_mod._StopOnSignal(t):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGHUP, previous)
