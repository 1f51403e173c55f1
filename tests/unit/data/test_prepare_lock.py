"""``ray-moe prepare`` releases its dataset directory's lock on every way out: a failure between
taking it and the Ray job (here: no cluster to connect to) leaves the directory free at once, not
when the writer in a held traceback is garbage."""

from __future__ import annotations

import pytest

from ray_moe import dirlock
from ray_moe.data import prepare as prepare_mod
from ray_moe.data.prepare import PrepareError
from ray_moe.data.shards import LOCK_FILE
from tests.unit.data.conftest import STDLIB


def test_a_prepare_that_cannot_reach_ray_releases_the_lock(tmp_path, bpe_dir, monkeypatch):
    out = tmp_path / "ds"
    out.mkdir()
    (out / LOCK_FILE).write_text("pid 1 on gone\n")  # a run killed after its lock: this one takes it over

    def no_cluster(address):
        raise PrepareError("cannot connect to Ray at nowhere")

    monkeypatch.setattr(prepare_mod, "_connect", no_cluster)
    with pytest.raises(PrepareError, match="cannot connect") as info:
        prepare_mod.prepare([str(STDLIB / "bisect.py")], str(bpe_dir), str(out), progress=False)
    assert info.value.__traceback__ is not None  # the writer's frame is still referenced
    dirlock.take(out / LOCK_FILE).close()


def test_a_cluster_lost_under_the_job_is_one_line_and_the_run_resumable(tmp_path, bpe_dir, monkeypatch):
    """A Ray worker that dies under the job (seen when another program stopped the cluster that
    ``prepare`` had attached to) ends in one line saying the same command resumes. Nothing was
    written before it, so nothing is left (the directory is made with the first shard)."""
    import ray.exceptions

    out = tmp_path / "ds"

    def batches(ds, stall_timeout_s):
        raise ray.exceptions.ActorDiedError()
        yield  # a generator, as the real one

    monkeypatch.setattr(prepare_mod, "_connect", lambda address: False)
    monkeypatch.setattr(prepare_mod, "_dataset", lambda *args: object())
    monkeypatch.setattr(prepare_mod, "_batches", batches)
    with pytest.raises(PrepareError) as info:
        prepare_mod.prepare([str(STDLIB / "bisect.py")], str(bpe_dir), str(out), workers=1, progress=False)
    message = str(info.value)
    assert "ActorDiedError: The actor died unexpectedly" in message and "resumes" in message
    assert "\n" not in message
    assert not out.exists()
