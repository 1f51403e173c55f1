"""The byte-level model (the one decoder with the byte ArchSpec) on one process: bad token ids,
deterministic init from its own generator, the byte init scheme."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from tests.support import build, small_config


def test_model_rejects_tokens_outside_vocab(tmp_path):
    cfg = small_config(tmp_path, **{"parallel.world_size": 1})
    model = build(cfg, LocalTransport())
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        model(torch.tensor([[1, 2, 300]]))
    with pytest.raises(TypeError, match="int64 or int32"):
        model(torch.tensor([[1.0, 2.0]]))


def test_model_builds_from_its_own_generator(tmp_path):
    cfg = small_config(tmp_path, **{"parallel.world_size": 1})
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = build(cfg, LocalTransport())
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is neither seeded nor advanced
    b = build(cfg, LocalTransport())
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    c = build(cfg.with_overrides(["train.seed=1"]), LocalTransport())
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
