"""How a rank's tokens split into the pipelined layer's chunks (``moe.pipeline_chunks``): the one
owner of the chunk rule, plain arithmetic, so the config can check it and every transport and
the pipeline size their calls from it (:mod:`ray_moe.comm.pipeline` runs the chunks)."""

from __future__ import annotations

from collections.abc import Sequence

ALIGN_TOKENS = 4  # chunk starts at multiples of 4 tokens keep [T, K] int32 rows 16-byte aligned


def chunk_weights(chunks: int | Sequence[int]) -> tuple[int, ...]:
    """``moe.pipeline_chunks`` as relative chunk sizes: C → (1,) * C; a sequence of positive
    integers as given (``[1, 6, 1]``: three chunks, the middle one six times the others). Raises
    ValueError naming what is allowed otherwise."""
    if isinstance(chunks, int) and not isinstance(chunks, bool):
        if chunks < 1:
            raise ValueError(f"pipeline_chunks must be an integer >= 1 or a list of positive integers, got {chunks!r}")
        return (1,) * chunks
    weights = tuple(chunks) if isinstance(chunks, (list, tuple)) else ()
    if not weights or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in weights):
        raise ValueError(f"pipeline_chunks must be an integer >= 1 or a list of positive integers, got {chunks!r}")
    return weights


def _round_up(n: int) -> int:
    return -(-n // ALIGN_TOKENS) * ALIGN_TOKENS


def token_chunks(tokens: int, chunks: int | Sequence[int]) -> list[tuple[int, int]]:
    """[(t0, t1)] per chunk covering [0, tokens) in order. Chunk i < C-1 takes
    ceil(tokens * w_i / sum(w)) rounded up to a multiple of 4 (as far as tokens last), the last
    chunk the rest; so trailing chunks may be short or empty (tokens < C leaves empty ones: every
    rank still makes every call). Equal weights give equal chunks of ceil(tokens / C) rounded up to 4."""
    weights = chunk_weights(chunks)
    total, bounds, start = sum(weights), [], 0
    for i, w in enumerate(weights):
        size = tokens - start if i == len(weights) - 1 else _round_up(-(-tokens * w // total))
        end = min(start + size, tokens)
        bounds.append((start, end))
        start = end
    return bounds


def chunk_capacities(max_tokens: int, chunks: int | Sequence[int]) -> list[int]:
    """Per chunk, the most tokens it holds for any rank's ``tokens <= max_tokens`` under
    :func:`token_chunks`: the ``capacity`` of that chunk's dispatch (the same on every rank).
    Chunks before the last grow with ``tokens``; the last holds at most tokens * w / sum(w)."""
    weights = chunk_weights(chunks)
    total = sum(weights)
    return [_round_up(-(-max_tokens * w // total)) for w in weights]
