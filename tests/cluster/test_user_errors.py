"""On real workers: a notebook's bad call after a few steps (an empty prompt; an argument a worker
refuses) ends that call with one line and the run goes on where it was: the same group, the same
step, metrics.jsonl unchanged, no failure counted (it rebuilt the group three times and reset the
run to step 0 before)."""

from __future__ import annotations

import pytest

from ray_moe.driver.errors import CallRejected
from ray_moe.driver.trainer import Trainer
from ray_moe.worker.actor import EPWorker
from tests.support import small_config


def test_a_bad_call_leaves_the_run_where_it_was(groups, tmp_path):
    group = groups(2)
    with Trainer(small_config(tmp_path), progress=False, group=group) as t:
        for _ in range(3):
            t.step()
        metrics = (t.run_dir / "metrics.jsonl").read_bytes()
        with pytest.raises(CallRejected, match="the prompt is empty"):
            t.generate("")
        # past the driver's checks (a call made directly): every rank raises ValueError
        with pytest.raises(CallRejected, match=r"rank 0 \(.*\) raised ValueError: generate needs a prompt"):
            t._with_recovery(lambda: t.group.call(EPWorker.generate, [], 1, 1.0, 0, timeout=60))
        assert t.group is group and t.step_count == 3 and t.failures == 0
        assert (t.run_dir / "metrics.jsonl").read_bytes() == metrics
        assert t.step()["step"] == 4  # the same workers go on
