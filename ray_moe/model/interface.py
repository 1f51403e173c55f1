"""What the engine needs of a model: the interface :class:`~ray_moe.model.decoder.Decoder`
implements for every architecture (the byte model and the HF families)."""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

import torch
from torch import nn

from ray_moe.arch import ArchSpec
from ray_moe.model.kv_cache import KVCache
from ray_moe.model.moe import MoELayer


class LanguageModel(Protocol):
    """A decoder-only MoE language model shard on one rank (an ``nn.Module``).

    - ``spec``: the architecture it was built from.
    - ``lm_head``: the output projection (its ``weight`` [V, H], possibly the embedding's).
    - ``source_tensors``: the names of the ``model.init_from`` tensors this rank opened (empty
      without one).
    - ``moe_layers()``: the expert-parallel layers in block order (load statistics, placements,
      clones).
    - ``hidden_states(idx, cache=None)``: idx int64/int32 [B, L] → (final-norm hidden states
      [B, L, H] in the model dtype, aux loss float32 scalar); with ``cache`` (``new_cache``) idx
      continues the cached positions and is added to them.
    - ``new_cache(capacity)``: an empty KV cache of ``capacity`` positions.
    - calling it: idx [B, L] → (logits float32 [B, L, V], aux loss float32 scalar).
    - the ``nn.Module`` methods the engine and the optimizer use: ``parameters``,
      ``named_parameters``, ``modules``, ``train``, ``eval``.
    """

    spec: ArchSpec
    lm_head: nn.Linear
    source_tensors: tuple[str, ...]
    moe_layers: Callable[[], list[MoELayer]]
    hidden_states: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    new_cache: Callable[[int], KVCache]
    __call__: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    parameters: Callable[..., Iterator[nn.Parameter]]
    named_parameters: Callable[..., Iterator[tuple[str, nn.Parameter]]]
    modules: Callable[[], Iterator[nn.Module]]
    train: Callable[..., nn.Module]
    eval: Callable[[], nn.Module]
