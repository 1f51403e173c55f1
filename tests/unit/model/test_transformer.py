"""The byte-level model on one process: bad token ids, deterministic init from its own generator."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.model.transformer import MoETransformer
from tests.support import small_config


def test_model_rejects_tokens_outside_vocab(tmp_path):
    cfg = small_config(tmp_path, **{"parallel.world_size": 1})
    model = MoETransformer(cfg, LocalTransport())
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        model(torch.tensor([[1, 2, 300]]))
    with pytest.raises(TypeError, match="int64 or int32"):
        model(torch.tensor([[1.0, 2.0]]))


def test_model_builds_from_its_own_generator(tmp_path):
    cfg = small_config(tmp_path, **{"parallel.world_size": 1})
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = MoETransformer(cfg, LocalTransport())
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is neither seeded nor advanced
    b = MoETransformer(cfg, LocalTransport())
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    c = MoETransformer(cfg.with_overrides(["train.seed=1"]), LocalTransport())
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
