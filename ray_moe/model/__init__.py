"""The model on one rank: transformer blocks (replicated, data parallel) around expert-parallel
MoE layers.

- :mod:`build`: :func:`build_model`, a config → this rank's model (with ``model.init_from``'s weights).
- :mod:`transformer`: the byte-level language model (:class:`MoETransformer`).
- :mod:`decoder`: the HF families' decoder (:class:`Decoder`: Qwen3-MoE, Mixtral, GLM-4.5 /
  DeepSeek-V3-style blocks) from :mod:`attention`, :mod:`rope`, :mod:`norm`, :mod:`mlp`.
- :mod:`hf`: Hugging Face weights in (each rank its own tensors) and out (``ray-moe export``).
- :mod:`recompute`: activation checkpointing per block (none | moe | full).
- :mod:`moe`: :class:`MoELayer`, route → place → dispatch → experts → combine.
- :mod:`router`: every router variant, each ending in (weights, logical expert ids).
- :mod:`loss`: the LM loss from hidden states.
- :mod:`experts`: the expert side (:func:`expert_ffn`: loop, ``torch._grouped_mm`` or the Triton
  kernels) and the single-process oracle :func:`reference_moe`.
- :mod:`expert_choice`: the per-shape measured choice of expert implementation.
"""

from ray_moe.model.build import build_model
from ray_moe.model.decoder import Decoder
from ray_moe.model.moe import MoELayer
from ray_moe.model.transformer import MoETransformer

__all__ = ["Decoder", "MoELayer", "MoETransformer", "build_model"]
