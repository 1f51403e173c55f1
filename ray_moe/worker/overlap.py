"""The optimizer update of step n on a side stream, overlapped with step n + 1's forward.

The update is memory-bound (~20 bytes per parameter with bf16 moments) and, with global-norm
clipping, cannot start before backward ends. Nothing else runs after it in a step, but the next
step's forward needs only the first block's parameters to begin. So the update runs on a side
stream in forward order (embedding, block 0, block 1, ..., final norm and LM head), and records an
event when each block's parameters are done. The next forward waits, block by block, on the main
stream for that block's event only: block i's update runs beside blocks < i's forward. (The same
idea as FSDP's prefetched all-gathers, applied to the update.)

Groups (:func:`update_groups`, from parameter names): 0 the embeddings (``embed*``), 1 + i the
parameters of ``layers.i``, the last everything else (final norm, LM head). Waits: group 0 before
the forward (:meth:`UpdateOverlap.wait_group`), each block's in a forward pre-hook on
``model.layers[i]``, and all of it in a pre-hook on ``model.norm`` (the LM head's weight is read
after it). A model without ``layers`` and ``norm`` waits for everything before its forward.

Collectives: a parameter may be reported with the collective that writes it (ZeRO's all-gathers,
``parallel.overlap_param_gather``: NCCL runs them on its own stream, after the side stream's
update of their chunk). Its block then also waits for that collective, on the main stream
(``work.wait()``), and the side stream never waits for one: the experts' update runs while the
replicated parameters travel.

Safety:
- the side stream first waits for the main stream (backward, the norm, the gradient reductions);
- every gradient the update reads is marked as used by the side stream (``record_stream``), so
  freeing it on the host does not hand its memory to the next forward while the update reads it;
- a block's clones (hot-expert re-cloning) are refreshed from their owners on the side stream
  right after its expert weights' update, before its event (the engine's ``_update``); a group
  whose expert weights are not reported one by one gets no early event (``late_groups``): its
  clones are refreshed after the whole update, so its forward waits for everything;
- anything else that reads parameters or optimizer state between steps (evaluation, generation,
  checkpoints, new placements, loading) calls :meth:`UpdateOverlap.wait_all` first.

CUDA only; the engine runs the update in place elsewhere.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

_LAYER = re.compile(r"layers\.(\d+)\.")


def update_groups(names: Sequence[str], num_layers: int) -> list[int]:
    """Per parameter name, its update group: 0 for the embeddings (``embed*``), ``1 + i`` for
    ``layers.i.*``, ``num_layers + 1`` for the rest (final norm, LM head)."""
    groups = []
    for name in names:
        m = _LAYER.match(name)
        if m:
            groups.append(1 + int(m.group(1)))
        elif name.startswith("embed"):
            groups.append(0)
        else:
            groups.append(num_layers + 1)
    return groups


class UpdateOverlap:
    """Runs an update on a side stream and makes the next forward wait block by block.

    Args:
        model: the model; forward pre-hooks go on ``model.layers[i]`` and ``model.norm``.
        names: the parameter names the update covers, in the order it updates them.
        params: those parameters (same order).
        device: the CUDA device.
        late_groups: groups that must wait for the whole update (blocks whose clones are
            refreshed after it).
    """

    def __init__(self, model: nn.Module, names: Sequence[str], params: Sequence[torch.Tensor],
                 device: torch.device, late_groups: Collection[int] = ()) -> None:
        layers, norm = getattr(model, "layers", None), getattr(model, "norm", None)
        self.blockwise = isinstance(layers, nn.ModuleList) and isinstance(norm, nn.Module)
        n_layers = len(layers) if self.blockwise else 0
        self.final = n_layers + 1
        groups = update_groups(names, n_layers)
        self._group = {id(p): g for p, g in zip(params, groups, strict=True)}
        self._late = frozenset(late_groups)
        self._total = Counter(groups)
        self.stream = torch.cuda.Stream(device)
        self.device = device
        self._events: dict[int, torch.cuda.Event] = {}  # group -> its event, while an update is pending
        self._prelude: torch.cuda.Event | None = None  # after every parameter not reported one by one
        self._final: torch.cuda.Event | None = None
        self._left: Counter = Counter()
        self._works: dict[int, list] = {}  # group -> collectives writing its parameters, while pending
        self._hooks = []
        if self.blockwise:
            for i, layer in enumerate(layers):
                self._hooks.append(layer.register_forward_pre_hook(lambda *_, g=1 + i: self.wait_group(g)))
            self._hooks.append(norm.register_forward_pre_hook(lambda *_: self.wait_all()))

    @property
    def pending(self) -> bool:
        """Whether an update launched on the side stream has not been waited for yet."""
        return self._final is not None

    def launch(self, update: Callable[[Callable[[torch.Tensor | None], None]], None],
               grads: Sequence[torch.Tensor]) -> None:
        """Run ``update(done)`` on the side stream. ``update`` calls ``done(None)`` once every
        parameter it does not report one by one is updated, then ``done(param)`` after each of the
        ``params`` given at construction (:meth:`MixedPrecisionAdamW.step`'s protocol), or
        ``done(param, work)`` where a collective ``work`` writes it (:meth:`ShardedReplicatedState.step`'s);
        groups with none of those wait for ``done(None)``'s event, unreported work for the final one.
        ``grads``: every tensor the update reads that the main stream made and may free meanwhile."""
        self.wait_all()  # (the previous update: done by now in any forward, kept for direct calls)
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        for g in grads:
            g.record_stream(self.stream)
        self._left = Counter(self._total)
        self._prelude = None
        self._works = {}
        with torch.cuda.stream(self.stream):
            update(self._done)
            self._final = torch.cuda.Event()
            self._final.record(self.stream)

    def _done(self, param: torch.Tensor | None, work=None) -> None:
        if param is None:
            self._prelude = torch.cuda.Event()
            self._prelude.record(self.stream)
            return
        g = self._group.get(id(param))
        if g is None:
            return
        if work is not None:
            works = self._works.setdefault(g, [])
            if not any(w is work for w in works):
                works.append(work)
        self._left[g] -= 1
        if self._left[g] == 0 and g not in self._late and g != self.final:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self._events[g] = ev

    def wait_group(self, group: int) -> None:
        """The current stream waits for the update of ``group``'s parameters (and everything the
        side stream did before them); without a group event, for the whole update."""
        if not self.pending:
            return
        if not self.blockwise:
            self.wait_all()
            return
        ev = self._events.pop(group, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            for work in self._works.pop(group, ()):
                work.wait()
        elif group in self._late or group == self.final:
            self.wait_all()
        elif group not in self._total:  # none of its parameters reported one by one
            if self._prelude is None:
                self.wait_all()
            else:
                torch.cuda.current_stream(self.device).wait_event(self._prelude)
        elif self._left[group] > 0:  # (its parameters were not all reported: be safe)
            self.wait_all()

    def wait_all(self) -> None:
        """The current stream waits for the whole pending update; nothing is pending after."""
        if not self.pending:
            return
        torch.cuda.current_stream(self.device).wait_event(self._final)
        for works in self._works.values():
            for work in works:
                work.wait()
        self._final = self._prelude = None
        self._events.clear()
        self._works = {}

    def close(self) -> None:
        self.wait_all()
        for h in self._hooks:
            h.remove()
        self._hooks = []
