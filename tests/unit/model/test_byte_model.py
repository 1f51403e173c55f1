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


def test_byte_model_is_the_one_decoder_with_the_byte_init(tmp_path):
    """Embeddings N(0, 1), positions N(0, 0.02²), linear weights U(±1/√fan_in), norms 1, the
    norms' eps torch's RMSNorm default; learned positions, no RoPE."""
    from ray_moe.model.decoder import Decoder

    cfg = small_config(tmp_path, world_size=1, **{"model.d_model": 64, "model.n_heads": 4,
                                                 "model.dense_first_layer": True})
    model = build(cfg, LocalTransport())
    assert isinstance(model, Decoder) and model.spec.family == "byte" and model.spec.positions == "learned"
    assert model.embed_positions.shape == (cfg.model.seq_len, 64)
    assert abs(model.embed_tokens.weight.std().item() - 1.0) < 0.05
    assert abs(model.embed_positions.std().item() - 0.02) < 0.002
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        w = model.layers[0].get_submodule(name).weight
        bound = w.shape[1] ** -0.5
        assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound, name
        assert abs(w.std().item() - bound / 3 ** 0.5) < 0.1 * bound, name
    assert model.norm.eps is None and torch.equal(model.norm.weight, torch.ones(64))
    x = torch.randn(3, 64) * 1e-4  # eps = finfo(float32).eps: what torch.nn.RMSNorm computes
    assert torch.allclose(model.norm(x), torch.nn.functional.rms_norm(x, (64,)), rtol=1e-6, atol=1e-6)
    # in bf16 too: torch normalises in float32 with float32's eps (not bf16's 2^-7)
    xb, norm = (torch.randn(4, 64) * 0.05).bfloat16(), model.norm.to(torch.bfloat16)
    assert torch.equal(norm(xb), torch.nn.functional.rms_norm(xb, (64,), norm.weight))
    assert model.spec.param_counts()["total"] == sum(p.numel() for p in model.parameters())


def test_every_architecture_has_the_engine_interface(tmp_path):
    from typing import get_type_hints

    from ray_moe.model.interface import LanguageModel

    model = build(small_config(tmp_path, world_size=1), LocalTransport())
    missing = [name for name in get_type_hints(LanguageModel) if not hasattr(model, name)]
    assert not missing
