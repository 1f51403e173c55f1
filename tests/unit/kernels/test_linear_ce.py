"""The fused linear + cross-entropy (``kernels/linear_ce.py``) against the float32 full-logits
oracle (``F.cross_entropy`` on upcast inputs): loss and both gradients, odd sizes, ignored rows,
several vocabulary tiles per row and chunks that do not divide N. The Triton kernel runs under
Triton's interpreter in a background process (tests/interpreter_scripts.py); the chunk rule and
the ``train.loss_impl`` resolution are checked here directly."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from tests.support import compile_for_sm90

from ray_moe.model import loss as loss_mod

_SCRIPT = """
import torch
from ray_moe.kernels.linear_ce import ce_rows_, linear_cross_entropy
from tests.references import linear_cross_entropy_reference
from ray_moe.model.loss import lm_loss, resolve_loss_impl
from ray_moe.validation import rel_err
g = torch.Generator().manual_seed(0)

def inputs(N, V, H, dtype, ignore_every=0):
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t

# float32: tight against the oracle (odd N and V; chunks not dividing N; ignored rows)
for N, V, H, rows, ign in ((37, 53, 16, 0, 0), (37, 53, 16, 5, 4), (1, 7, 3, 0, 0), (50, 300, 8, 7, 3)):
    h, w, t = inputs(N, V, H, torch.float32, ign)
    loss, dh, dw = linear_cross_entropy(h, w, t, rows=rows)
    rl, rdh, rdw = linear_cross_entropy_reference(h, w, t)
    assert loss.dtype == torch.float32 and loss.shape == () and dw.dtype == torch.float32
    torch.testing.assert_close(loss, rl, rtol=1e-6, atol=1e-6)
    assert rel_err(dh, rdh) < 1e-5 and rel_err(dw, rdw) < 1e-5, (N, V, rel_err(dh, rdh), rel_err(dw, rdw))

# bf16: logits and their gradient rounded to bf16 once (as the chunked path), so about 1e-2 of the oracle
for N, V, H, rows in ((33, 1000, 24, 0), (64, 256, 32, 5)):
    h, w, t = inputs(N, V, H, torch.bfloat16, 5)
    loss, dh, dw = linear_cross_entropy(h, w, t, rows=rows)
    rl, rdh, rdw = linear_cross_entropy_reference(h, w, t)
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert abs(float(loss) - float(rl)) < 2e-2, (float(loss), float(rl))
    assert rel_err(dh.float(), rdh) < 1e-2 and rel_err(dw, rdw) < 1e-2, (rel_err(dh.float(), rdh), rel_err(dw, rdw))

# the epilogue alone over several vocabulary tiles (online max / sum-exp; a partial last tile)
for dtype in (torch.float32, torch.bfloat16):
    x = (torch.randn(9, 53, generator=g) * 4).to(dtype)
    t = torch.randint(0, 53, (9,), generator=g); t[2] = -100
    valid = t != -100
    scale = torch.tensor([1 / 8.0])
    rows = torch.full((9,), float("nan"))
    g_ = x.clone()
    ce_rows_(g_, t, scale, rows, block_v=16)
    ref = torch.nn.functional.cross_entropy(x.float(), t, reduction="none")
    torch.testing.assert_close(rows, torch.where(valid, ref, 0.0), rtol=1e-5, atol=1e-5)
    want = (torch.softmax(x.float(), 1) - torch.nn.functional.one_hot(t.clamp(min=0), 53)) * (valid.float() / 8).unsqueeze(1)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(g_.float(), want, rtol=tol, atol=tol)
    only = x.clone()
    ce_rows_(only, t, scale, rows, block_v=16, write_grad=False)
    assert torch.equal(only, x)  # loss only: the logits are left alone

# through lm_loss and autograd: an incoming gradient, the no-grad path, one-sided gradients
assert resolve_loss_impl("fused", torch.device("cpu")) == "fused"  # the interpreter runs it on the CPU
h, w, t = inputs(19, 29, 8, torch.float32, 3)
hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
(lm_loss(hh, ww, t, impl="fused", chunk=4) * 2.5).backward()
rl, rdh, rdw = linear_cross_entropy_reference(h, w, t)
assert rel_err(hh.grad, 2.5 * rdh) < 1e-5 and rel_err(ww.grad, 2.5 * rdw) < 1e-5 and ww.grad.dtype == torch.float32
with torch.no_grad():
    torch.testing.assert_close(lm_loss(h, w, t, impl="fused"), rl)
hh = h.clone().requires_grad_()
lm_loss(hh, w, t, impl="fused").backward()
assert rel_err(hh.grad, rdh) < 1e-5
# targets that are a strided view (every second column of a [N, 2] batch) give the same loss
wide = torch.stack([t, t.flip(0)], 1)
torch.testing.assert_close(linear_cross_entropy(h, w, wide[:, 0], rows=4)[0], rl)
try:
    ce_rows_(torch.randn(19, 29), wide[:, 0], torch.tensor([1.0]), torch.empty(19))
    raise AssertionError("ce_rows_ took strided targets")
except ValueError as exc:
    assert "contiguous targets" in str(exc)
# a counted target outside [0, V): NaN loss (not an out-of-bounds read)
bad = t.clone(); bad[1] = 29
assert torch.isnan(linear_cross_entropy(h, w, bad)[0])
# every row ignored: NaN loss and zero gradients, as F.cross_entropy
t[:] = -100
loss, dh, dw = linear_cross_entropy(h, w, t)
assert torch.isnan(loss) and not dh.any() and not dw.any()
print("linear_ce ok")
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _SCRIPT)
def test_fused_linear_ce_matches_full_logits_under_the_interpreter(interpreter_scripts):
    interpreter_scripts.assert_prints(_SCRIPT, "linear_ce ok")


def test_fused_kernel_compiles_for_hopper():
    """The interpreter accepts code the compiler rejects (loop-carried types, say): the kernel is
    also compiled to an sm_90 cubin here, as the GPU would (Triton ships ptxas; this process does
    not interpret, so the kernel is the real JIT function)."""
    from ray_moe.kernels.linear_ce import _ce_rows_kernel

    sig = {"logits_ptr": "*bf16", "stride_row": "i64", "targets_ptr": "*i64", "loss_ptr": "*fp32",
           "scale_ptr": "*fp32", "V": "i32", "ignore_index": "i32", "BLOCK_V": "constexpr", "WRITE_GRAD": "constexpr"}
    for dt in ("*bf16", "*fp32"):
        for wg in (True, False):
            asm = compile_for_sm90(_ce_rows_kernel, {**sig, "logits_ptr": dt}, {"BLOCK_V": 8192, "WRITE_GRAD": wg},
                                   num_warps=16)
            assert asm["cubin"]


def test_fused_chunk_keeps_logits_within_the_weight_gradient():
    from ray_moe.kernels.linear_ce import fused_chunk

    V = 151936
    assert fused_chunk(16384, V, 2048, 2) == 4096  # 4096 x V bf16 logits = V x 2048 float32 dW
    assert fused_chunk(16384, V, 2048, 4) == 2048
    assert fused_chunk(16384, V, 3000, 2) == 4096  # a power of two below 6000
    assert fused_chunk(100, V, 2048, 2) == 100 and fused_chunk(1, V, 2, 4) == 1
    assert fused_chunk(10**6, V, 2, 4) == 64  # 64 MiB of float32 logits: 110 rows → 64
    assert fused_chunk(16384, 256, 64, 2) == 16384  # small vocabulary: one chunk (not 128-row ones)
    assert fused_chunk(10**6, 10**7, 1, 4) == 16  # never below 16 rows


def test_loss_impl_resolution_and_the_fallback_warning(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert loss_mod.resolve_loss_impl("auto", cpu) == "chunked"
    with pytest.raises(ValueError, match="fused needs CUDA"):
        loss_mod.resolve_loss_impl("fused", cpu)
    monkeypatch.setattr(loss_mod, "fused_available", lambda device: device.type == "cuda")
    assert loss_mod.resolve_loss_impl("auto", cuda) == "fused"
    monkeypatch.setattr(loss_mod, "fused_available", lambda device: False)
    monkeypatch.setattr(loss_mod, "liger_available", lambda: True)
    assert loss_mod.resolve_loss_impl("auto", cuda) == "liger"
    monkeypatch.setattr(loss_mod, "liger_available", lambda: False)
    loss_mod._warn_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=loss_mod.__name__):
        assert [loss_mod.resolve_loss_impl("auto", cuda) for _ in range(3)] == ["chunked"] * 3
    warned = [r for r in caplog.records if "liger-kernel" in r.getMessage()]
    assert len(warned) == 1, caplog.records  # once, not per call
    loss_mod._warn_fallback.cache_clear()
