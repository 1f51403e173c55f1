"""GPU checks of the fused linear + cross-entropy (``kernels/linear_ce.py``) at Qwen3-30B-A3B's
LM-head shape and at odd sizes: loss and both gradients against the float32 full-logits oracle,
no worse than the chunked path's bf16 result, and no host synchronisation. Run on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from ray_moe.kernels.linear_ce import linear_cross_entropy
from tests.references import linear_cross_entropy_reference
from ray_moe.model.loss import lm_loss
from ray_moe.validation import rel_err

pytestmark = pytest.mark.gpu


def _inputs(N: int, V: int, H: int, seed: int, ignore_every: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(N, H, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to("cuda", torch.bfloat16)
    t = torch.randint(0, V, (N,), generator=g).cuda()
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t


def _chunked(h, w, t):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = lm_loss(hh, ww, t, impl="chunked")
    loss.backward()
    return loss.detach(), hh.grad, ww.grad


@pytest.mark.parametrize("N,V,H,ignore_every", [
    (16384, 151936, 2048, 0),  # Qwen3-30B-A3B: hidden 2048, vocabulary 151,936, 16k tokens
    (4097, 50257, 1000, 7),    # odd sizes, a partial last chunk, ignored rows
    (3, 129, 64, 2),
])
def test_fused_matches_the_float32_oracle(N, V, H, ignore_every):
    h, w, t = _inputs(N, V, H, seed=N, ignore_every=ignore_every)
    loss, dh, dw = linear_cross_entropy(h, w, t)
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.float32
    chunked = _chunked(h, w, t)
    ref = linear_cross_entropy_reference(h, w, t)
    assert abs(float(loss) - float(ref[0])) <= max(2 * abs(float(chunked[0]) - float(ref[0])), 2e-3)
    for ours, theirs, want, name in ((dh.float(), chunked[1].float(), ref[1], "d hidden"),
                                     (dw, chunked[2].float(), ref[2], "d weight")):
        err, chunked_err = rel_err(ours, want), rel_err(theirs, want)
        assert err <= 1.1 * chunked_err + 1e-4 and err < 1e-2, (name, err, chunked_err)


def test_fused_loss_takes_no_host_sync_and_scales_by_the_incoming_gradient():
    h, w, t = _inputs(2048, 32001, 512, seed=3, ignore_every=5)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lm_loss(hh, ww, t, impl="fused")  # compile outside the sync check
    hh.grad = ww.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (lm_loss(hh, ww, t, impl="fused") * 3.0).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _, dh, dw = linear_cross_entropy_reference(h, w, t)
    assert rel_err(hh.grad.float(), 3 * dh) < 1e-2 and rel_err(ww.grad.float(), 3 * dw) < 1e-2
    assert ww.grad.dtype == torch.bfloat16
