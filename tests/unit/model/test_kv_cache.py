"""Incremental decoding with a KV cache: one position at a time over the cache gives the hidden
states of the whole-sequence forward (byte model and the HF families, fp32, W=1); greedy
``Engine.generate`` gives transformers' greedy ``generate``; past ``model.seq_len`` it gives what
re-reading the last ``seq_len`` tokens gives."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.model.kv_cache import KVCache, causal_mask
from tests.support import build, engine, small_config
from tests.unit.model.test_hf_models import FAMILIES, _engine


def _byte_config(tmp_path):
    return small_config(tmp_path, world_size=1, **{"model.seq_len": 16})


def _check_incremental(model, vocab: int, prefill: int, L: int = 16, seed: int = 0) -> None:
    ids = torch.randint(0, vocab, (2, L), generator=torch.Generator().manual_seed(seed))
    model.eval()
    with torch.no_grad():
        whole, _ = model.hidden_states(ids)
        cache = model.new_cache(L)
        parts = [model.hidden_states(ids[:, :prefill], cache)[0]]
        for t in range(prefill, L):
            parts.append(model.hidden_states(ids[:, t:t + 1], cache)[0])
    assert cache.length == L
    got = torch.cat(parts, dim=1)
    assert torch.allclose(got, whole, rtol=1e-5, atol=1e-5), (got - whole).abs().max()


@pytest.mark.parametrize("prefill", [1, 5])
def test_byte_model_decodes_one_position_at_a_time_as_the_whole_forward(tmp_path, prefill):
    cfg = _byte_config(tmp_path)
    model = build(cfg, LocalTransport())
    _check_incremental(model, cfg.model.vocab_size, prefill)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_families_decode_one_position_at_a_time_as_the_whole_forward(tiny_hf, tmp_path, family):
    e = _engine(tmp_path, tiny_hf(family))
    _check_incremental(e.model, e.model.lm_head.weight.shape[0], prefill=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_is_transformers_greedy_generate(tiny_hf, tmp_path, family):
    transformers = pytest.importorskip("transformers")
    path = tiny_hf(family)
    e = _engine(tmp_path, path)
    prompt = [5, 17, 42, 7]
    ours = e.generate(prompt, 12, temperature=0.0, seed=0)  # 16 positions: within model.seq_len
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, num_beams=1,
                           pad_token_id=0, eos_token_id=None)
    assert ours == out[0, len(prompt):].tolist()


def test_past_the_window_generate_rereads_the_last_seq_len_tokens(tmp_path):
    e = engine(_byte_config(tmp_path))
    prompt = list(b"line 3: value")
    got = e.generate(prompt, 10, temperature=0.0, seed=0)  # 13 + 10 > seq_len 16
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):  # the reference: the whole last-16 context, no cache
            h, _ = e.model.hidden_states(torch.tensor([ids[-16:]]))
            ids.append(int((h[0, -1] @ e.model.lm_head.weight.t()).argmax()))
    assert got == ids[len(prompt):]


def test_cache_bounds_and_shapes():
    cache = KVCache(num_layers=1, capacity=3)
    k = torch.randn(1, 2, 2, 4)
    keys, values = cache.update(0, k, k + 1)
    assert keys.shape == (1, 2, 2, 4) and torch.equal(values, k + 1)
    cache.advance(2)
    keys, _ = cache.update(0, k[:, :, :1], k[:, :, :1])
    assert keys.shape == (1, 2, 3, 4) and torch.equal(keys[:, :, :2], k)
    cache.advance(1)
    with pytest.raises(ValueError, match="holds 3 positions; 4 were asked for"):
        cache.update(0, k[:, :, :1], k[:, :, :1])
    assert causal_mask(5, 5) and not causal_mask(1, 6)
    with pytest.raises(ValueError, match="one position at a time"):
        causal_mask(2, 6)
