"""A small decoder-only MoE language model over bytes.

Embeddings, attention and norms are replicated on every rank (data parallel: gradients are
all-reduced); every FFN is an expert-parallel :class:`ray_moe.moe.MoELayer` (optionally a dense
first layer). Tokens flow DP → EP → DP: each rank attends over its own sequences, then the
MoE layers move token rows to the experts and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ray_moe.comm.base import Transport
from ray_moe.config import Config
from ray_moe.expert_choice import ExpertImplChooser
from ray_moe.moe import DTYPES, MoELayer
from ray_moe.placement import Placement


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, H] → [B, L, H], causal."""
        B, L, H = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_heads, H // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, L, H))


class DenseMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up), x.new_zeros((), dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn: nn.Module):
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.norm2 = nn.RMSNorm(d_model)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.norm1(x))
        B, L, H = x.shape
        y, aux = self.ffn(self.norm2(x).reshape(B * L, H))
        return x + y.view(B, L, H), aux


class MoETransformer(nn.Module):
    """Byte-level decoder; ``forward(idx [B, L] int64) -> (logits [B, L, V] float32, aux loss)``."""

    def __init__(self, config: Config, transport: Transport, placement: Placement, device="cpu"):
        super().__init__()
        m, e = config.model, config.moe
        dtype = DTYPES[m.dtype]
        torch.manual_seed(config.train.seed)  # replicated parameters are identical on every rank
        self.tok_emb = nn.Embedding(m.vocab_size, m.d_model)
        self.pos_emb = nn.Parameter(torch.randn(m.seq_len, m.d_model) * 0.02)
        blocks = []
        chooser = ExpertImplChooser()  # one per model: layers of one shape share the measurement
        for i in range(m.n_layers):
            if i == 0 and m.dense_first_layer:
                ffn: nn.Module = DenseMLP(m.d_model, m.dense_hidden or 4 * m.d_model)
            else:
                ffn = MoELayer(
                    m.d_model, e.num_experts, e.top_k, e.expert_hidden, transport, placement,
                    layer_idx=i, seed=config.train.seed, dtype=dtype, expert_impl=e.expert_impl,
                    aux_loss_coef=e.aux_loss_coef, device=device, expert_chooser=chooser,
                )
            blocks.append(Block(m.d_model, m.n_heads, ffn))
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = nn.RMSNorm(m.d_model)
        self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if not _is_expert(name):
                p.data = p.data.to(device=device, dtype=dtype)

    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoELayer)]

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, L = idx.shape
        if L > self.pos_emb.shape[0]:
            raise ValueError(f"sequence length {L} exceeds model.seq_len={self.pos_emb.shape[0]}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token ids must be int64 or int32, got {idx.dtype}")
        if idx.device.type == "cpu" and idx.numel():  # on GPUs the engine checks ids before the copy
            lo, hi = int(idx.min()), int(idx.max())
            V = self.tok_emb.num_embeddings
            if lo < 0 or hi >= V:
                raise ValueError(f"token ids must be in [0, {V}) (model.vocab_size), got min {lo}, max {hi}")
        x = self.tok_emb(idx) + self.pos_emb[:L]
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return self.lm_head(self.norm_f(x)).float(), aux


def _is_expert(name: str) -> bool:
    return name.endswith("ffn.w13") or name.endswith("ffn.w2") or name.endswith("ffn.router")


def is_sharded(name: str) -> bool:
    """Expert weights are sharded (expert parallel); everything else is replicated."""
    return name.endswith("ffn.w13") or name.endswith("ffn.w2")
