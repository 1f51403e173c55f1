"""The chunked LM-head cross-entropy against ``F.cross_entropy`` on the full logits (the oracle).

float32: the loss and both gradients match tightly. bfloat16: both are compared with a float64
oracle on the same (bf16-valued) inputs; the chunked loss must be as close to it as the
full-logits bf16 computation is (same rounding points: logits rounded to bf16 once, their
gradient rounded to bf16 once; the weight gradient is summed over chunks in float32).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ray_moe.model.loss import auto_chunk, lm_loss, resolve_loss_impl
from ray_moe.validation import rel_err


def _inputs(N: int, V: int, H: int, dtype: torch.dtype, seed: int, ignore_every: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(dtype)  # logits of a few units: peaked softmax
    t = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t


def _grads(fn, h, w, t, dtype=None, scale=1.0):
    h = h.detach().to(dtype or h.dtype).requires_grad_()
    w = w.detach().to(dtype or w.dtype).requires_grad_()
    loss = fn(h, w, t)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def _full(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


@pytest.mark.parametrize("N,V,H,chunk,ignore_every", [
    (37, 53, 16, 0, 0),      # odd sizes, automatic chunk (one)
    (37, 53, 16, 5, 4),      # a chunk that does not divide N; every 4th row ignored
    (1, 7, 3, 1, 0),         # one row
    (64, 256, 32, 64, 3),    # one chunk
    (50, 300, 8, 7, 0),      # V > N, many chunks
])
def test_chunked_loss_matches_full_logits_fp32(N, V, H, chunk, ignore_every):
    h, w, t = _inputs(N, V, H, torch.float32, seed=N + V, ignore_every=ignore_every)
    ours = _grads(lambda a, b, c: lm_loss(a, b, c, chunk=chunk), h, w, t, scale=2.5)
    ref = _grads(_full, h, w, t, scale=2.5)
    assert ours[0].dtype == torch.float32 and ours[0].shape == ()
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=1e-6)
    for a, b, name in zip(ours[1:], ref[1:], ("d hidden", "d weight"), strict=True):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


@pytest.mark.parametrize("N,V,H,chunk", [(37, 53, 16, 0), (64, 256, 32, 5), (33, 1000, 24, 0)])
def test_chunked_loss_bf16_is_as_close_to_the_oracle_as_full_logits(N, V, H, chunk):
    h, w, t = _inputs(N, V, H, torch.bfloat16, seed=7 * N, ignore_every=5)
    ours = _grads(lambda a, b, c: lm_loss(a, b, c, chunk=chunk), h, w, t)
    full = _grads(_full, h, w, t)
    oracle = _grads(_full, h, w, t, dtype=torch.float64)
    assert ours[1].dtype == ours[2].dtype == torch.bfloat16
    assert abs(float(ours[0]) - float(oracle[0])) <= max(2 * abs(float(full[0]) - float(oracle[0])), 2e-3)
    for i, name in ((1, "d hidden"), (2, "d weight")):
        err, full_err = rel_err(ours[i], oracle[i]), rel_err(full[i], oracle[i])
        assert err <= 1.1 * full_err + 1e-4 and err < 1e-2, (name, err, full_err)


def test_all_rows_ignored_is_nan_like_cross_entropy():
    h, w, t = _inputs(6, 11, 4, torch.float32, seed=1)
    t[:] = -100
    assert torch.isnan(lm_loss(h, w, t)) and torch.isnan(_full(h, w, t))


def test_no_grad_path_and_one_sided_gradients():
    h, w, t = _inputs(19, 29, 8, torch.float32, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(lm_loss(h, w, t, chunk=4), _full(h, w, t))
    frozen_w = _grads(lambda a, b, c: lm_loss(a, b.detach(), c, chunk=4), h, w, t)
    torch.testing.assert_close(frozen_w[1], _grads(_full, h, w, t)[1])


def test_bad_inputs_name_the_problem():
    h, w, t = _inputs(4, 9, 3, torch.float32, seed=3)
    with pytest.raises(ValueError, match=r"head_weight \[V, H\]"):
        lm_loss(h, w.t(), t)
    with pytest.raises(ValueError, match="targets"):
        lm_loss(h, w, t[:3])
    with pytest.raises(ValueError, match="one dtype"):
        lm_loss(h, w.bfloat16(), t)
    with pytest.raises(ValueError, match="impl='full'"):
        lm_loss(h, w, t, impl="full")
    with pytest.raises(ValueError, match="liger needs CUDA"):
        resolve_loss_impl("liger", torch.device("cpu"))
    assert resolve_loss_impl("auto", torch.device("cpu")) == "chunked"


def test_auto_chunk_bounds_logits_to_the_hidden_states():
    assert auto_chunk(32768, 151936, 4096) == 1024  # 1024 x 151936 logits ≈ 32768 x 4096 hidden
    assert auto_chunk(32768, 151936, 64) == 64  # not below 64 MiB of logits (110 rows → 64)
    assert auto_chunk(32768, 256, 4096) == 32768  # small vocabulary: one chunk
    assert auto_chunk(37, 53, 16) == 37 and auto_chunk(0, 10, 4) == 1 and auto_chunk(1, 10**6, 2) == 1
    assert auto_chunk(10**6, 151936, 4096) == 32768
