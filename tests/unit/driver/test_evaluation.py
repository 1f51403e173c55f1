"""Evaluation in chunks of batches: the result has the bits of one call over all batches (a real
engine, and the loop it ran in one call up to c621586); a stop signal during a final evaluation
of a billion batches ends it after the call in flight, records it as ``eval_interrupted`` (never
as an ``eval``), checkpoints and raises TrainingInterrupted; a long evaluation prints progress."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import ray_moe.driver.trainer as trainer_mod
from ray_moe.comm.local import LocalTransport
from ray_moe.driver.errors import TrainingInterrupted
from ray_moe.driver.evaluation import EvaluationStopped, ProgressLines, evaluate_in_chunks, next_chunk
from ray_moe.worker.engine import Engine
from tests.support import single_rank, small_config
from tests.unit.driver.stand_in import StandInGroup


def test_chunks_start_at_one_batch_grow_at_most_twofold_and_fit_the_call_time():
    assert next_chunk(0, 100, 0, 0.0, 0.5, 1024) == 1  # the first call measures the pace
    assert next_chunk(1, 100, 1, 0.001, 0.5, 1024) == 2  # fast: at most twice the last call's
    assert next_chunk(10, 100, 8, 0.1, 0.5, 1024) == 16
    assert next_chunk(10, 100, 40, 1.0, 0.5, 1024) == 20  # 40 batches took 1 s: 20 fit in 0.5 s
    assert next_chunk(10, 100, 4, 60.0, 0.5, 1024) == 1  # slower than a call's time: one batch
    assert next_chunk(10, 100, 64, 0.0, 0.5, 32) == 32  # at most `most`
    assert next_chunk(95, 100, 8, 0.01, 0.5, 1024) == 5  # never past the end


class _OneRank:
    """A group of one rank that runs its calls on an in-process engine."""

    world_size = 1

    def __init__(self, engine: Engine) -> None:
        self.engine, self.ranges = engine, []

    def call_each(self, method, args_per_rank, timeout=None):
        if method.__name__ == "eval_sum":
            self.ranges.append(args_per_rank[0][:2])
        return [getattr(self.engine, method.__name__)(*args) for args in args_per_rank]


@torch.no_grad()
def _one_call_as_before(engine: Engine, n: int) -> float:
    """Engine.evaluate as it was up to c621586 (one call, W = 1)."""
    engine.model.eval()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        x, y = engine.batch("val", i)
        ce, _ = engine.loss(x, y)
        total += ce.double().cpu()
    return float(total) / n


def test_chunked_evaluation_has_the_bits_of_one_call(tmp_path):
    cfg = small_config(tmp_path, world_size=1, **{"train.batch_size": 4})
    engine = Engine(cfg, single_rank(), LocalTransport(), torch.device("cpu"), cfg.resolve_arch())
    engine.train_step()
    n = 7
    before = _one_call_as_before(engine, n)
    assert engine.eval_mean(engine.eval_sum(0, n), n) == before  # one call over all batches
    for most in (1, 2, 3, n):
        group = _OneRank(engine)
        assert evaluate_in_chunks(group, n, timeout=None, call_s=1e9, most=most) == before, most
        starts = [a for a, _ in group.ranges]
        assert len(group.ranges) > 1 and starts[0] == 0 and group.ranges[-1][1] == n
        assert all(b == c for (_, b), (c, _) in zip(group.ranges, group.ranges[1:]))  # consecutive, in order


def test_each_rank_gets_back_its_own_running_sum():
    group = StandInGroup(3)
    group.val_loss = lambda rank, i: 1.0 / (3 + rank) + 0.1 * i
    calls = []
    call_each = group.call_each

    def recorded(method, args, **kwargs):
        out = call_each(method, args, **kwargs)
        calls.append((method.__name__, args, out))
        return out

    group.call_each = recorded
    val = evaluate_in_chunks(group, 10, timeout=None, call_s=1e9, most=3)
    sums = [c for c in calls if c[0] == "eval_sum"]
    assert [a[0][:2] for _, a, _ in sums] == [(0, 1), (1, 3), (3, 6), (6, 9), (9, 10)]
    for (_, _, out), (_, args, _) in zip(sums, sums[1:]):
        assert [a[2] for a in args] == out  # rank r's sum goes back to rank r
    expected = sum(sum(1.0 / (3 + r) + 0.1 * i for i in range(10)) for r in range(3)) / 3 / 10
    assert val == pytest.approx(expected, rel=1e-12)


def test_a_stop_between_calls_raises_with_the_batches_done():
    group = StandInGroup(2)
    asked = []

    def stop_after_three() -> bool:
        asked.append(len(group.eval_ranges))
        return len(group.eval_ranges) == 3

    with pytest.raises(EvaluationStopped) as info:
        evaluate_in_chunks(group, 10**9, timeout=None, stop_requested=stop_after_three, call_s=1e9)
    assert (info.value.done, info.value.batches) == (1 + 2 + 4, 10**9)
    assert "eval_mean" not in group.calls  # no partial mean is made
    assert asked == [0, 1, 2, 3]  # asked before every call


def test_progress_lines_only_for_long_evaluations():
    lines: list[str] = []
    ProgressLines(lines.append, every_s=3600)(5, 10)
    assert lines == []  # short: silent
    show = ProgressLines(lines.append, every_s=0.0)
    show(120, 5000)
    show(5000, 5000)  # the end is the eval line's, not a progress line
    assert len(lines) == 1 and lines[0].startswith("eval 120/5000 batches (") and "s left)" in lines[0]


def _trainer(tmp_path, monkeypatch, progress=False, **over) -> trainer_mod.Trainer:
    monkeypatch.setattr(trainer_mod, "WorkerGroup", lambda config, world_size=None, arch=None: StandInGroup(2))
    monkeypatch.setattr(trainer_mod, "connect", lambda *a, **k: None)
    cfg = small_config(tmp_path, **{"train.steps": 2, "train.eval_interval": 0, **over})
    return trainer_mod.Trainer(cfg, progress=progress)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_during_a_long_final_evaluation_checkpoints_and_records_no_eval(tmp_path, monkeypatch, capsys, sig):
    batches = 10**9  # one call over them all would take years: only a stop between calls ends it
    before = signal.getsignal(sig)
    if before == signal.SIG_IGN:
        pytest.skip(f"{sig.name} is ignored in this process (nohup): train() leaves it so")
    with _trainer(tmp_path, monkeypatch, progress=True, **{"train.eval_batches": batches,
                                                           "train.log_every_s": 1e-6, "train.progress": "lines"}) as t:
        saved: list[int] = []
        t.save = lambda: saved.append(t.step_count) or Path(t.run_dir)
        call_each = t.group.call_each

        def stopped_on_the_third_call(method, args, **kwargs):
            out = call_each(method, args, **kwargs)
            if method.__name__ == "eval_sum" and len(t.group.eval_ranges) == 3:
                os.kill(os.getpid(), sig)
            if len(t.group.eval_ranges) > 20:
                pytest.fail("the evaluation went on after the stop")
            return out

        t.group.call_each = stopped_on_the_third_call
        with pytest.raises(TrainingInterrupted, match=f"stopped by {sig.name} at step 2") as info:
            t.train()
        assert info.value.signum == sig and saved == [2]
        assert len(t.group.eval_ranges) == 3 and "eval_mean" not in t.group.calls
        assert t.log.events("eval") == [] and t.summary()["val_loss"] is None
        (stopped,) = t.log.events("eval_interrupted")
        assert stopped == {"event": "eval_interrupted", "step": 2, "batches_done": 7, "batches": batches,
                           "signal": sig.name}
        assert t.log.events("preempted")[-1]["step"] == 2
        # the stop was spent: evaluate() in a notebook afterwards measures in full
        assert t.evaluate(4) == 2.5 and t.log.events("eval")[-1]["val_loss"] == 2.5
    out = capsys.readouterr().out
    assert f"final evaluation: {batches} batches" in out and f"eval 3/{batches} batches (" in out
    assert f"{sig.name}: evaluation stopped after 7 of {batches} batches" in out
    assert signal.getsignal(sig) == before  # put back


def test_a_stop_before_a_periodic_evaluation_skips_it(tmp_path, monkeypatch):
    """A signal during the step before an eval_interval evaluation stops without running it."""
    with _trainer(tmp_path, monkeypatch, **{"train.steps": 10, "train.eval_interval": 2}) as t:
        t.save = lambda: Path(t.run_dir)
        call_each = t.group.call_each

        def stop_in_step_4(method, args, **kwargs):
            out = call_each(method, args, **kwargs)
            if method.__name__ == "step" and t.group.step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        t.group.call_each = stop_in_step_4
        with pytest.raises(TrainingInterrupted, match="at step 4"):
            t.train()
        assert [e["step"] for e in t.log.events("eval")] == [2]
        assert t.log.events("eval_interrupted") == [{"event": "eval_interrupted", "step": 4, "batches_done": 0,
                                                     "batches": 2, "signal": "SIGTERM"}]
