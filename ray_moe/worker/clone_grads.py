"""Hot-expert clones' gradients sent to their owners while backward runs.

A clone slot's gradient belongs to its owner (:mod:`ray_moe.placement.clones`): after backward
every owner adds what its clones computed onto its native slot, and the clone slots are zeroed.
Done after backward, that is one ``all_to_all_single`` per MoE layer with clones, all exposed, and
a float32 copy of the layer's gradients: with 4 clone slots, Qwen3-30B-A3B cut to 2 layers spent
4.9 ms between backward and the update at W=2 instead of 2.3 (H200 ×2, measured 2026-11-26), a cost per
layer that at 48 layers outgrows what re-cloning saves. So, like ZeRO's reduce-scatters
(:mod:`ray_moe.worker.zero`):

- **Launch.** ``post_accumulate_grad`` hooks on each layer's ``w13`` and ``w2`` (and expert biases;
  non-reentrant recompute still accumulates a leaf's gradient once per backward); once
  both are in, the layer's clone rows are copied out, sent asynchronously (on NCCL the exchange
  runs on the process group's stream, beside backward's kernels) and the clone slots zeroed.
  Layers launch strictly in backward order (last layer first) on every rank, DDP's rule, so the
  collectives match across ranks whatever order the hooks fire in, on a process group of their own.
  Layers whose hooks did not fire launch after backward, in :meth:`CloneGradReduction.launch_rest`;
  every launch sends the compute-dtype gradients.
- **Add.** The owners' sums are float32 (the default, ``parallel.grad_reduce_dtype: float32``):
  they are added into the optimizer's float32 master gradients after
  :meth:`~ray_moe.worker.optim.MixedPrecisionAdamW.gather_grads`
  (:meth:`CloneGradReduction.add_received`), bit for bit the in-place reduction's result with
  float32 masters. With ``bfloat16`` they are rounded once into the compute-dtype gradient
  (summed in float32, as Megatron's bf16 gradient reduction rounds): then each layer's adds run in
  backward, two launches later (bounding the received rows kept), and the optimizer reads the
  layer's bf16 gradient directly (the one-pass update, no float32 copy).

Memory: with float32 sums every layer's received rows (and, until its exchange is waited for,
its send buffer) stay until :meth:`CloneGradReduction.add_received`: per layer, the rows of the clones
that name this rank as owner, in the compute dtype (~9.4 MB a row for Qwen3-30B-A3B's experts in
bf16; with 4 clone slots per rank ~38 MB a layer on average), at backward's peak. Rounded sums
keep at most ``max_in_flight`` layers' rows during backward; layers launched after it all keep
theirs until :meth:`CloneGradReduction.add_received`, when the activations are gone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ray_moe.placement.clones import RowExchange, add_clone_grads, launch_clone_grads


class CloneGradReduction:
    """Clone gradients onto their owners, launched as backward produces them.

    Args:
        layers: the model's MoE layers (those with clone slots take part), in model order.
        group: the process group of the exchanges (None: the default group).
        rounded: the owners' sums rounded into the compute-dtype gradients during backward
            (``parallel.grad_reduce_dtype: bfloat16``); else added by :meth:`add_received` into
            the gradients it is given (the float32 master gradients).
        max_in_flight: with ``rounded``, the layers whose received rows are kept before the oldest
            one's are added (its exchange then waited for, on NCCL by the stream only).
        in_backward: launch from backward's hooks; False: every layer in :meth:`launch_rest`
            (the rank mesh's DP replicas first sum their clone slots' gradients, then the sums go
            to the owners: :class:`~ray_moe.worker.replica_grads.ReplicaGradReduction`).
        source: where a parameter's gradient is read and its clone slots zeroed (default: its
            compute-dtype ``.grad``, zeros where backward left none; ZeRO over the replicas: its
            view in the held bucket, :meth:`~ray_moe.worker.zero.ShardedReplicatedState.gradient`).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], group: dist.ProcessGroup | None, rounded: bool,
                 max_in_flight: int = 2, in_backward: bool = True,
                 source: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._source = source
        self.order = [layer for layer in reversed(layers) if layer.placement.clone_slots]  # backward's order
        self.group, self.rounded, self.max_in_flight = group, rounded, max_in_flight
        self.in_backward = in_backward
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, layer in enumerate(self.order) for p in layer.expert_params()]
        self._armed = False
        self._got: list[set[int]] = []
        self._next = 0
        self._in_flight: list[tuple[torch.nn.Module, RowExchange]] = []
        self.launched_in_backward = 0  # layers the last backward launched itself (not launch_rest)

    def begin(self) -> None:
        """Before backward: from now on each layer's clone gradients leave once backward made them."""
        self._got = [set() for _ in self.order]
        self._next = 0
        self._in_flight = []
        self._armed = True
        self.launched_in_backward = 0

    @torch.no_grad()
    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._armed or not self.in_backward:
            return
        self._got[i].add(id(p))
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and len(self._got[self._next]) == len(self.order[self._next].expert_params()):
            layer = self.order[self._next]
            self._next += 1
            self.launched_in_backward += self._armed
            exchange = launch_clone_grads(layer.placement, layer.rank, self._grads(layer), self.group)
            if exchange is None:
                continue
            self._in_flight.append((layer, exchange))
            while self.rounded and self._armed and len(self._in_flight) > self.max_in_flight:
                done, oldest = self._in_flight.pop(0)
                add_clone_grads(oldest, self._grads(done))

    def _grads(self, layer: torch.nn.Module) -> list[torch.Tensor]:
        if self._source is None:
            return expert_grads(layer)
        return [self._source(p) for p in layer.expert_params()]

    @torch.no_grad()
    def launch_rest(self) -> None:
        """After backward: the layers backward did not launch, from
        their compute-dtype gradients (every launch sends those, so all ranks' exchanges match)."""
        if not self._armed:
            return
        for got, layer in zip(self._got, self.order):
            got.update(id(p) for p in layer.expert_params())
        self._armed = False
        self._launch_ready()

    @torch.no_grad()
    def add_received(self, grad_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After :meth:`launch_rest`: every owner's sums added into ``grad_of(param)`` (rounded:
        the compute-dtype gradient, before the optimizer gathers it; else its float32 master
        gradient, after)."""
        for layer, exchange in self._in_flight:
            add_clone_grads(exchange, [grad_of(p) for p in layer.expert_params()])
        self._in_flight = []

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def expert_grads(layer: torch.nn.Module) -> list[torch.Tensor]:
    """The layer's expert parameters' (``w13``, ``w2``, biases) compute-dtype gradients (zeros where
    backward left none)."""
    for p in layer.expert_params():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in layer.expert_params()]
