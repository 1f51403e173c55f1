"""The model on one rank: transformer blocks (replicated, data parallel) around expert-parallel
MoE layers.

- :mod:`build`: :func:`build_model`, a config and its resolved architecture → this rank's model
  (with ``model.init_from``'s weights).
- :mod:`interface`: :class:`LanguageModel`, what the engine needs of a model.
- :mod:`decoder`: the one decoder (:class:`Decoder`) of every architecture: the byte model and the
  HF families (Qwen3-MoE, Mixtral, GLM-4.5 / DeepSeek-V3-style blocks), from :mod:`attention`,
  :mod:`rope`, :mod:`norm`, :mod:`mlp`.
- :mod:`hf`: Hugging Face weights in (each rank its own tensors) and out (``ray-moe export``).
- :mod:`recompute`: activation checkpointing per block (none | moe | full).
- :mod:`moe`: :class:`MoELayer` (shape: :class:`MoELayerSpec`), route → place → dispatch → experts → combine.
- :mod:`router`: every router variant, each ending in (weights, logical expert ids).
- :mod:`loss`: the LM loss from hidden states.
- :mod:`experts`: the expert side (:func:`expert_ffn`: loop, ``torch._grouped_mm`` or the Triton
  kernels) and the single-process oracle :func:`reference_moe`.
- :mod:`expert_choice`: the per-shape measured choice of expert implementation.
- :mod:`dense_fp8`: ``model.dense_precision: fp8``, the blocks' dense linears through torchao's
  float8 training.
"""

from ray_moe.model.build import build_model
from ray_moe.model.decoder import Decoder
from ray_moe.model.interface import LanguageModel
from ray_moe.model.moe import MoELayer, MoELayerSpec

__all__ = ["Decoder", "LanguageModel", "MoELayer", "MoELayerSpec", "build_model"]
