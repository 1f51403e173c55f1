"""Triton kernels of the expert side of an MoE layer, each with a pure-torch reference.

- :mod:`routing`: fused top-k softmax (``topk_softmax``) and the counting-sort pair layout.
- :mod:`grouped_swiglu`: grouped GEMMs (gather-fused gate/up with SwiGLU epilogue, down, and
  their backward GEMMs) over pairs grouped by slot.
- :mod:`gather_sum`: the weighted combine back to rows.
- :mod:`empty_groups`: zeroes the weight gradients of experts that got no rows (only those).
- :mod:`expert_ffn`: ``expert_ffn_triton``, the autograd Function tying them together.
"""

from ray_moe.kernels.expert_ffn import expert_ffn_triton
from ray_moe.kernels.routing import (
    PairLayout,
    pair_layout,
    pair_layout_reference,
    topk_softmax,
    topk_softmax_reference,
)

__all__ = [
    "PairLayout",
    "expert_ffn_triton",
    "pair_layout",
    "pair_layout_reference",
    "topk_softmax",
    "topk_softmax_reference",
]
