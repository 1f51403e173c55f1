"""The language-model loss from final hidden states: LM head + cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy.

    Args:
        hidden: [N, H] final hidden states (model dtype).
        head_weight: [V, H] the LM head's weight.
        targets: int64 [N] token ids.
    Returns:
        float32 scalar: mean over the N positions of -log softmax(hidden @ head_weightᵀ)[target].
    """
    logits = (hidden @ head_weight.t()).float()
    return F.cross_entropy(logits, targets)
