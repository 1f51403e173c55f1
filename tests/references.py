"""Pure-torch references of the package's kernels: the tests' oracles (each equals its kernel on
valid inputs, by another route: torch ops, float32 accumulation, host loops)."""

from __future__ import annotations

import torch

from ray_moe.kernels import fp8_quant
from ray_moe.kernels.gather_sum import gather_sum_reference  # noqa: F401  (re-exported for the tests)
from ray_moe.kernels.linear_ce import IGNORE_INDEX
from ray_moe.kernels.routing import PairLayout


def peer_copy_reference(src: torch.Tensor, destinations: list[torch.Tensor]) -> None:
    """:func:`peer_copy` through torch copies (one destination after another)."""
    for d in destinations:
        d.view(torch.uint8).view(-1)[:src.numel()].copy_(src)


def gather_pair_rows_reference(src: torch.Tensor, layout: PairLayout, top_k: int) -> torch.Tensor:
    """Pure-torch reference of :func:`gather_pair_rows`'s valid rows: [offsets[S], C]."""
    n_valid = int(layout.offsets[-1])
    return src[layout.sorted_pair[:n_valid].long() // top_k]


def group_sum_reference(src: torch.Tensor, layout: PairLayout, top_k: int, gather: bool,
                        scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`ray_moe.kernels.group_sum.group_sum`: float32 [S, N], one loop over the
    groups (rows by position, or the pairs' input rows scaled by ``scale`` [T, K])."""
    offsets = layout.offsets.tolist()
    out = torch.zeros(len(offsets) - 1, src.shape[1], dtype=torch.float32, device=src.device)
    for s in range(len(offsets) - 1):
        pair = layout.sorted_pair[offsets[s]:offsets[s + 1]].long()
        rows = pair // top_k if gather else torch.arange(offsets[s], offsets[s + 1], device=src.device)
        v = src[rows].float()
        if scale is not None:
            v = v * scale.reshape(-1).float()[pair, None]
        out[s] = v.sum(0)
    return out


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The oracle: ``F.cross_entropy`` on the full float32 logits of the float32-upcast inputs.
    Returns (loss, d hidden, d weight), all float32."""
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(h @ w.t(), targets, ignore_index=ignore_index)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), dh, dw


def chunk_bounds(T: int, G: int) -> list[tuple[int, int]]:
    """Token chunk of each program: [(t0, t1)] * G, as the kernels compute it."""
    C = max(1, -(-T // G))
    out = []
    for p in range(G):
        t0 = min(p * C, T)
        out.append((t0, min(t0 + C, T)))
    return out


def layout_reference(dest_rank: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dedup layout of one source rank (pure torch; any device).

    Args:
        dest_rank: int [T, K] destination rank per (token, k).
        world_size: W.
    Returns:
        pos: int32 [T, W]: row of token t in destination d's list (tokens in order), -1 if t does
            not go to d; counts: int64 [W] rows per destination.
    """
    T = dest_rank.shape[0]
    to_rank = torch.zeros(T, world_size, dtype=torch.bool, device=dest_rank.device)
    if T:
        to_rank.scatter_(1, dest_rank.long(), True)
    csum = to_rank.long().cumsum(0) - to_rank.long()
    pos = torch.where(to_rank, csum, -1).to(torch.int32)
    return pos, to_rank.sum(0)


def expert_ffn_fp8_reference(
    x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
) -> torch.Tensor:
    """The forward of :func:`ray_moe.kernels.fp8_expert_ffn.expert_ffn_fp8` written out in torch from the quantisation references
    (per pair, no grouping): the oracle its CPU path and the kernels are checked against."""
    R, K = slot.shape
    q13, _, s13 = fp8_quant.quantize_blocks_reference(w13)
    q2, _, s2 = fp8_quant.quantize_blocks_reference(w2)
    w13f, w2f = fp8_quant.dequantize_blocks(q13, s13), fp8_quant.dequantize_blocks(q2, s2)
    xf = fp8_quant.dequantize_rows(*fp8_quant.quantize_rows_reference(x))
    out = torch.zeros(R, x.shape[1], dtype=torch.float32, device=x.device)
    for r in range(R):
        for k in range(K):
            s = int(slot[r, k])
            if s < 0:
                continue
            gate, up = (xf[r] @ w13f[s]).to(x.dtype).float().chunk(2)
            act = fp8_quant.dequantize_rows(*fp8_quant.quantize_rows_reference((torch.nn.functional.silu(gate) * up)[None]))[0]
            out[r] += ((act @ w2f[s]) * weight[r, k]).to(x.dtype).float()
    return out.to(x.dtype)
