"""A user's mistake is not a worker failure: bad arguments are refused on the driver before any
worker sees them, an argument or data error a worker raises ends the call in one line, and in both
cases the run stays where it was (same group, same step, metrics.jsonl untouched, no failure
counted). Only dead or hung workers are recovered from. A closed Trainer says so."""

from __future__ import annotations

import math

import pytest

import ray_moe.driver.trainer as trainer_mod
from ray_moe.config import Config, ConfigError
from ray_moe.driver.errors import CallRejected, TrainerClosed, WorkerFailure
from tests.support import small_config
from tests.unit.driver.stand_in import DataError
from tests.unit.driver.stand_in import StandInGroup as _Group


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    made: list[_Group] = []

    def group(config, world_size=None, arch=None):
        made.append(_Group(world_size or config.parallel.world_size))
        return made[-1]

    monkeypatch.setattr(trainer_mod, "WorkerGroup", group)
    monkeypatch.setattr(trainer_mod, "connect", lambda *a, **k: None)
    t = trainer_mod.Trainer(small_config(tmp_path, **{"train.max_failures": 3}), progress=False)
    t.made = made
    for _ in range(3):
        t.step()
    yield t
    t.close()


def _state(t):
    return t.group, t.step_count, (t.run_dir / "metrics.jsonl").read_bytes(), t.failures


@pytest.mark.parametrize("call, match", [
    (lambda t: t.generate(""), "the prompt is empty"),
    (lambda t: t.generate([]), "the prompt is empty"),
    (lambda t: t.generate("ab", max_new_tokens=1.5), "max_new_tokens=1.5 must be an integer >= 0"),
    (lambda t: t.generate("ab", max_new_tokens=-1), "max_new_tokens=-1"),
    (lambda t: t.generate("ab", temperature=math.nan), "temperature=nan must be a finite number >= 0"),
    (lambda t: t.generate("ab", temperature=-1.0), "temperature=-1.0"),
    (lambda t: t.generate("ab", temperature=math.inf), "temperature=inf"),
    (lambda t: t.generate([1, 256]), r"must be in \[0, 256\).*max 256"),
    (lambda t: t.generate([-1, 3]), "min -1"),
    (lambda t: t.generate([1.5, 3]), "token id 1.5 is not an integer"),
    (lambda t: t.generate("ab", seed="x"), "seed='x'"),
    (lambda t: t.evaluate(0), "batches=0 must be None"),
    (lambda t: t.evaluate(2.5), "batches=2.5"),
    (lambda t: t.step(inject_nan_rank=5), r"inject_nan_rank=5 must be None or a rank in \[0, 2\)"),
])
def test_bad_arguments_are_refused_on_the_driver_and_the_run_stays(trainer, call, match):
    before, calls = _state(trainer), list(trainer.group.calls)
    with pytest.raises(CallRejected, match=match) as info:
        call(trainer)
    assert isinstance(info.value, ValueError)  # what a notebook expects of a bad argument
    assert "\n" not in str(info.value)
    assert trainer.group.calls == calls  # no worker saw the call
    assert _state(trainer) == before and not trainer.group.closed and len(trainer.made) == 1


def test_good_arguments_go_to_the_workers(trainer):
    assert trainer.generate([1, 2], max_new_tokens=3, temperature=0) == [1, 2, 7, 7, 7]
    assert trainer.generate("a", max_new_tokens=0) == "a"
    assert trainer.evaluate(1) == 2.5


@pytest.mark.parametrize("method, error", [
    ("generate", ValueError("prompt token ids must be in [0, 256)")),
    ("eval_sum", DataError("data.paths: the shard is damaged")),
    ("step", DataError("data.datasets: token id 900 at token 3")),
])
def test_an_argument_or_data_error_a_worker_raises_ends_the_call_and_the_run_stays(trainer, method, error):
    before = _state(trainer)
    trainer.group.raises[method] = error
    call = {"generate": lambda: trainer.generate("ab"), "eval_sum": lambda: trainer.evaluate(),
            "step": lambda: trainer.step()}[method]
    with pytest.raises(CallRejected, match=str(error)[:20].replace("[", r"\[").replace("(", r"\(")):
        call()
    assert _state(trainer) == before  # no rebuild, no reset, no failure recorded
    assert len(trainer.made) == 1 and not trainer.group.closed
    del trainer.group.raises[method]
    trainer.step()  # and the run goes on from where it was
    assert trainer.step_count == 4


def test_a_dead_worker_is_still_recovered_from(trainer):
    group = trainer.group
    original_call_each = group.call_each

    def dies_once(method, args, **kwargs):
        group.call_each = original_call_each
        raise WorkerFailure("step: the worker of rank 1 died", 1, "died")

    group.call_each = dies_once
    trainer.step()
    assert trainer.failures == 1 and group.closed and len(trainer.made) == 2


def test_a_closed_trainer_says_so(trainer):
    trainer.close()
    for call in (lambda: trainer.step(), lambda: trainer.generate("a"), lambda: trainer.evaluate(),
                 lambda: trainer.save(), lambda: trainer.world_size):
        with pytest.raises(TrainerClosed, match="this Trainer is closed"):
            call()


def test_no_validation_split_means_no_evaluation(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_mod, "WorkerGroup", lambda config, world_size=None, arch=None: _Group(2))
    monkeypatch.setattr(trainer_mod, "connect", lambda *a, **k: None)
    with trainer_mod.Trainer(small_config(tmp_path, **{"data.val_fraction": 0, "train.steps": 2}),
                             progress=False) as t:
        t.save = lambda: t.run_dir  # the stand-in workers write no checkpoint
        t.train()
        assert not {"eval_sum", "eval_mean"} & set(t.group.calls) and t.summary()["val_loss"] is None
        with pytest.raises(CallRejected, match="no validation split"):
            t.evaluate()


@pytest.mark.parametrize("over, match", [
    ({"train.lr": ".inf"}, "train.lr=inf must be a finite number > 0"),
    ({"train.lr": ".nan"}, "train.lr=nan"),
    ({"train.grad_clip": ".inf"}, "train.grad_clip=inf"),
    ({"data.val_fraction": 0, "train.eval_interval": 5}, "data.val_fraction=0 leaves no validation split"),
])
def test_config_values_no_run_could_use_are_refused(tmp_path, over, match):
    with pytest.raises(ConfigError, match=match):
        small_config(tmp_path, **over)


def test_val_fraction_zero_without_periodic_evaluation_is_a_valid_config(tmp_path):
    assert small_config(tmp_path, **{"data.val_fraction": 0}).data.val_fraction == 0
    assert Config().train.lr == 3e-3


@pytest.mark.parametrize("val_fraction, has_val", [(0.0, False), (0.3, True)])
def test_a_prepared_dataset_without_a_val_split_means_no_evaluation(tmp_path, val_fraction, has_val):
    import numpy as np

    from ray_moe.driver.trainer import has_validation_split
    from tests.unit.data.shard_helpers import random_files, write_dataset

    write_dataset(tmp_path / "ds", random_files(np.random.default_rng(0), 30), val_fraction=val_fraction)
    cfg = Config().with_overrides([f"data.datasets=[{tmp_path / 'ds'}]", "model.vocab_size=1024"])
    assert has_validation_split(cfg) is has_val
