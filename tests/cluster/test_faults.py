"""Fault tolerance and bad input: dead, hung and poisoned workers; corrupt checkpoints; bad tensors."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
import torch

from ray_moe.checkpoint import CheckpointError, latest_checkpoint, read_meta
from ray_moe.driver.trainer import Trainer, TrainingError
from tests.support import small_config


def _slow_rank1_saves(worker):
    import ray_moe.checkpoint as ckpt

    real = ckpt.write_shard

    def slow(staging, rank, tensors):
        if rank == 1:
            time.sleep(60)
        return real(staging, rank, tensors)

    ckpt.write_shard = slow


def test_worker_killed_during_save_keeps_previous_checkpoint(groups, tmp_path):
    cfg = small_config(tmp_path)
    with Trainer(cfg, progress=False) as t:
        t.step()
        good = t.save()
        t.step()
        t.group.execute(_slow_rank1_saves)
        pid = t.group.ranks[1].pid
        threading.Timer(2.0, lambda: os.kill(pid, signal.SIGKILL)).start()
        with pytest.raises(Exception):
            t.save()
    assert latest_checkpoint(cfg.train.run_dir) == good
    read_meta(good)  # complete and uncorrupted
    with Trainer(cfg.with_overrides(["train.resume=true"]), progress=False, group=groups(2)) as t2:
        assert t2.step_count == 1


def _hang(worker):
    worker.engine.train_step = lambda poison=False: time.sleep(3600)


def test_hung_worker_is_detected_within_timeout(ray_cluster, tmp_path):
    cfg = small_config(tmp_path, **{"train.step_timeout_s": 2, "train.max_failures": 0})
    with Trainer(cfg, progress=False) as t:
        t.group.execute(_hang)
        t0 = time.monotonic()
        with pytest.raises(TrainingError, match="did not answer within 2s"):
            t.step()
        assert time.monotonic() - t0 < 30


def _weights(worker):
    return {k: v.clone() for k, v in worker.engine.shard_state().items()}


def test_nan_step_is_skipped_without_touching_weights(groups, tmp_path):
    cfg = small_config(tmp_path)
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        t.step()
        before = t.group.execute(_weights)
        m = t.step(inject_nan_rank=1)
        after = t.group.execute(_weights)
        assert m["nonfinite"] and m["skipped"]
        for b, a in zip(before, after):
            for k in b:
                assert torch.equal(b[k], a[k]), k  # weights and optimizer state untouched
        m2 = t.step()
        assert math.isfinite(m2["loss"]) and not m2["skipped"]
        assert any(e.get("event") == "nonfinite" for e in t.metrics)


def test_nan_step_stops_when_configured(groups, tmp_path):
    cfg = small_config(tmp_path, **{"train.nonfinite": "stop"})
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        with pytest.raises(TrainingError, match="non-finite"):
            t.step(inject_nan_rank=0)


def test_corrupt_checkpoint_is_refused_and_previous_kept(groups, tmp_path):
    cfg = small_config(tmp_path)
    with Trainer(cfg, progress=False, group=groups(2)) as t:
        t.step()
        good = t.save()
        t.step()
        bad = t.save()
        shard = bad / "rank00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="rank00001.safetensors"):
            t.restore(bad)
        (bad / "meta.json").write_text("{not json")
        with pytest.raises(CheckpointError, match="meta.json"):
            t.restore(bad)
        assert latest_checkpoint(cfg.train.run_dir) == good
        assert t.restore() == 1




def _full_disk(worker, on: bool):
    import errno

    import ray_moe.checkpoint as ckpt

    if not on:
        ckpt.write_shard = ckpt._real_write_shard
        return
    ckpt._real_write_shard = ckpt.write_shard

    def full(staging, rank, tensors):
        raise OSError(errno.ENOSPC, "No space left on device", str(staging))

    ckpt.write_shard = full


def test_a_full_disk_is_not_retried_and_leaves_no_temporary_checkpoint(groups, tmp_path):
    """Recovery is on by default, but a new group would meet a full disk again: not retried and not
    counted as a worker failure, one line naming it, the previous checkpoint kept and no
    .tmp-step_* directory left."""
    cfg = small_config(tmp_path, **{"train.checkpoint_interval": 2})
    assert cfg.train.max_failures > 0
    group = groups(2)
    with Trainer(cfg, progress=False, group=group) as t:
        t.step()
        t.step()  # step 2 checkpoints
        group.execute(_full_disk, True)
        try:
            t.step()
            with pytest.raises(TrainingError, match="No space left on device.*not retried"):
                t.step()
        finally:
            group.execute(_full_disk, False)
        assert t.failures == 0 and not t.log.events("failure")
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]
