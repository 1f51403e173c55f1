"""train.overlap_update on the CPU: the update groups by name, the config key, and the engine
running the update in place (the side stream is CUDA only; tests/gpu/test_precision_gpu.py
checks the overlapped update against the update in place)."""

from __future__ import annotations

import pytest
import torch

from ray_moe.config import Config, ConfigError
from ray_moe.worker.overlap import update_groups


def test_update_groups_follow_the_forward():
    names = ["embed_tokens.weight", "embed_positions", "layers.0.attn.qkv.weight", "layers.0.mlp.routed.w13",
             "layers.1.norm1.weight", "layers.10.mlp.routed.w2", "norm.weight", "lm_head.weight"]
    assert update_groups(names, 11) == [0, 0, 1, 1, 2, 11, 12, 12]
    assert update_groups(["w", "embed"], 0) == [1, 0]  # no blocks: everything but the embeddings last


def test_overlap_update_is_a_boolean_key():
    assert Config().with_overrides(["train.overlap_update=true"]).train.overlap_update is True
    cfg = Config()
    cfg.train.overlap_update = "yes please"
    with pytest.raises(ConfigError, match="train.overlap_update='yes please' must be true or false"):
        cfg.train.check()


def test_engine_on_the_cpu_updates_in_place(tmp_path):
    from ray_moe.comm.local import LocalTransport
    from ray_moe.worker.engine import Engine
    from tests.support import single_rank, small_config

    cfg = small_config(tmp_path, world_size=1, **{"train.overlap_update": True})
    e = Engine(cfg, single_rank(), LocalTransport(), torch.device("cpu"), cfg.resolve_arch())
    assert e.overlap is None
    assert e.train_step()["loss"] > 0
    e.close()
