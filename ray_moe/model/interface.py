"""What the engine needs of a model: the interface :class:`~ray_moe.model.decoder.Decoder`
implements for every architecture (the byte model and the HF families)."""

from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from ray_moe.arch import ArchSpec
from ray_moe.model.kv_cache import KVCache
from ray_moe.model.moe import MoELayer


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder-only MoE language model shard on one rank.

    ``spec``: the architecture it was built from; ``lm_head``: the output projection (its
    ``weight`` [V, H], possibly the embedding's); ``source_tensors``: the names of the
    ``model.init_from`` tensors this rank opened (empty without one).
    """

    spec: ArchSpec
    lm_head: nn.Linear
    source_tensors: tuple[str, ...]

    def moe_layers(self) -> list[MoELayer]:
        """The expert-parallel layers in block order (load statistics, placements, clones)."""
        ...

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """idx: int64/int32 [B, L] → (final-norm hidden states [B, L, H] in the model dtype, aux
        loss float32 scalar); with ``cache`` (:meth:`new_cache`) idx continues the cached positions."""
        ...

    def new_cache(self, capacity: int) -> KVCache:
        """An empty KV cache of ``capacity`` positions for :meth:`hidden_states`."""
        ...

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx: [B, L] → (logits float32 [B, L, V], aux loss float32 scalar)."""
        ...

    # the nn.Module methods the engine and the optimizer use
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def train(self, mode: bool = True) -> "LanguageModel": ...

    def eval(self) -> "LanguageModel": ...
