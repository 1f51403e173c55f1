"""The single-rank transport: every expert is local, rows stay where they are (W = 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ray_moe.comm.base import Layout, Transport


@dataclass
class LocalLayout(Layout):
    num_tokens: int
    top_k: int


class LocalTransport(Transport):
    """Identity dispatch/combine for one rank; the single-GPU layer and the oracle's twin."""

    name = "local"

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=1)

    def dispatch_forward(self, x, weight, dest_rank, dest_slot, reuse_outputs=False):
        T, K = dest_slot.shape
        self.dispatched_bytes += x.numel() * x.element_size()
        return x, dest_slot.to(torch.int32), weight.float(), LocalLayout(T, K)

    def dispatch_backward(self, grad_recv_x, grad_recv_weight, layout):
        return grad_recv_x, grad_recv_weight

    def combine_forward(self, partial, layout):
        return partial

    def combine_backward(self, grad_out, layout):
        return grad_out
