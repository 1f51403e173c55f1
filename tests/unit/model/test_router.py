"""Routers: the bf16-split router logits against float32 (CPU stand-in for the GPU mm)."""

from __future__ import annotations

import torch


def test_split_router_logits_match_float32():
    """The bf16-split router GEMMs (run here with the CPU stand-in for the float32-output mm) give
    float32-accurate logits and gradients."""
    from ray_moe.model.router import SplitRouterLogits
    from tests.kernel_cases import check_router_logits

    for T, H, E in [(37, 64, 8), (1, 16, 3), (0, 16, 4)]:
        errs = check_router_logits(SplitRouterLogits.apply, T, H, E, "cpu", seed=T)
        assert errs["logits"] < 1e-4 and errs["dw"] < 1e-4 and errs["dx"] < 1e-2, (T, errs)  # dx is bf16


def test_router_logits_plain_form_off_cuda():
    from ray_moe.model.router import router_logits

    x, w = torch.randn(5, 8), torch.randn(8, 3)
    assert torch.equal(router_logits(x, w), x @ w)
