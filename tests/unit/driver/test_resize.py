"""After a failure the Trainer starts the largest group that fits (every world size the config's
one rule accepts, largest first) and leaves the config as given: the group owns the world size."""

from __future__ import annotations

from types import SimpleNamespace

from ray_moe.driver.group import GroupError
from ray_moe.driver.trainer import Trainer
from tests.support import small_config


def test_a_smaller_group_after_a_failure_leaves_the_config_alone(tmp_path):
    cfg = small_config(tmp_path, world_size=4, **{"moe.num_experts": 8, "train.batch_size": 12})
    before = cfg.to_dict()
    events, tried = [], []
    t = Trainer.__new__(Trainer)  # only the resize logic: no run directory, no Ray
    t.config = cfg
    t.arch = cfg.resolve_arch()
    t.log = SimpleNamespace(event=lambda name, **kw: events.append((name, kw)))

    def start(group=None, world_size=None):
        tried.append(world_size)
        if world_size > 2:
            raise GroupError("does not fit")

    t._start_group = start
    t._start_group_on_available()
    assert tried == [4, 2]  # 3 does not divide the 8 experts
    assert events == [("resized", {"world_size": 2, "wanted": 4})]
    assert t.config is cfg and cfg.to_dict() == before
