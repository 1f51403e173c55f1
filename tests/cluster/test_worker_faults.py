"""Workers that die or hang: each test starts (and breaks) worker groups of its own, on a one-node
cluster of this module (``module_cluster``), so under ``pytest -n`` they run beside the session
cluster's lane instead of in it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ray_moe.checkpoint import latest_checkpoint, read_meta
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


def test_worker_killed_during_save_keeps_previous_checkpoint(module_cluster, tmp_path):
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
    with Trainer(cfg.with_overrides(["train.resume=true"]), progress=False) as t2:
        assert t2.step_count == 1


def _hang(worker):
    worker.engine.train_step = lambda poison=False: time.sleep(3600)


def test_hung_worker_is_detected_within_timeout(module_cluster, tmp_path):
    cfg = small_config(tmp_path, **{"train.step_timeout_s": 2, "train.max_failures": 0})
    with Trainer(cfg, progress=False) as t:
        t.group.execute(_hang)
        t0 = time.monotonic()
        with pytest.raises(TrainingError, match="did not answer within 2s"):
            t.step()
        assert time.monotonic() - t0 < 30
