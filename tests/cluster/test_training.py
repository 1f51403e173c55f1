"""Training driver: learning, EP == single-process equivalence, checkpoints, notebook sessions, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from ray_moe.checkpoint import latest_checkpoint
from ray_moe.comm.local import LocalTransport
from ray_moe.data.errors import DataError
from ray_moe.config import ConfigError
from ray_moe.driver.group import GroupError
from ray_moe.driver.trainer import Trainer, TrainingError
from ray_moe.worker.actor import EPWorker
from ray_moe.worker.engine import Engine
from tests.support import single_rank, small_config


def test_learning_w2(groups, tmp_path):
    cfg = small_config(tmp_path, **{"train.steps": 60, "train.batch_size": 16, "data.max_bytes": 1_000_000,
                                    "train.eval_interval": 30})
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        initial = t.evaluate()
        t.train()
        evals = [m["step"] for m in t.metrics if m.get("event") == "eval"]
        final = t.evaluate()
        n = t.config.train.eval_batches
        sums = t.group.call(EPWorker.eval_sum, 0, n)  # every batch in one call
        one_call = t.group.call_each(EPWorker.eval_mean, [(s, n) for s in sums])[0]
        summary = t.summary()
    assert final == one_call  # asked for in chunks of batches, as the whole in one call: the same bits
    assert evals == [0, 30, 60]  # the end of train() does not repeat the eval its last step did
    assert math.isclose(initial, math.log(256), abs_tol=0.3), initial  # untrained ≈ uniform over bytes
    assert final < initial - 1.2, (initial, final)
    assert summary["last_loss"] < summary["first_loss"]
    step = [m for m in t.metrics if "time_per_rank" in m][-1]["time_per_rank"]
    assert all(0 < c < s for c, s in zip(step["comm"], step["step"]))  # communication is timed
    assert (tmp_path / "run" / "metrics.jsonl").stat().st_size > 0


def _shards(worker):
    return {k: v for k, v in worker.engine.shard_state().items() if not k.startswith("rng.")}


RECLONING = ["balance.enabled=true", "balance.interval=2", "balance.clone_slots=1", "balance.ema=0.0"]


@pytest.mark.parametrize("overrides", [[], RECLONING], ids=["native", "recloning"])
def test_ep_training_equals_single_process(groups, tmp_path, overrides):
    """W=2 training equals the single-process run: losses and every weight after 4 steps; also
    while hot experts are re-cloned every two steps (clone weights pushed, their gradients reduced)."""
    cfg = small_config(tmp_path, **{"train.steps": 4})
    with Trainer(cfg.with_overrides(overrides), progress=False, group=groups(2)) as t:
        ep_losses = [t.step()["loss"] for _ in range(4)]
        ep_state = {}
        for shard in t.group.execute(_shards):
            ep_state.update(shard)
        moved = sum(m["bytes_moved"] for m in t.metrics if m.get("event") == "rebalance")
    assert (moved > 0) == (overrides == RECLONING)  # the re-cloning run did move clones

    single_cfg = cfg.with_overrides(["parallel.world_size=1"])
    engine = Engine(single_cfg, single_rank(), LocalTransport(), torch.device("cpu"), single_cfg.resolve_arch())
    single_losses = [engine.train_step()["loss"] for _ in range(4)]
    single_state = {k: v for k, v in engine.shard_state().items() if not k.startswith("rng.")}

    assert ep_losses == pytest.approx(single_losses, rel=1e-5)
    assert set(ep_state) == set(single_state)
    for key, ref in single_state.items():
        torch.testing.assert_close(ep_state[key], ref, rtol=1e-4, atol=1e-6, msg=key)


def test_checkpoint_restores_onto_other_world_size(groups, tmp_path):
    cfg = small_config(tmp_path, **{"train.steps": 10})
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        for _ in range(3):
            t.step()
        saved = t.save()
        uninterrupted = t.step()["loss"]
    for world_size in (1, 4):
        # at W=1 the config still asks for 2: the group owns the world size, the config is not rewritten
        other = cfg.with_overrides([f"parallel.world_size={2 if world_size == 1 else world_size}",
                                    f"train.run_dir={tmp_path / f'w{world_size}'}"])
        with Trainer(other, progress=False, group=groups(world_size, "SPREAD" if world_size == 4 else "PACK")) as t2:
            assert t2.restore(saved) == 3
            assert t2.step()["loss"] == pytest.approx(uninterrupted, rel=1e-5)
            assert t2.world_size == t2.summary()["world_size"] == world_size
            assert t2.config.to_dict() == other.to_dict()
    few_experts = cfg.with_overrides(["moe.num_experts=2", f"train.run_dir={tmp_path / 'e2'}"])
    with pytest.raises(ConfigError, match="moe.num_experts=2 is not divisible by the group's world_size=4"):
        Trainer(few_experts, progress=False, group=groups(4, "SPREAD"))


def test_interrupted_save_keeps_previous_checkpoint(groups, tmp_path, monkeypatch):
    cfg = small_config(tmp_path)
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        t.step()
        good = t.save()
        t.step()
        import ray_moe.driver.trainer as trainer_mod

        def crash(*_a, **_k):
            raise KeyboardInterrupt("simulated crash after the shards were written")

        monkeypatch.setattr(trainer_mod, "commit", crash)
        with pytest.raises(KeyboardInterrupt):
            t.save()
        monkeypatch.undo()
        assert latest_checkpoint(cfg.train.run_dir) == good
        assert t.restore(good) == 1


def test_notebook_session_reconnects_and_resumes(ray_cluster, groups, tmp_path):
    cfg = small_config(tmp_path, **{"train.resume": "auto"})
    t = Trainer(cfg, progress=False, group=groups(2))  # an earlier session's run
    for _ in range(2):
        t.step()
    t.save()
    t.close()
    t = Trainer(cfg, address=ray_cluster, progress=False)  # a new session on the same cluster
    try:
        assert t.step_count == 2  # resumed from run_dir's latest checkpoint
        m = t.step()
        assert m["step"] == 3 and math.isfinite(m["loss"])
        assert t.expert_load() is not None and len(t.expert_load()) == cfg.model.n_layers
    finally:
        t.close()


def test_missing_corpus_path_fails_fast(groups, tmp_path):
    cfg = small_config(tmp_path, **{"data.paths": str(tmp_path / "nope.txt")})
    with pytest.raises(DataError, match="nope.txt"):
        Trainer(cfg, progress=False, group=groups(2))


def test_empty_corpus_fails_fast(groups, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cfg = small_config(tmp_path, **{"data.paths": str(empty)})
    with pytest.raises(DataError, match="bytes"):
        Trainer(cfg, progress=False, group=groups(2))


def test_config_that_does_not_fit_fails_fast(ray_cluster, tmp_path):
    cfg = small_config(tmp_path, **{"parallel.world_size": 64, "moe.num_experts": 64,
                                    "train.batch_size": 64})
    with pytest.raises(GroupError, match="needs 32 CPU"):
        Trainer(cfg, progress=False)


def test_fresh_run_never_recovers_into_an_earlier_runs_checkpoint(groups, tmp_path):
    """train.overwrite moves the earlier run aside: what a recovery would restore from (the run
    directory's checkpoints, see Trainer._recover) holds only the new run's."""
    from ray_moe.checkpoint import scan_checkpoints

    cfg = small_config(tmp_path, **{"train.max_failures": 1})
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        for _ in range(3):
            t.step()
        t.save()
    with Trainer(cfg.with_overrides(["train.overwrite=true"]), progress=False, group=groups(2)) as t:
        assert t.step_count == 0
        assert scan_checkpoints(t.run_dir) == ([], [])  # nothing of the earlier run to recover into
        archived = list((t.run_dir / "archive").glob("*/checkpoints/step_00000003"))
        assert len(archived) == 1  # kept, not deleted
        t.step()
        saved = t.save()
        assert scan_checkpoints(t.run_dir)[0] == [saved]