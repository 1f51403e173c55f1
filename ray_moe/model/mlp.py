"""The dense SwiGLU MLP of the Hugging Face families: dense layers and shared experts
(replicated, data parallel). Names follow transformers (``gate_proj``, ``up_proj``, ``down_proj``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init


class GatedMLP(nn.Module):
    """x [..., H] → down(silu(gate(x)) * up(x)) [..., H]; no biases."""

    def __init__(self, d_model: int, hidden: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.gate_proj = skip_init(nn.Linear, d_model, hidden, bias=False, device=device)
        self.up_proj = skip_init(nn.Linear, d_model, hidden, bias=False, device=device)
        self.down_proj = skip_init(nn.Linear, hidden, d_model, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
