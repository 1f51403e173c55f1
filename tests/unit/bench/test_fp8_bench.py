"""bench layer's FP8 section: torchao's side permutes the pairs into groups padded to 16 rows (what
``torch._scaled_grouped_mm`` needs) and back; checked here with a float32 grouped GEMM standing in
for torchao's (it leaves NaN outside the groups, as an unset output would hold), against the
float32 experts, values and gradients."""

from __future__ import annotations

import torch

from ray_moe.bench.layer.fp8 import torchao_expert_ffn, torchao_rowwise_mm
from ray_moe.model.experts import expert_ffn


def _grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    assert all(int(o) % 16 == 0 for o in offs)  # the FP8 grouped GEMM's alignment rule
    out = torch.full((a.shape[0], b_t.shape[2]), float("nan"))
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        out[lo:hi] = a[lo:hi] @ b_t[e]
        lo = hi
    return out


def test_torchao_side_permutation_matches_the_experts():
    g = torch.Generator().manual_seed(0)
    R, K, E, H, I = 30, 2, 4, 32, 16
    slot = torch.randint(0, E, (R, K), generator=g)
    slot[:, 1] = torch.where(slot[:, 1] == slot[:, 0], -1, slot[:, 1])
    slot[slot == 2] = -1  # an expert with no rows
    leaves = [torch.randn(R, H, generator=g), torch.rand(R, K, generator=g), torch.randn(E, H, 2 * I, generator=g),
              torch.randn(E, I, H, generator=g)]
    leaves = [t.requires_grad_() for t in leaves]
    x, w, w13, w2 = leaves
    w13_t = w13.detach().transpose(1, 2).contiguous().requires_grad_()
    w2_t = w2.detach().transpose(1, 2).contiguous().requires_grad_()
    got = torchao_expert_ffn(x, slot, w, w13_t, w2_t, _grouped_mm)
    want = expert_ffn(x, slot, w, w13, w2, impl="loop")
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    go = torch.randn(R, H, generator=g)
    ga = torch.autograd.grad(got, [x, w, w13_t, w2_t], go)
    gb = torch.autograd.grad(want, [x, w, w13, w2], go)
    for a, b in zip(ga, (gb[0], gb[1], gb[2].transpose(1, 2), gb[3].transpose(1, 2))):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-3)


def test_torchao_absence_is_a_row_not_an_error():
    mm, why = torchao_rowwise_mm()
    assert (mm is None) == bool(why)
