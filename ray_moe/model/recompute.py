"""Activation checkpointing: a block's (or its MoE FFN's) activations are dropped after forward
and recomputed in backward (``model.activation_checkpointing``: none | moe | full).

The replay runs the MoE layers' dispatch and combine again: every rank replays the same blocks
in the same order (backward visits them in reverse on every rank), so the collectives pair up.
Early stopping of the replay is off, so a replay always runs through its collectives. While a
replay runs, its MoE layers have ``recomputing`` set: the load statistics count each token once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

MODES = ("none", "moe", "full")


def checkpointed(fn: Callable[..., Any], *args: Any, moe_layers: Iterable[Any] = ()) -> Any:
    """``fn(*args)`` with its activations recomputed in backward (non-reentrant checkpoint)."""
    layers = tuple(moe_layers)

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _replaying(layers)

    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)


@contextlib.contextmanager
def _replaying(layers: tuple[Any, ...]) -> Iterator[None]:
    for layer in layers:
        layer.recomputing = True
    try:
        yield
    finally:
        for layer in layers:
            layer.recomputing = False


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {', '.join(MODES)}")
    return mode


__all__ = ["MODES", "checkpointed", "check_mode"]
