"""The model on one rank: transformer blocks (replicated, data parallel) around expert-parallel
MoE layers.

- :mod:`transformer`: the language model (:class:`MoETransformer`).
- :mod:`moe`: :class:`MoELayer`, route → place → dispatch → experts → combine.
- :mod:`router`: every router variant, each ending in (weights, logical expert ids).
- :mod:`loss`: the LM loss from hidden states.
- :mod:`experts`: the expert side (:func:`expert_ffn`: loop, ``torch._grouped_mm`` or the Triton
  kernels) and the single-process oracle :func:`reference_moe`.
- :mod:`expert_choice`: the per-shape measured choice of expert implementation.
"""

from ray_moe.model.moe import MoELayer
from ray_moe.model.transformer import MoETransformer

__all__ = ["MoELayer", "MoETransformer"]
