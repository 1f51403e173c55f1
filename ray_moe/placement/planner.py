"""The clone planner (pure, deterministic, node-aware; no torch.distributed).

:func:`plan_placement` turns one layer's loads (from :class:`ray_moe.placement.loads.LoadTracker`) into a
:class:`~ray_moe.placement.Placement` that clones hot experts into free clone slots and sets the
shares so that every rank expects about the same number of tokens.

Planner, in three parts:

1. **Which clones** (EPLB/ECHO-style greedy): start from the native experts plus the clones of the
   previous placement; while the predicted max/mean tokens per rank is above ``1 + tolerance``
   and slots are free, take the most loaded rank, clone its expert with the most expected tokens
   there (ties: highest load per replica), and put the clone on the least loaded rank with a free
   slot that does not already hold that expert -- inside the node that sends most of the
   expert's tokens when that rank can absorb as much (node-aware), and within
   ``max_cross_node_clones``.
2. **How many tokens per replica** (water-filling): block coordinate descent over experts, each
   step water-filling one expert's tokens over the ranks of its replicas. It converges to the
   minimiser of the sum of squared rank loads, which on this flow polytope is also the
   lexicographically min-max solution (max rank load as small as possible, then the next...).
3. **Which source sends where**: per expert a small transportation problem from source ranks to
   replicas with the per-replica totals fixed, filled greedily by tiers: the replica on the
   source's own rank, then replicas on its node, then the rest. Shares are the result divided by
   each source's tokens.

Previous placements are kept when possible: the plan built on top of the previous clones is used
unless a plan from scratch predicts a clearly lower imbalance (``hysteresis``); then the least used
1, 2, 4, ... previous clones are dropped and the freed slots refilled, until the result is within
``hysteresis`` of the plan from scratch (which is the last resort). Clones that stay keep their slots. Same loads and same previous placement give back the previous
placement object itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ray_moe.placement.loads import ArrayLike
from ray_moe.placement.loads import as_f64 as _as_f64
from ray_moe.placement.placement import Placement, Replica


# ============================================================================ predictions
def replica_tokens(loads: ArrayLike, placement: Placement) -> np.ndarray:
    """float64 [E, R_max]: expected tokens per replica.

    loads: [E] tokens per expert (sources assumed equal: each sends loads/W) or [W_src, E] tokens
    per source rank and expert.
    """
    L = _as_f64(loads)
    W, E = placement.world_size, placement.num_experts
    shares = _as_f64(placement.shares)  # [W, E, R]
    if L.shape == (E,):
        return (L / W)[:, None] * shares.sum(0)
    if L.shape == (W, E):
        return np.einsum("se,ser->er", L, shares)
    raise ValueError(f"loads has shape {L.shape}; expected [{E}] or [{W}, {E}]")


def rank_tokens(loads: ArrayLike, placement: Placement) -> np.ndarray:
    """float64 [W]: expected tokens computed by each rank (loads as in :func:`replica_tokens`)."""
    X = replica_tokens(loads, placement)
    out = np.zeros(placement.world_size)
    for e, reps in enumerate(placement.replicas):
        for r, rep in enumerate(reps):
            out[rep.rank] += X[e, r]
    return out


def predicted_imbalance(loads: ArrayLike, placement: Placement) -> float:
    """max / mean expected tokens per rank (1.0 = perfect; 1.0 when there are no tokens)."""
    t = rank_tokens(loads, placement)
    mean = t.mean()
    return float(t.max() / mean) if mean > 0 else 1.0


# ============================================================================ planner internals
@dataclass
class _Layout:
    """Replica sets under construction: per expert the ranks of its replicas (owner first)."""

    E: int
    W: int
    n: int  # native experts per rank
    C: int  # clone slots per rank
    ranks: list[list[int]]  # per expert: [owner, clone ranks...]
    kept_slot: dict[tuple[int, int], int]  # (expert, rank) -> slot to reuse from the previous plan

    def free(self, q: int) -> int:
        return self.C - sum(q in r[1:] for r in self.ranks)

    def copy(self) -> "_Layout":
        return _Layout(self.E, self.W, self.n, self.C, [list(r) for r in self.ranks], dict(self.kept_slot))


def _waterfill(base: np.ndarray, amount: float) -> np.ndarray:
    """Split ``amount`` over bins with levels ``base`` so the filled ones end level; returns the fill."""
    order = np.argsort(base, kind="stable")
    b = base[order]
    k, level = len(b), b[-1]
    csum = np.cumsum(b)
    for i in range(1, len(b) + 1):
        level = (amount + csum[i - 1]) / i
        if i == len(b) or level <= b[i]:
            k = i
            break
    fill = np.zeros_like(base)
    fill[order[:k]] = np.maximum(level - b[:k], 0.0)
    s = fill.sum()
    if s > 0:
        fill *= amount / s
    return fill


def _balance_replicas(loads: np.ndarray, ranks: list[list[int]], W: int,
                      sweeps: int = 2000, rtol: float = 1e-12) -> tuple[np.ndarray, list[np.ndarray]]:
    """Expected tokens per replica that minimise the sum of squared rank loads.

    loads: float64 [E]; ranks: per expert the ranks of its replicas. Returns (rank loads [W],
    per expert an array of tokens per replica). Deterministic (fixed sweep order).
    """
    X = [np.zeros(len(r)) for r in ranks]
    rank_load = np.zeros(W)
    multi = []
    for e, r in enumerate(ranks):
        X[e][0] = loads[e]
        rank_load[r[0]] += loads[e]
        if len(r) > 1 and loads[e] > 0:
            multi.append(e)
    tol = rtol * max(loads.sum(), 1.0)
    for _ in range(sweeps):
        moved = 0.0
        for e in multi:
            idx = np.asarray(ranks[e])
            base = rank_load[idx] - X[e]
            new = _waterfill(base, loads[e])
            moved = max(moved, float(np.abs(new - X[e]).max()))
            rank_load[idx] = base + new
            X[e] = new
        if moved <= tol:
            break
    rank_load = np.zeros(W)
    for e, r in enumerate(ranks):
        np.add.at(rank_load, np.asarray(r), X[e])
    return rank_load, X


def _source_shares(src: np.ndarray, X: np.ndarray, rep_ranks: list[int], node_of_rank: Sequence[int]) -> np.ndarray:
    """One expert's shares [W_src, R] from sources' tokens src [W_src] and replica totals X [R].

    Greedy transportation by tiers: own rank, then own node, then any. Sources with no tokens get
    shares proportional to X (or everything on the owner when X is all zero).
    """
    W, R = len(src), len(rep_ranks)
    if R == 1:
        return np.ones((W, 1))
    total = src.sum()
    demand = X * (total / X.sum()) if X.sum() > 0 else np.eye(R)[0] * total
    supply = src.copy()
    flow = np.zeros((W, R))
    rep_node = [node_of_rank[q] for q in rep_ranks]

    def move(s: int, r: int) -> None:
        f = min(supply[s], demand[r])
        if f > 0:
            flow[s, r] += f
            supply[s] -= f
            demand[r] -= f

    for s in range(W):  # tier 1: the replica on the source's own rank
        for r, q in enumerate(rep_ranks):
            if q == s:
                move(s, r)
    for s in range(W):  # tier 2: replicas on the source's node
        for r in range(R):
            if rep_node[r] == node_of_rank[s]:
                move(s, r)
    for s in range(W):  # tier 3: anywhere
        for r in range(R):
            move(s, r)
    shares = np.zeros((W, R))
    fallback = X / X.sum() if X.sum() > 0 else np.eye(R)[0]
    for s in range(W):
        shares[s] = flow[s] / src[s] if src[s] > 0 else fallback
    shares[shares < 1e-12] = 0.0
    return shares / shares.sum(1, keepdims=True)


def _preferred_node(e: int, owner: int, src: np.ndarray | None, node_of_rank: Sequence[int]) -> int:
    """The node that sends most of expert e's tokens (the owner's node without source loads)."""
    if src is None or src[:, e].sum() <= 0:
        return node_of_rank[owner]
    per_node: dict[int, float] = {}
    for s, t in enumerate(src[:, e]):
        per_node[node_of_rank[s]] = per_node.get(node_of_rank[s], 0.0) + float(t)
    best = max(per_node.values())
    if per_node.get(node_of_rank[owner], -1.0) >= best * (1 - 1e-9):
        return node_of_rank[owner]
    return min(k for k, v in per_node.items() if v >= best * (1 - 1e-9))


def _cross_node_count(layout: _Layout, node_of_rank: Sequence[int]) -> int:
    return sum(node_of_rank[q] != node_of_rank[r[0]] for r in layout.ranks for q in r[1:])


def _add_clones(layout: _Layout, loads: np.ndarray, node_of_rank: Sequence[int], src: np.ndarray | None,
                max_cross_node_clones: int, tolerance: float, prev_ranks: set[tuple[int, int]]) -> None:
    """Fill free clone slots greedily (in place) until balanced within tolerance or stuck."""
    W = layout.W
    mean = loads.sum() / W
    if mean <= 0:
        return
    while True:
        rank_load, X = _balance_replicas(loads, layout.ranks, W)
        if rank_load.max() <= mean * (1 + tolerance):
            return
        free = [layout.free(q) for q in range(W)]
        if not any(free):
            return
        cross_left = (max_cross_node_clones < 0
                      or _cross_node_count(layout, node_of_rank) < max_cross_node_clones)
        placed = False
        for hot in sorted(range(W), key=lambda q: (-rank_load[q], q)):
            if rank_load[hot] <= mean * (1 + tolerance):
                break
            # experts with tokens on the hot rank: most tokens there first, then most load per replica
            cands = []
            for e, r in enumerate(layout.ranks):
                if hot in r:
                    x = X[e][r.index(hot)]
                    if x > 0:
                        cands.append((-x, -loads[e] / len(r), e))
            for _, _, e in sorted(cands):
                owner = layout.ranks[e][0]
                targets = [q for q in range(W) if free[q] > 0 and q not in layout.ranks[e]
                           and (cross_left or node_of_rank[q] == node_of_rank[owner])
                           and rank_load[q] < rank_load[hot]]
                if not targets:
                    continue
                key = lambda q: (rank_load[q], (e, q) not in prev_ranks, q)  # noqa: E731
                best = min(targets, key=key)
                pref_node = _preferred_node(e, owner, src, node_of_rank)
                in_node = [q for q in targets if node_of_rank[q] == pref_node]
                if in_node:
                    best_in = min(in_node, key=key)
                    need = min(X[e][layout.ranks[e].index(hot)], rank_load[hot] - mean)
                    room_global = (rank_load[hot] - rank_load[best]) / 2
                    room_in = (rank_load[hot] - rank_load[best_in]) / 2
                    if room_in >= min(need, room_global) * (1 - 1e-9):
                        best = best_in
                layout.ranks[e].append(best)
                placed = True
                break
            if placed:
                break
        if not placed:
            return


def _build_placement(layout: _Layout, loads: np.ndarray, src: np.ndarray | None,
                     node_of_rank: Sequence[int], version: int) -> Placement:
    """Assign slots (reusing kept ones), order replicas canonically, compute shares."""
    W, E, n, C = layout.W, layout.E, layout.n, layout.C
    taken = {q: set() for q in range(W)}
    slot_of: dict[tuple[int, int], int] = {}
    for e, r in enumerate(layout.ranks):
        for q in r[1:]:
            s = layout.kept_slot.get((e, q))
            if s is not None and s not in taken[q]:
                slot_of[(e, q)] = s
                taken[q].add(s)
    for e, r in enumerate(layout.ranks):
        for q in r[1:]:
            if (e, q) not in slot_of:
                s = min(set(range(n, n + C)) - taken[q])
                slot_of[(e, q)] = s
                taken[q].add(s)
    replicas: list[list[Replica]] = []
    ordered_ranks: list[list[int]] = []
    for e, r in enumerate(layout.ranks):
        clones = sorted(r[1:])
        ordered_ranks.append([r[0]] + clones)
        replicas.append([Replica(r[0], e % n)] + [Replica(q, slot_of[(e, q)]) for q in clones])
    _, X = _balance_replicas(loads, ordered_ranks, W)
    R = max(len(r) for r in replicas)
    shares = np.zeros((W, E, R))
    source = src if src is not None else np.repeat((loads / W)[None, :], W, axis=0)
    for e in range(E):
        shares[:, e, : len(replicas[e])] = _source_shares(source[:, e], X[e], ordered_ranks[e], node_of_rank)
    p = Placement(E, W, C, replicas, torch.from_numpy(shares), version=version)
    p.validate()
    return p


def _same_plan(a: Placement, b: Placement) -> bool:
    if a.replicas != b.replicas or a.shares is None or b.shares is None:
        return False
    R = max(a.shares.shape[2], b.shares.shape[2])
    pa = torch.nn.functional.pad(a.shares, (0, R - a.shares.shape[2]))
    pb = torch.nn.functional.pad(b.shares, (0, R - b.shares.shape[2]))
    return bool(torch.allclose(pa, pb, rtol=0.0, atol=1e-9))


# ============================================================================ planner
def plan_placement(
    loads: ArrayLike,
    world_size: int,
    node_of_rank: Sequence[int],
    clone_slots: int,
    previous: Placement | None = None,
    max_cross_node_clones: int = -1,
    source_loads: ArrayLike | None = None,
    tolerance: float = 0.01,
    hysteresis: float = 0.02,
) -> Placement:
    """Plan one layer's placement from its loads. Pure and deterministic.

    Args:
        loads: float [E] tokens per logical expert (e.g. :attr:`LoadTracker.loads` [layer]).
        world_size: W (E must be divisible by W).
        node_of_rank: length-W node index of every rank (e.g. ``[r.node_rank for r in group.ranks]``).
        clone_slots: C clone slots per rank.
        previous: the placement in use; its clones are kept where they still help, and it is
            returned unchanged (same object, same version) when the new plan equals it.
        max_cross_node_clones: at most this many clones on a node other than their owner's
            (-1 = no limit). Clones kept from ``previous`` count too; the limit is never exceeded.
        source_loads: optional float [W_src, E] tokens per source rank and expert; makes the
            planner put clones in the node that sends an expert most tokens and shares prefer
            the replica on the source's own rank / node. ``loads`` is then its column sum.
        tolerance: stop cloning once max/mean tokens per rank ≤ 1 + tolerance.
        hysteresis: keep the previous clones unless planning from scratch predicts an imbalance
            lower by more than this.
    Returns:
        A validated Placement; version = previous.version + 1 if it changed (0 without previous).
    """
    L = _as_f64(loads)
    W = world_size
    if L.ndim != 1:
        raise ValueError(f"loads must be [E], got shape {L.shape}")
    E = L.shape[0]
    if E % W:
        raise ValueError(f"num_experts={E} is not divisible by world_size={W}")
    if len(node_of_rank) != W:
        raise ValueError(f"node_of_rank has {len(node_of_rank)} entries; expected world_size={W}")
    if clone_slots < 0:
        raise ValueError(f"clone_slots={clone_slots} must be >= 0")
    if (L < 0).any() or not np.isfinite(L).all():
        raise ValueError("loads must be finite and >= 0")
    src = None
    if source_loads is not None:
        src = _as_f64(source_loads)
        if src.shape != (W, E):
            raise ValueError(f"source_loads has shape {src.shape}; expected [{W}, {E}]")
        if not np.allclose(src.sum(0), L, rtol=1e-6, atol=1e-6):
            raise ValueError("loads must equal source_loads summed over source ranks")
        L = src.sum(0)
    nodes = [int(x) for x in node_of_rank]
    n = E // W
    empty = _Layout(E, W, n, clone_slots, [[e // n] for e in range(E)], {})

    usable_prev = (previous is not None and previous.num_experts == E and previous.world_size == W
                   and previous.clone_slots == clone_slots)
    prev_pairs: set[tuple[int, int]] = set()
    kept = empty.copy()
    if usable_prev:
        assert previous is not None
        for e, rep in previous.clones():
            prev_pairs.add((e, rep.rank))
            kept.kept_slot[(e, rep.rank)] = rep.slot
        for e, rep in sorted(previous.clones(), key=lambda c: (c[0], c[1].rank)):
            cross = nodes[rep.rank] != nodes[e // n]
            if cross and 0 <= max_cross_node_clones <= _cross_node_count(kept, nodes):
                continue
            kept.ranks[e].append(rep.rank)

    version = previous.version + 1 if previous is not None else 0
    fresh = empty.copy()
    fresh.kept_slot = dict(kept.kept_slot)
    _add_clones(fresh, L, nodes, src, max_cross_node_clones, tolerance, prev_pairs)
    fresh_imb = _balance_replicas(L, fresh.ranks, W)[0].max()
    layout = fresh
    if usable_prev:
        mean = max(L.sum() / W, 1e-300)
        # Keep all previous clones; if that is clearly worse than from scratch, drop the least used
        # 1, 2, 4, ... of them and refill, so a drifting load moves few clones.
        _, X = _balance_replicas(L, kept.ranks, W)
        by_use = sorted(((X[e][i], e, q) for e, r in enumerate(kept.ranks) for i, q in enumerate(r) if i),
                        key=lambda t: (t[0], t[1], t[2]))
        k = 0
        while True:
            trial = kept.copy()
            for _, e, q in by_use[:k]:
                trial.ranks[e].remove(q)
            _add_clones(trial, L, nodes, src, max_cross_node_clones, tolerance, prev_pairs)
            if _balance_replicas(L, trial.ranks, W)[0].max() / mean <= fresh_imb / mean + hysteresis:
                layout = trial
                break
            if k >= len(by_use):
                break
            k = min(len(by_use), max(1, 2 * k))
    plan = _build_placement(layout, L, src, nodes, version)
    if previous is not None and _same_plan(plan, previous):
        return previous
    return plan


def plan_layers(
    loads: ArrayLike,
    world_size: int,
    node_of_rank: Sequence[int],
    clone_slots: int,
    previous: Sequence[Placement] | None = None,
    max_cross_node_clones: int = -1,
    source_loads: ArrayLike | None = None,
    **kwargs: Any,
) -> list[Placement]:
    """:func:`plan_placement` per layer. loads: [layers, E]; source_loads: [layers, W_src, E]."""
    L = _as_f64(loads)
    src = None if source_loads is None else _as_f64(source_loads)
    return [
        plan_placement(L[i], world_size, node_of_rank, clone_slots,
                       previous[i] if previous is not None else None, max_cross_node_clones,
                       None if src is None else src[i], **kwargs)
        for i in range(L.shape[0])
    ]


def plan_report(loads: ArrayLike, previous: Placement | None, placement: Placement,
                bytes_per_expert: int = 0, node_of_rank: Sequence[int] | None = None) -> dict:
    """What a new placement changes, for metrics and logs.

    loads: [E] or [W_src, E] (as :func:`predicted_imbalance`). Returns imbalance without clones,
    before (under ``previous``, or native) and after, clones kept/added/dropped, bytes that the
    added clones copy (``bytes_per_expert`` each) and, given ``node_of_rank``, how many of them
    cross nodes.
    """
    native = Placement.native(placement.num_experts, placement.world_size, placement.clone_slots)
    before = previous if previous is not None else native
    old = {(e, rep.rank, rep.slot) for e, rep in before.clones()}
    new = {(e, rep.rank, rep.slot) for e, rep in placement.clones()}
    added, dropped = sorted(new - old), sorted(old - new)
    report = {
        "imbalance_native": predicted_imbalance(loads, native),
        "imbalance_before": predicted_imbalance(loads, before),
        "imbalance_after": predicted_imbalance(loads, placement),
        "clones": len(new),
        "clones_kept": len(new & old),
        "clones_added": len(added),
        "clones_dropped": len(dropped),
        "bytes_to_move": len(added) * int(bytes_per_expert),
        "changed": placement is not previous,
        "version": placement.version,
    }
    if node_of_rank is not None:
        n = placement.experts_per_rank
        report["cross_node_clones"] = sum(node_of_rank[r] != node_of_rank[e // n] for e, r, _ in new)
        report["cross_node_bytes_to_move"] = int(bytes_per_expert) * sum(
            node_of_rank[r] != node_of_rank[e // n] for e, r, _ in added)
    return report


def nodes_of_ranks(num_ranks: int, num_nodes: int) -> list[int]:
    """Contiguous node index per rank: ``num_ranks`` ranks split evenly over ``num_nodes`` nodes."""
    if num_nodes <= 0 or num_ranks % num_nodes:
        raise ValueError(f"{num_ranks} ranks cannot be split evenly over {num_nodes} nodes")
    per = num_ranks // num_nodes
    return [q // per for q in range(num_ranks)]


__all__ = [
    "plan_placement", "plan_layers", "plan_report", "predicted_imbalance",
    "rank_tokens", "replica_tokens", "nodes_of_ranks",
]
