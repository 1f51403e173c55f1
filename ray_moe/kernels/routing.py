"""Routing kernels: fused top-k softmax, and the (row, k) pair layout grouped by slot.

Two jobs, each a Triton kernel family with a launcher that checks its inputs and a pure-torch
reference beside it:

``topk_softmax(logits, top_k)``
    Softmax over E experts, top-k, weights renormalised over the k chosen. The renormalised
    weights are the softmax of the chosen logits alone, so the backward is that softmax's
    backward, scattered into the chosen columns (all other logits get exactly 0).

``pair_layout(slot, n_slots)``
    A stable counting sort of the R*K (row, k) pairs by their slot, with no host sync:
    per-block histograms → one scan program → per-block scatter. Pairs whose slot is -1
    (or out of range) go into an extra bucket placed after the last group, so positions
    ``[offsets[S], R*K)`` hold them and no kernel ever touches them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# pair layout (counting sort by slot)
# ---------------------------------------------------------------------------------------------


class PairLayout(NamedTuple):
    """Where each (row, k) pair sits once pairs are grouped by slot.

    offsets: int32 [S + 1]; group s occupies positions ``[offsets[s], offsets[s+1])``;
        ``offsets[S]`` is the number of valid pairs (positions past it hold slot -1 pairs).
    sorted_pair: int32 [R*K]; position → pair index ``r*K + k`` (stable within a group).
    pair_pos: int32 [R*K]; pair index → position (the inverse permutation).
    """

    offsets: torch.Tensor
    sorted_pair: torch.Tensor
    pair_pos: torch.Tensor


@triton.jit
def _pair_key(slot_ptr, idx, n_pairs, n_slots):
    """Bucket of each pair: its slot, or n_slots for slot -1 / out of range; -1 past n_pairs."""
    inside = idx < n_pairs
    s = tl.load(slot_ptr + idx, mask=inside, other=-1).to(tl.int32)
    key = tl.where((s >= 0) & (s < n_slots), s, n_slots)
    return tl.where(inside, key, -1)


@triton.jit
def _pair_histogram_kernel(
    slot_ptr, hist_ptr, n_pairs, n_slots,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, BUCKETS: tl.constexpr,
):
    """hist[block, b] = number of pairs of this block in bucket b. One program per block."""
    block = tl.program_id(0)
    buckets = tl.arange(0, BUCKETS)
    count = tl.zeros([BUCKETS], dtype=tl.int32)
    for c in range(0, BLOCK, CHUNK):
        idx = block * BLOCK + c + tl.arange(0, CHUNK)
        key = _pair_key(slot_ptr, idx, n_pairs, n_slots)
        count += tl.sum((key[:, None] == buckets[None, :]).to(tl.int32), axis=0)
    tl.store(hist_ptr + block * BUCKETS + buckets, count)


@triton.jit
def _pair_scan_kernel(
    hist_ptr, base_ptr, offsets_ptr, n_blocks, n_slots,
    BUCKETS: tl.constexpr, ROWS: tl.constexpr,
):
    """One program: group offsets (exclusive scan over buckets of the total histogram) and
    base[block, b] = offsets[b] + pairs of bucket b in earlier blocks."""
    buckets = tl.arange(0, BUCKETS)
    rows = tl.arange(0, ROWS)
    total = tl.zeros([BUCKETS], dtype=tl.int32)
    for r0 in range(0, n_blocks, ROWS):
        r = r0 + rows
        h = tl.load(hist_ptr + r[:, None] * BUCKETS + buckets[None, :], mask=(r < n_blocks)[:, None], other=0)
        total += tl.sum(h, axis=0)
    start = tl.cumsum(total, axis=0) - total
    tl.store(offsets_ptr + buckets, start, mask=buckets <= n_slots)
    running = start
    for r0 in range(0, n_blocks, ROWS):
        r = r0 + rows
        inside = (r < n_blocks)[:, None]
        h = tl.load(hist_ptr + r[:, None] * BUCKETS + buckets[None, :], mask=inside, other=0)
        before = tl.cumsum(h, axis=0) - h
        tl.store(base_ptr + r[:, None] * BUCKETS + buckets[None, :], running[None, :] + before, mask=inside)
        running += tl.sum(h, axis=0)


@triton.jit
def _pair_scatter_kernel(
    slot_ptr, base_ptr, sorted_pair_ptr, pair_pos_ptr, n_pairs, n_slots,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, BUCKETS: tl.constexpr,
):
    """Position of each pair = base[block, key] + rank among earlier pairs of its key in the block."""
    block = tl.program_id(0)
    buckets = tl.arange(0, BUCKETS)
    running = tl.load(base_ptr + block * BUCKETS + buckets)
    for c in range(0, BLOCK, CHUNK):
        idx = block * BLOCK + c + tl.arange(0, CHUNK)
        key = _pair_key(slot_ptr, idx, n_pairs, n_slots)
        onehot = (key[:, None] == buckets[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same key in this chunk
        pos = tl.sum(onehot * (running[None, :] + rank), axis=1)
        inside = idx < n_pairs
        tl.store(pair_pos_ptr + idx, pos, mask=inside)
        tl.store(sorted_pair_ptr + pos, idx, mask=inside)
        running += tl.sum(onehot, axis=0)


def pair_layout(slot: torch.Tensor, n_slots: int) -> PairLayout:
    """Group the (row, k) pairs of ``slot`` by slot with a stable counting sort (no host sync).

    Args:
        slot: int32 or int64 [R, K], contiguous; values in [0, n_slots) or -1 (not for this rank).
            Values >= n_slots are treated like -1.
        n_slots: S, the number of local expert slots (>= 1).
    Returns:
        PairLayout(offsets int32 [S+1], sorted_pair int32 [R*K], pair_pos int32 [R*K]).
    """
    if slot.dim() != 2:
        raise ValueError(f"slot must be [R, K], got shape {tuple(slot.shape)}")
    if slot.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot must be int32 or int64, got {slot.dtype}")
    if n_slots < 1:
        raise ValueError(f"n_slots must be >= 1, got {n_slots}")
    slot = slot.contiguous()
    n_pairs = slot.numel()
    if n_pairs >= 2**31:
        raise ValueError(f"{n_pairs} pairs do not fit int32 positions")
    dev = slot.device
    buckets = triton.next_power_of_2(n_slots + 1)
    chunk = max(16, min(128, 8192 // buckets))
    block = max(chunk, min(4096, triton.next_power_of_2(triton.cdiv(max(n_pairs, 1), 128))))
    n_blocks = max(1, triton.cdiv(n_pairs, block))
    hist = torch.empty(n_blocks, buckets, dtype=torch.int32, device=dev)
    base = torch.empty_like(hist)
    offsets_all = torch.empty(buckets, dtype=torch.int32, device=dev)
    sorted_pair = torch.empty(n_pairs, dtype=torch.int32, device=dev)
    pair_pos = torch.empty(n_pairs, dtype=torch.int32, device=dev)
    _pair_histogram_kernel[(n_blocks,)](slot, hist, n_pairs, n_slots, BLOCK=block, CHUNK=chunk, BUCKETS=buckets)
    _pair_scan_kernel[(1,)](hist, base, offsets_all, n_blocks, n_slots, BUCKETS=buckets, ROWS=max(1, min(64, 4096 // buckets)))
    _pair_scatter_kernel[(n_blocks,)](
        slot, base, sorted_pair, pair_pos, n_pairs, n_slots, BLOCK=block, CHUNK=chunk, BUCKETS=buckets,
    )
    return PairLayout(offsets_all[: n_slots + 1], sorted_pair, pair_pos)


def pair_layout_reference(slot: torch.Tensor, n_slots: int) -> PairLayout:
    """Pure-torch reference of :func:`pair_layout` (stable argsort). Same arguments and result."""
    key = slot.reshape(-1).long()
    key = torch.where((key >= 0) & (key < n_slots), key, n_slots)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=n_slots + 1)[: n_slots + 1]
    offsets = torch.zeros(n_slots + 1, dtype=torch.int64, device=slot.device)
    offsets[1:] = counts[:n_slots].cumsum(0)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=slot.device)
    return PairLayout(offsets.int(), order.int(), pos.int())


# ---------------------------------------------------------------------------------------------
# top-k softmax
# ---------------------------------------------------------------------------------------------


@triton.jit
def _topk_softmax_fwd_kernel(
    logits_ptr, weights_ptr, ids_ptr, n_tokens, n_experts, stride_t,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """weights[t] = softmax of the top-k logits of token t (= renormalised top-k of the softmax)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < n_tokens
    logit = tl.load(
        logits_ptr + t[:, None].to(tl.int64) * stride_t + e[None, :],
        mask=t_ok[:, None] & (e < n_experts)[None, :], other=float("-inf"),
    ).to(tl.float32)
    logit = tl.where(t_ok[:, None], logit, 0.0)  # rows past T: finite, never stored
    kk = tl.arange(0, TOP_K)
    top_val = tl.zeros([BLOCK_T, TOP_K], dtype=tl.float32)
    top_idx = tl.zeros([BLOCK_T, TOP_K], dtype=tl.int32)
    remaining = logit
    for k in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=1)  # first index among ties
        best_val = tl.max(remaining, axis=1)
        top_val = tl.where(kk[None, :] == k, best_val[:, None], top_val)
        top_idx = tl.where(kk[None, :] == k, best[:, None], top_idx)
        remaining = tl.where(e[None, :] == best[:, None], float("-inf"), remaining)
    # top_val[:, 0] is the row maximum: a stable softmax over the chosen logits.
    first = tl.max(top_val, axis=1)
    num = tl.exp(top_val - first[:, None])
    weight = num / tl.sum(num, axis=1)[:, None]
    out = t[:, None].to(tl.int64) * TOP_K + kk[None, :]
    tl.store(weights_ptr + out, weight, mask=t_ok[:, None])
    tl.store(ids_ptr + out, top_idx.to(tl.int64), mask=t_ok[:, None])


@triton.jit
def _topk_softmax_bwd_kernel(
    grad_w_ptr, weights_ptr, ids_ptr, grad_logits_ptr, n_tokens, n_experts,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """grad_logits[t, e] = w_k (g_k - sum_j w_j g_j) where e = ids[t, k]; 0 for unchosen e."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    kk = tl.arange(0, TOP_K)
    src = t[:, None].to(tl.int64) * TOP_K + kk[None, :]
    g = tl.load(grad_w_ptr + src, mask=t_ok[:, None], other=0.0).to(tl.float32)
    w = tl.load(weights_ptr + src, mask=t_ok[:, None], other=0.0)
    ids = tl.load(ids_ptr + src, mask=t_ok[:, None], other=0)
    dot = tl.sum(w * g, axis=1)
    d = w * (g - dot[:, None])
    e = tl.arange(0, BLOCK_E)
    row = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        dk = tl.sum(tl.where(kk[None, :] == k, d, 0.0), axis=1)
        ik = tl.sum(tl.where(kk[None, :] == k, ids, 0), axis=1)
        row = tl.where(e[None, :] == ik[:, None], dk[:, None], row)
    tl.store(
        grad_logits_ptr + t[:, None].to(tl.int64) * n_experts + e[None, :], row,
        mask=t_ok[:, None] & (e < n_experts)[None, :],
    )


def _topk_blocks(n_experts: int, top_k: int) -> tuple[int, int]:
    block_e = triton.next_power_of_2(n_experts)
    return max(1, min(64, 4096 // block_e)), block_e


class _TopkSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, top_k: int):
        T, E = logits.shape
        weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
        block_t, block_e = _topk_blocks(E, top_k)
        if T > 0:
            _topk_softmax_fwd_kernel[(triton.cdiv(T, block_t),)](
                logits, weights, ids, T, E, logits.stride(0), TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=block_e
            )
        ctx.save_for_backward(weights, ids)
        ctx.mark_non_differentiable(ids)
        ctx.logits_dtype = logits.dtype
        ctx.n_experts = E
        return weights, ids

    @staticmethod
    def backward(ctx, grad_weights: torch.Tensor, _grad_ids):
        weights, ids = ctx.saved_tensors
        T, K = weights.shape
        grad_weights = grad_weights.contiguous()
        grad_logits = torch.empty(T, ctx.n_experts, dtype=torch.float32, device=weights.device)
        block_t, block_e = _topk_blocks(ctx.n_experts, K)
        if T > 0:
            _topk_softmax_bwd_kernel[(triton.cdiv(T, block_t),)](
                grad_weights, weights, ids, grad_logits, T, ctx.n_experts, TOP_K=K, BLOCK_T=block_t, BLOCK_E=block_e
            )
        return grad_logits.to(ctx.logits_dtype), None


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused softmax → top-k → renormalise, differentiable w.r.t. logits.

    Args:
        logits: float [T, E] (float32 recommended; any float dtype is upcast inside), row-contiguous.
        top_k: K, 1 <= K <= E; a power of two is not required but K must be <= 64.
    Returns:
        weights: float32 [T, K], each row sums to 1, in descending order.
        ids: int64 [T, K] the chosen experts (ties go to the lower index).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    E = logits.shape[1]
    if not 1 <= top_k <= min(E, 64):
        raise ValueError(f"top_k must be in [1, min(E, 64)] = [1, {min(E, 64)}], got {top_k}")
    if E > 4096:
        raise ValueError(f"topk_softmax supports at most 4096 experts, got {E}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if triton.next_power_of_2(top_k) != top_k:
        # tl.arange needs a power of two: compute the next power and keep the first top_k,
        # renormalising over those (the extra picks never change the first top_k picks).
        padded = triton.next_power_of_2(top_k)
        if padded > E:
            return topk_softmax_reference(logits, top_k)
        w, i = _TopkSoftmax.apply(logits, padded)
        lw = torch.log(w[:, :top_k])
        return torch.softmax(lw, dim=-1), i[:, :top_k].contiguous()
    return _TopkSoftmax.apply(logits, top_k)


def topk_softmax_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference: exactly what :func:`ray_moe.experts.route` does after the logits."""
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_i = torch.topk(probs, top_k, dim=-1)
    return top_p / top_p.sum(-1, keepdim=True), top_i
