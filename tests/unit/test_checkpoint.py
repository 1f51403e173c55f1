"""Checkpoint key schema and compatibility checks, without Ray: shards written by two ranks load
into one, optimizer state and RNG come back, bad tensors and configs are named."""

from __future__ import annotations

import pytest
import torch

from ray_moe import checkpoint
from ray_moe.checkpoint import CheckpointError, check_compatible, expert_key
from ray_moe.comm.base import Transport
from ray_moe.comm.local import LocalTransport
from ray_moe.config import ConfigError
from tests.support import build, small_config


class ShapeOnlyTransport(Transport):
    """Rank ``rank`` of ``world_size`` for building a model shard; it moves no rows."""

    name = "shape-only"

    def dispatch_forward(self, *a):  # pragma: no cover - never called
        raise NotImplementedError

    dispatch_backward = combine_forward = combine_backward = dispatch_forward


def _model(cfg, rank=0, world_size=1):
    transport = LocalTransport() if world_size == 1 else ShapeOnlyTransport(rank, world_size)
    return build(cfg, transport)


def _opt_state(model):
    """An AdamW-shaped state with distinct values per parameter."""
    return {p: {"exp_avg": torch.full_like(p, i + 0.5), "exp_avg_sq": torch.full_like(p, i + 0.25)}
            for i, p in enumerate(model.parameters())}


def test_two_rank_shards_load_into_one_rank(tmp_path):
    cfg = small_config(tmp_path, **{"moe.num_experts": 4})
    shards = {}
    ranks = [_model(cfg, r, 2) for r in range(2)]
    for r, m in enumerate(ranks):
        shards.update(checkpoint.shard_state(m.named_parameters(), _opt_state(m), r, torch.device("cpu")))
    # experts by logical id, once each; replicated tensors from rank 0 only
    assert expert_key("layers.1.mlp.routed.w13", 3) in shards and "layers.1.mlp.routed.w13" not in shards
    assert "embed_tokens.weight" in shards and "optim.embed_tokens.weight.exp_avg" in shards
    one = _model(cfg.with_overrides(["parallel.world_size=1", "train.seed=9"]))
    state: dict = {}
    checkpoint.load_shard_state(one.named_parameters(), state, shards, opt_steps=3, rank=0,
                                device=torch.device("cpu"))
    for e in range(4):
        owner = ranks[e // 2].layers[1].mlp.routed
        assert torch.equal(one.layers[1].mlp.routed.w13[e], owner.w13[e % 2]), e
        assert torch.equal(one.layers[1].mlp.routed.w2[e], owner.w2[e % 2]), e
    assert torch.equal(one.embed_tokens.weight, ranks[0].embed_tokens.weight)
    p = one.layers[1].mlp.routed.w13
    assert state[p]["step"].item() == 3.0 and state[p]["exp_avg"].shape == p.shape


def test_load_names_a_missing_tensor_and_a_wrong_shape(tmp_path):
    cfg = small_config(tmp_path, **{"parallel.world_size": 1})
    m = _model(cfg)
    saved = checkpoint.shard_state(m.named_parameters(), {}, 0, torch.device("cpu"))
    bad = dict(saved)
    del bad["norm.weight"]
    with pytest.raises(CheckpointError, match="no tensor 'norm.weight'"):
        checkpoint.load_shard_state(m.named_parameters(), {}, bad, 0, 0, torch.device("cpu"))
    bad = dict(saved, **{"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' has shape \(3, 3\)"):
        checkpoint.load_shard_state(m.named_parameters(), {}, bad, 0, 0, torch.device("cpu"))


def test_rng_state_comes_back(tmp_path):
    m = _model(small_config(tmp_path, **{"parallel.world_size": 1}))
    torch.manual_seed(4)
    saved = checkpoint.shard_state(m.named_parameters(), {}, 0, torch.device("cpu"))
    want = torch.rand(3)
    checkpoint.load_shard_state(m.named_parameters(), {}, saved, 0, 0, torch.device("cpu"))
    assert torch.equal(torch.rand(3), want)


def test_compatibility_check_names_the_key(tmp_path):
    cfg = small_config(tmp_path)
    meta = {"config": cfg.to_dict()}
    other = cfg.with_overrides(["train.lr=0.1", "parallel.world_size=4"])
    check_compatible(meta, other, "ckpt", other.resolve_arch())
    wider = cfg.with_overrides(["moe.expert_hidden=64"])
    with pytest.raises(ConfigError, match="moe.expert_hidden=64 but checkpoint 'ckpt' has 48"):
        check_compatible(meta, wider, "ckpt", wider.resolve_arch())


def test_a_disk_error_while_writing_a_shard_is_an_oserror_with_its_errno(tmp_path, monkeypatch):
    """safetensors reports I/O errors as SafetensorError with the OS error in its text: write_shard
    raises them as OSError with that errno, so that the driver does not retry a full disk."""
    import errno

    from safetensors import SafetensorError

    from ray_moe.driver.group import WorkerFailure
    from ray_moe.driver.trainer import retryable

    with pytest.raises(OSError) as missing:
        checkpoint.write_shard(tmp_path / "gone", 0, {"w": torch.zeros(2)})
    assert missing.value.errno == errno.ENOENT and "rank00000.safetensors" in str(missing.value)

    def full(*_args, **_kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(OSError) as no_space:
        checkpoint.write_shard(tmp_path, 0, {"w": torch.zeros(2)})
    assert no_space.value.errno == errno.ENOSPC
    failure = WorkerFailure("save_shard: rank 0 raised ...", 0, "error")
    failure.__cause__ = no_space.value
    assert not retryable(failure)


def test_shards_are_readable_as_the_umask_allows(tmp_path):
    """safetensors writes owner-only (0600) files; a checkpoint's shards get 0666 less the umask."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        checkpoint.write_shard(tmp_path, 0, {"w": torch.zeros(2)})
        os.umask(0o027)
        checkpoint.write_shard(tmp_path, 1, {"w": torch.zeros(2)})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "rank00000.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "rank00001.safetensors").stat().st_mode) == 0o640
