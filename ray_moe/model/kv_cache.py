"""Keys and values of the positions a model has already seen, for incremental decoding.

``Engine.generate`` fills a cache with the prompt (one forward over it), then feeds one token per
forward: attention reads the cached keys and values instead of recomputing the whole context.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per attention layer, keys and values [B, kv_heads, capacity, head_dim] of positions
    ``0 .. length-1``; a forward over positions ``length .. length+L-1`` writes its own through
    :meth:`update` (every layer), then the model calls :meth:`advance` once.

    Buffers are allocated by the first update of each layer, in the keys' dtype and device.
    """

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, kv_heads, L, head_dim] of the next L positions → every cached position's
        keys and values, [B, kv_heads, length + L, head_dim] (views of the cache)."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {end} were asked for")
        if self._keys[layer] is None:
            shape = (*k.shape[:2], self.capacity, k.shape[3])
            self._keys[layer] = k.new_empty(shape)
            self._values[layer] = v.new_empty((*v.shape[:2], self.capacity, v.shape[3]))
        keys, values = self._keys[layer], self._values[layer]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, positions: int) -> None:
        """The forward that wrote ``positions`` new positions into every layer has finished."""
        self.length += positions


def causal_mask(queries: int, keys: int) -> bool:
    """``is_causal`` for attention of the last ``queries`` positions over ``keys`` positions: a
    whole sequence is causal; one new position attends to every cached one."""
    if queries == keys:
        return True
    if queries == 1:
        return False
    raise ValueError(f"a cached forward takes one position at a time after the first; got {queries} "
                     f"positions after {keys - queries} cached")
