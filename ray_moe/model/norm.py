"""RMSNorm as the Hugging Face families compute it (so bf16 rounds where transformers rounds);
``eps=None`` is float32's machine epsilon, what ``torch.nn.RMSNorm``'s default computes (it
normalises in float32 for bf16 inputs too, with that type's epsilon): the byte model's norms."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``: the normalisation in float32, cast back to x's dtype, then
    scaled by the weight (in the model dtype). x: [..., dim] → same shape and dtype."""

    def __init__(self, dim: int, eps: float | None, device: torch.device | str = "cpu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        eps = self.eps if self.eps is not None else torch.finfo(torch.float32).eps  # h is float32
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
