"""The one description of a validation problem, shared by the layer and transport validators,
the tests, the GPU tests and the smoke test.

Routings force the edge cases: ``random``; ``one_expert`` (every token's first choice is expert 0);
``empty_rank`` (no token goes to the last rank's experts); ``empty_expert`` (no token picks expert
1). Other edge cases come from the fields: ``top_k=1``, ``top_k=num_experts``,
``tokens_per_rank=(1,)``, ``tokens_per_rank=(0, 5)`` (a source with no tokens), uneven counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ray_moe.comm.base import BufferSpec
from ray_moe.config import element_size, torch_dtype
from ray_moe.model.moe import MoELayerSpec

ROUTINGS = ("random", "one_expert", "empty_rank", "empty_expert")


@dataclass(frozen=True)
class Case:
    """A seeded global problem every rank builds identically.

    tokens_per_rank is cycled over the ranks; placement is a ``Placement.to_dict()`` (None:
    native); expert_impl is the layer's (``moe.expert_impl``).
    """

    num_experts: int = 8
    top_k: int = 2
    hidden: int = 32
    expert_hidden: int = 48
    tokens_per_rank: tuple[int, ...] = (16,)
    routing: str = "random"
    seed: int = 0
    dtype: str = "float32"
    expert_impl: str = "auto"
    placement: dict | None = None
    expert_precision: str = "bf16"  # moe.expert_precision (fp8: compare with FP8's error bounds)

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        object.__setattr__(self, "tokens_per_rank", tuple(self.tokens_per_rank))
        self.layer_spec()  # the layer-shape rules (top_k <= num_experts, ...) are the layer spec's

    def layer_spec(self, dtype: torch.dtype | None = None) -> MoELayerSpec:
        """The MoE layer this case runs (``dtype``: the case's by default)."""
        return MoELayerSpec(self.hidden, self.num_experts, self.top_k, self.expert_hidden,
                            dtype=dtype or torch_dtype(self.dtype), expert_impl=self.expert_impl,
                            expert_precision=self.expert_precision)

    def tokens(self, rank: int) -> int:
        return self.tokens_per_rank[rank % len(self.tokens_per_rank)]

    def applies_to(self, world_size: int) -> str | None:
        """None when the case can run on ``world_size`` ranks, else why not (an empty rank
        needs a second rank to receive everything)."""
        if self.routing == "empty_rank" and world_size < 2:
            return "routing empty_rank needs at least 2 ranks"
        if self.num_experts % world_size:
            return f"num_experts={self.num_experts} is not divisible by {world_size} ranks"
        return None

    def buffer_spec(self) -> BufferSpec:
        """What a transport must hold to run this case."""
        return BufferSpec(max_tokens=max(1, *self.tokens_per_rank), hidden=self.hidden,
                          elem_bytes=element_size(self.dtype), max_top_k=self.top_k)

    def but(self, **changes: Any) -> "Case":
        """A copy with some fields changed."""
        return replace(self, **changes)


# The transport's edge cases (each applied on top of a base case).
EDGE_CASES: tuple[dict[str, Any], ...] = (
    dict(routing="random"),
    dict(routing="empty_rank"),
    dict(routing="empty_expert"),
    dict(routing="one_expert"),
    dict(routing="one_expert", top_k=1),
    dict(top_k=1),
    dict(tokens_per_rank=(1,)),
    dict(tokens_per_rank=(0, 5)),
    dict(tokens_per_rank=(1, 40), top_k=4),
)
