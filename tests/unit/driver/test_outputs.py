"""What a run leaves for people to read: metrics.jsonl with each step once, progress lines made
for logs, TensorBoard event files; and addresses that cannot work fail fast in one line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_moe.driver.group import GroupError, connect
from ray_moe.driver.loggers import TensorBoardSink
from ray_moe.driver.metrics import MetricsLog
from ray_moe.driver.progress import Progress

REPO = Path(__file__).resolve().parents[3]


def _step(step, loss=1.0):
    return {"step": step, "loss": loss, "tokens_per_s": 10.0, "step_time": 0.5, "lr": 0.1, "skipped": False,
            "imbalance": 1.0}


def test_rewind_keeps_each_step_once_and_the_history(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.start_fresh()
    for s in (1, 2, 3, 4):
        log.record(_step(s, loss=10.0 - s))
    log.event("checkpoint", step=2)
    log.event("failure", step=4, rank=1)
    assert log.rewind(2) == 2  # steps 3 and 4 go; the failure stays (it happened)
    log.record(_step(3, loss=6.5))
    again = MetricsLog(tmp_path / "metrics.jsonl")
    again.load()
    steps = [r["step"] for r in again.records if "loss" in r]
    assert steps == [1, 2, 3] and again.records[-1]["loss"] == 6.5
    assert [r["event"] for r in again.records if "event" in r] == ["checkpoint", "failure"]
    assert again.summary()["first_loss"] == 9.0  # the whole run's first step


def test_load_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_step(1)) + "\n" + '{"step": 2, "lo')
    log = MetricsLog(path)
    log.load()
    assert [r["step"] for r in log.records] == [1]


def test_progress_for_logs_is_plain_lines_without_carriage_returns():
    out = io.StringIO()  # not a terminal
    p = Progress("auto", start=0, target=25, log_interval=10, log_every_s=3600, stream=out)
    for s in range(1, 26):
        p.update(_step(s))
    p.message("eval at step 25: val_loss 1.0000")
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.strip().splitlines()
    assert [ln.split()[1] for ln in lines[:-1]] == ["10/25", "20/25", "25/25"]
    assert lines[-1] == "eval at step 25: val_loss 1.0000"


def test_tensorboard_event_file_is_written_and_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    for s in (1, 2, 3):
        sink.write(_step(s, loss=3.0 - s))
    sink.write({"event": "eval", "step": 3, "val_loss": 0.5})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert [e.value for e in acc.Scalars("eval/loss")] == [0.5]


@pytest.mark.parametrize("address,match", [
    ("127.0.0.1:1", "nothing listens at --address '127.0.0.1:1'"),
    ("no-such-host.invalid:6379", "does not resolve"),
    ("localhost", "is not HOST:PORT"),
])
def test_unusable_addresses_fail_fast_naming_the_address(address, match, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh driver process
    t0 = time.monotonic()
    with pytest.raises(GroupError, match=match):
        connect(address, timeout_s=5)
    assert time.monotonic() - t0 < 6


def test_cli_with_an_unreachable_address_exits_2_in_one_line(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ray_moe.cli", "train", "--config", "jobs/tiny.yaml",
                        "--address", "127.0.0.1:1", f"train.run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "nothing listens at --address '127.0.0.1:1'" in err[0], err
    assert time.monotonic() - t0 < 60


def test_wandb_logger_without_the_package_is_one_line(tmp_path, monkeypatch):
    from ray_moe.config import Config, ConfigError
    from ray_moe.driver.loggers import make_sinks

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match="train.loggers includes wandb but the wandb package is not installed"):
        make_sinks(Config().with_overrides(["train.loggers=[wandb]"]), tmp_path)
