"""What of a model's state is checkpointed and synchronised besides its parameters."""

from __future__ import annotations

import torch
from torch import nn


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's persistent buffers: state that training changes besides the
    parameters (the balancing bias of sigmoid routers), replicated on every rank."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = dict(model.named_buffers())
    return [(n, buffers[n]) for n in model.state_dict(keep_vars=True) if n not in params]
