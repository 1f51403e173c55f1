"""The one relative-error measure of the validators, the tests, the GPU tests and the smoke test."""

from __future__ import annotations

import math

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """‖a − b‖ / max(‖b‖, floor) in float64 on the CPU.

    0 when both are exactly zero; inf when only ``b`` is, when the shapes differ, or when ``a``
    holds a NaN or inf. ``floor`` is for references that are zero in exact arithmetic (the
    router's gradient with top-1: renormalised weights are identically 1), where ‖b‖ is round-off.
    """
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape or not torch.isfinite(a).all():
        return math.inf
    nb = max(b.norm().item(), floor)
    diff = (a - b).norm().item()
    if nb == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / nb
