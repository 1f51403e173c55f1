"""Transport over ``torch.distributed.all_to_all_single`` (gloo on CPU, NCCL on GPU).

The textbook exchange, with rank-dedup: every token row is sent once to each rank that holds
at least one of its K experts, with K (slot, weight) pairs packed beside it. Split sizes are
exchanged with one small all-to-all and read on the host (this transport is the portable
baseline; the NVSHMEM transport is the sync-free one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ray_moe.comm.base import Layout, Transport


@dataclass
class TorchA2ALayout(Layout):
    num_tokens: int
    top_k: int
    send_token: torch.Tensor  # int64 [S]: source token of each sent row, grouped by destination
    send_mine: torch.Tensor  # bool [S, K]: which k of the row belong to its destination
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank


class TorchA2ATransport(Transport):
    """Rank-dedup dispatch/combine through all_to_all_single on a torch.distributed group."""

    name = "torch"

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None,
                 peers: tuple[int, ...] | None = None):
        super().__init__(rank, world_size, peers)
        self.group = group
        self.name = f"torch-{dist.get_backend(group)}" if dist.is_initialized() else "torch"

    def _all_to_all(self, send: torch.Tensor, send_splits, recv_splits) -> torch.Tensor:
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=self.group)
        return recv

    def dispatch_forward(self, x, weight, dest_rank, dest_slot, reuse_outputs=False):
        T, K = dest_rank.shape
        W = self.world_size
        to_rank = torch.zeros(T, W, dtype=torch.bool, device=x.device)
        to_rank.scatter_(1, dest_rank.long(), True)
        dest, token = to_rank.t().nonzero(as_tuple=True)  # grouped by destination, then token
        send_counts = to_rank.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

        mine = dest_rank[token].long() == dest.unsqueeze(1)  # [S, K]
        slot = torch.where(mine, dest_slot[token], -1)
        w = torch.where(mine, weight[token], 0.0)
        meta = torch.cat([slot.float(), w.float()], dim=1)  # slot ids are exact in fp32
        recv_x = self._all_to_all(x[token], send_splits, recv_splits)
        self.dispatched_bytes += sum(send_splits) * x.shape[1] * x.element_size()
        recv_meta = self._all_to_all(meta, send_splits, recv_splits)
        layout = TorchA2ALayout(T, K, token, mine, send_splits, recv_splits)
        return recv_x, recv_meta[:, :K].to(torch.int32), recv_meta[:, K:].contiguous(), layout

    def dispatch_backward(self, grad_recv_x, grad_recv_weight, layout):
        L = layout
        gx_rows = self._all_to_all(grad_recv_x, L.recv_splits, L.send_splits)
        gw_rows = self._all_to_all(grad_recv_weight.float(), L.recv_splits, L.send_splits)
        gx = gx_rows.new_zeros((L.num_tokens,) + tuple(gx_rows.shape[1:]))
        gx.index_add_(0, L.send_token, gx_rows)
        gw = gw_rows.new_zeros(L.num_tokens, L.top_k)
        gw.index_add_(0, L.send_token, torch.where(L.send_mine, gw_rows, 0.0))
        return gx, gw

    def combine_forward(self, partial, layout):
        L = layout
        rows = self._all_to_all(partial, L.recv_splits, L.send_splits)
        out = rows.new_zeros((L.num_tokens,) + tuple(rows.shape[1:]))
        return out.index_add_(0, L.send_token, rows)

    def combine_backward(self, grad_out, layout):
        L = layout
        return self._all_to_all(grad_out[L.send_token], L.send_splits, L.recv_splits)
