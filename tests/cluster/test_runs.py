"""Nothing lost, nothing hangs: reruns keep earlier results, corrupt checkpoints are named, all
corrupt + resume stops with the history intact, SIGTERM checkpoints before stopping, and a run
that loses workers three times ends with the weights of one that lost none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ray_moe.cli import main
from ray_moe.config import Config
from ray_moe.driver.run_dir import RunDirError
from ray_moe.driver.trainer import Trainer, TrainingInterrupted
from tests.support import small_config, write_config

REPO = Path(__file__).resolve().parents[2]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in _rows(run_dir) if "loss" in r]


def test_rerun_keeps_the_earlier_run_and_continues_it(groups, tmp_path):
    cfg = small_config(tmp_path, **{"train.steps": 3, "train.resume": "auto"})
    run = Path(cfg.train.run_dir)
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        t.train()
        first_loss = t.summary()["first_loss"]
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="holds an earlier run.*train.resume=auto"):
        Trainer(cfg.with_overrides(["train.resume=false"]), progress=False, group=groups(2))
    assert (run / "metrics.jsonl").read_text() == before  # refused: nothing touched
    # The same command again (resume: auto) continues the run to its new end.
    with Trainer(cfg.with_overrides(["train.steps=5"]), progress=False, group=groups(2)) as t:
        assert t.step_count == 3
        t.train()
        summary = t.summary()
    assert (run / "metrics.jsonl").read_text().startswith(before)  # appended, not rewritten
    assert _steps(run) == [1, 2, 3, 4, 5]
    assert summary["first_loss"] == first_loss  # the whole run, not the part after resuming


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_checkpoint_is_named_and_the_previous_one_used(groups, tmp_path, caplog):
    cfg = small_config(tmp_path, **{"train.steps": 4, "train.checkpoint_interval": 2})
    run = Path(cfg.train.run_dir)
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        t.train()
    bad = run / "checkpoints" / "step_00000004" / "rank00001.safetensors"
    _corrupt(bad)
    bad_bytes = bad.read_bytes()
    with Trainer(cfg.with_overrides(["train.resume=auto", "train.steps=6"]), progress=False,
                 group=groups(2)) as t:
        assert t.step_count == 2  # step 4's checkpoint is corrupt: step 2's is used
        t.train()
    warned = [r.getMessage() for r in caplog.records if "corrupt checkpoint" in r.getMessage()]
    assert len(warned) == 1 and "step_00000004/rank00001.safetensors" in warned[0] and "sha256" in warned[0]
    events = [r for r in _rows(run) if r.get("event") == "corrupt_checkpoint"]
    assert len(events) == 1 and events[0]["path"].endswith("corrupt-step_00000004") and "sha256" in events[0]["check"]
    assert events[0]["step"] == 4  # the corrupt checkpoint's step, not the run's at the time
    assert _steps(run) == [1, 2, 3, 4, 5, 6]  # steps 3-4 replayed once, not twice
    assert (run / "checkpoints" / "step_00000006").is_dir()
    # kept aside under a name of its own: the resumed run's own step 4 did not replace it
    assert (run / "checkpoints" / "corrupt-step_00000004" / "rank00001.safetensors").read_bytes() == bad_bytes
    assert (run / "checkpoints" / "step_00000004").is_dir()


def test_all_corrupt_with_resume_exits_2_naming_the_files(groups, tmp_path, monkeypatch, capsys):
    cfg = small_config(tmp_path, **{"train.steps": 2})
    run = Path(cfg.train.run_dir)
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        t.train()
    _corrupt(run / "checkpoints" / "step_00000002" / "rank00000.safetensors")
    history = (run / "metrics.jsonl").read_text()
    write_config(tmp_path / "cfg.yaml", cfg.with_overrides(["train.resume=true"]))
    monkeypatch.setenv("RAY_IGNORE_UNHANDLED_ERRORS", "0")  # the CLI sets it on an error: put back after
    assert main(["train", "--config", str(tmp_path / "cfg.yaml")]) == 2  # the CLI in this process: no worker
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint is valid" in err[0] and "step_00000002" in err[0], err
    assert (run / "metrics.jsonl").read_text() == history  # nothing restarted, nothing wiped


def test_sigterm_checkpoints_then_stops(groups, tmp_path):
    cfg = small_config(tmp_path, **{"train.steps": 5000})  # the signal comes ~1 s in, long before the end
    run = Path(cfg.train.run_dir)
    before = signal.getsignal(signal.SIGTERM)
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        with pytest.raises(TrainingInterrupted) as info:
            t.train()
        timer.join()
        stopped = t.step_count
    assert info.value.signum == signal.SIGTERM and 0 < stopped < 5000
    assert info.value.checkpoint == run / "checkpoints" / f"step_{stopped:08d}"
    assert [r for r in _rows(run) if r.get("event") == "preempted"][0]["step"] == stopped
    assert signal.getsignal(signal.SIGTERM) is before  # the handler was put back
    with Trainer(cfg.with_overrides(["train.resume=auto"]), progress=False, group=groups(2)) as t:
        assert t.step_count == stopped


def test_sigterm_during_a_long_final_evaluation_stops_within_seconds(ray_cluster, tmp_path, monkeypatch, capsys):
    """`ray-moe train` with a final evaluation of a million batches (hours here): one SIGTERM
    during it ends the command within seconds with exit code 143, the last step checkpointed and
    the evaluation recorded as interrupted, not as a result (it took 0.4 s on 2026-12-07; one call
    over all batches held the stop for the whole evaluation)."""
    batches = 1_000_000
    cfg = small_config(tmp_path, **{"train.steps": 2, "train.eval_interval": 0, "train.eval_batches": batches,
                                    "train.log_every_s": 0.5, "train.progress": "lines"})
    run = Path(cfg.train.run_dir)
    write_config(tmp_path / "cfg.yaml", cfg)
    sent: dict[str, float] = {}
    finished = threading.Event()

    def stop_during_the_final_evaluation():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not finished.is_set():
            try:
                if 2 in _steps(run):
                    break
            except (OSError, ValueError):  # not there yet, or a line half-written
                pass
            time.sleep(0.1)
        finished.wait(3.0)  # the last step is recorded: the evaluation is under way (or: never hang)
        if not finished.is_set():
            sent["at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setenv("RAY_IGNORE_UNHANDLED_ERRORS", "0")  # the CLI may set it: put back after
    stopper = threading.Thread(target=stop_during_the_final_evaluation, daemon=True)
    stopper.start()
    try:
        code = main(["train", "--config", str(tmp_path / "cfg.yaml")])
    finally:
        finished.set()
    exited = time.monotonic()
    stopper.join()
    out = capsys.readouterr().out
    assert "at" in sent and code == 128 + signal.SIGTERM, (code, out[-2000:])
    assert exited - sent["at"] < 20, exited - sent["at"]  # the evaluation alone would take hours
    rows = _rows(run)
    (stopped,) = [r for r in rows if r.get("event") == "eval_interrupted"]
    assert stopped["step"] == 2 and 0 < stopped["batches_done"] < batches and stopped["signal"] == "SIGTERM"
    assert not [r for r in rows if "val_loss" in r]
    checkpoint = run / "checkpoints" / "step_00000002"
    assert [r["checkpoint"] for r in rows if r.get("event") == "preempted"] == [str(checkpoint)]
    assert (checkpoint / "meta.json").is_file()
    assert f"final evaluation: {batches} batches" in out and f"/{batches} batches (" in out  # progress shown


def _state(worker):
    return {k: v for k, v in worker.engine.shard_state().items() if not k.startswith("rng.")}


def _kill_at(trainer: Trainer, steps: list[int], timeout: float = 180) -> threading.Thread:
    """Kill one worker (rank alternating) when the run first reaches each of ``steps``."""
    def run():
        deadline = time.monotonic() + timeout
        for i, step in enumerate(steps):
            while trainer.step_count < step and time.monotonic() < deadline:
                time.sleep(0.01)
            group = trainer.group
            if group is None:
                continue
            os.kill(group.ranks[i % group.world_size].pid, signal.SIGKILL)
            while trainer.step_count >= step and time.monotonic() < deadline:  # wait for the rewind
                time.sleep(0.01)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_soak_worker_kills_end_with_the_uninterrupted_weights(groups, ray_cluster, tmp_path):
    """Both ranks killed in turn, the second kill the last failure train.max_failures allows."""
    common = {"train.steps": 9, "train.checkpoint_interval": 2, "train.max_failures": 2}
    with Trainer(small_config(tmp_path / "calm", **common), progress=False, group=groups(2)) as t:
        t.train()
        calm = {}
        for shard in t.group.execute(_state):
            calm.update(shard)
        calm_losses = [m["loss"] for m in t.metrics if "loss" in m]
    stormy_cfg = small_config(tmp_path / "stormy", **common)
    with Trainer(stormy_cfg, progress=False) as t:  # its own group: this one gets killed
        first_victim = t.group.ranks[0]
        killer = _kill_at(t, [3, 7])
        t.train()
        killer.join()
        stormy = {}
        for shard in t.group.execute(_state):
            stormy.update(shard)
        failures = [m for m in t.metrics if m.get("event") == "failure"]
        recovered = [m for m in t.metrics if m.get("event") == "recovered"]
        losses = [m["loss"] for m in t.metrics if "loss" in m]
    # each dead worker is named (rank, node, pid), not a peer's collective error
    assert len(failures) == 2 and {f["cause"] for f in failures} == {"died"}
    assert failures[0]["rank"] == 0 and failures[0]["pid"] == first_victim.pid
    assert failures[0]["node_id"] == first_victim.node_id and f"pid {first_victim.pid}" in failures[0]["message"]
    assert [r["step"] for r in recovered] == [2, 6]  # the run's last checkpoint before each kill
    assert failures[1]["rank"] == 1
    assert losses == calm_losses  # each step once (in memory and in the file), bit-identical
    assert _steps(tmp_path / "stormy" / "run") == list(range(1, 10))
    assert set(stormy) == set(calm)
    for k in calm:
        assert torch.equal(stormy[k], calm[k]), k


def _train_cli(cfg, tmp_path, address: str) -> subprocess.CompletedProcess:
    write_config(tmp_path / "cfg.yaml", cfg)
    return subprocess.run([sys.executable, "-m", "ray_moe.cli", "train", "--config", str(tmp_path / "cfg.yaml"),
                           "--address", address], capture_output=True, text=True, timeout=180, cwd=tmp_path)


def _one_error_line(r: subprocess.CompletedProcess, start: str) -> str:
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "\tINFO " not in line]  # Ray's connection notes
    assert len(errors) == 1 and errors[0].startswith(start), r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "Unhandled error" not in r.stdout + r.stderr
    return errors[0]


def test_an_error_the_workers_raise_is_one_line(ray_cluster, tmp_path):
    """Past the driver's checks (weights without the model's tensors), every rank raises and the
    user still sees the project's one line, exit 2, and neither Ray's "Unhandled error" nor a
    traceback (a missing data path, refused on the driver before any worker starts:
    tests/unit/test_cli.py)."""
    from ray_moe import arch

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(arch.preset("qwen3_moe-tiny")))
    # a readable file (the driver reads its header) without the model's tensors: the workers refuse it
    save_file({"unrelated": torch.zeros(2)}, str(model / "model.safetensors"))
    raw = small_config(tmp_path).to_dict()
    raw["model"] = {"init_from": str(model), "seq_len": 32}  # the sizes are the HF config's
    raw["moe"] = {"aux_loss_coef": 0.0}
    cfg = Config.from_dict(raw)
    _one_error_line(_train_cli(cfg, tmp_path, ray_cluster), "ray-moe train: error: workers could not build")
