"""The expert gradients of the DP replicas summed while backward runs (the rank mesh's data
parallelism, :mod:`ray_moe.mesh`).

Combine's backward already sums an expert's gradient over every token of its EP group; its DP
replicas (the same EP rank in the other EP groups) hold the same expert and must add their sums.
As the replicated parameters' buckets (:mod:`ray_moe.worker.zero`) and the clone gradients
(:mod:`ray_moe.worker.clone_grads`): a ``post_accumulate_grad`` hook on each MoE layer's expert
parameters (``w13``, ``w2``, and biases where the experts have them); once all are in, the layer's gradients (every slot, clone slots included: the
replicas share one placement, so slot s is the same expert everywhere) are copied into one
bucket in the reduction dtype and all-reduced asynchronously on the DP process group (on NCCL on
the group's stream, beside backward's kernels). Layers launch strictly in backward order on every
rank (DDP's rule). :meth:`ReplicaGradReduction.finish` launches what backward did not reach,
waits, and writes the sums where the update reads them.

(ZeRO over the replicas, ``parallel.zero_stage`` >= 1, reduce-scatters the expert gradients
instead: :class:`~ray_moe.worker.zero.ShardedReplicatedState` on the DP group.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ray_moe.worker.clone_grads import expert_grads


class ReplicaGradReduction:
    """Expert gradients all-reduced over the DP replicas, launched as backward produces them.

    Args:
        layers: the model's MoE layers, in model order.
        group: the DP process group (this rank's replicas).
        dtype: the reduction's dtype (``parallel.grad_reduce_dtype``).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], group: dist.ProcessGroup, dtype: torch.dtype) -> None:
        self.order = list(reversed(layers))  # backward's order
        self.group, self.dtype = group, dtype
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, layer in enumerate(self.order) for p in layer.expert_params()]
        self._armed = False
        self._got: list[set[int]] = []
        self._next = 0
        self._flat: list[torch.Tensor | None] = []
        self._work: list[object] = []

    def begin(self) -> None:
        """Before backward: from now on each layer's gradients leave once backward made them."""
        self._got = [set() for _ in self.order]
        self._next = 0
        self._flat = [None] * len(self.order)
        self._work = [None] * len(self.order)
        self._armed = True

    @torch.no_grad()
    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._armed:
            return
        self._got[i].add(id(p))
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and len(self._got[self._next]) == len(self.order[self._next].expert_params()):
            i, layer = self._next, self.order[self._next]
            self._next += 1
            grads = expert_grads(layer)
            flat = torch.cat([g.reshape(-1).to(self.dtype) for g in grads])
            self._flat[i] = flat
            self._work[i] = dist.all_reduce(flat, group=self.group, async_op=True)

    @torch.no_grad()
    def finish(self, grad_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After backward: the layers backward did not launch (zeros where it left no gradient),
        then every reduction waited for and its sums written into ``grad_of(param)`` for ``w13``
        and ``w2`` (the compute-dtype gradient, or the float32 master gradient: a float32 copy
        is exact, a bf16 one rounds the float32 sum once)."""
        if not self._armed:
            return
        for got, layer in zip(self._got, self.order):
            got.update(id(p) for p in layer.expert_params())
        self._launch_ready()
        self._armed = False
        for i, layer in enumerate(self.order):
            self._work[i].wait()
            offset = 0
            for p in layer.expert_params():
                g = grad_of(p)  # (a master gradient covers the native slots only)
                g.copy_(self._flat[i][offset: offset + p.numel()].view_as(p)[: g.shape[0]])
                offset += p.numel()
        self._flat, self._work = [], []

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
