"""A small decoder-only MoE language model over bytes.

Embeddings, attention and norms are replicated on every rank (data parallel: gradients are
all-reduced); every FFN is an expert-parallel :class:`ray_moe.model.moe.MoELayer` (optionally a
dense first layer). Tokens flow DP → EP → DP: each rank attends over its own sequences, then the
MoE layers move token rows to the experts and back.

Initial weights come from the model's own generator seeded by ``train.seed`` (replicated
parameters are identical on every rank; experts from per-expert generators, independent of the
world size); the global RNG is neither seeded nor advanced.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from ray_moe.comm.base import Transport
from ray_moe.config import Config, torch_dtype
from ray_moe.model.expert_choice import ExpertImplChooser
from ray_moe.model.kv_cache import KVCache, causal_mask
from ray_moe.model.moe import MoELayer
from ray_moe.model.recompute import check_mode, checkpointed


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = skip_init(nn.Linear, d_model, 3 * d_model, bias=False, device=device)
        self.proj = skip_init(nn.Linear, d_model, d_model, bias=False, device=device)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x: [B, L, H] → [B, L, H], causal; with ``cache``, x holds the positions after the cached
        ones (all of them at once into an empty cache, then one at a time)."""
        B, L, H = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_heads, H // self.n_heads).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal_mask(L, k.shape[2]))
        return self.proj(y.transpose(1, 2).reshape(B, L, H))


class DenseMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.w13 = skip_init(nn.Linear, d_model, 2 * hidden, bias=False, device=device)
        self.w2 = skip_init(nn.Linear, hidden, d_model, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] → ([T, H], zero auxiliary loss)."""
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up), x.new_zeros((), dtype=torch.float32)


class Block(nn.Module):
    """Pre-norm block; ``checkpointing``: none | moe (recompute the MoE FFN in backward) | full
    (recompute the whole block)."""

    def __init__(self, d_model: int, n_heads: int, ffn: nn.Module, device: torch.device | str = "cpu",
                 checkpointing: str = "none"):
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, device=device)
        self.attn = Attention(d_model, n_heads, device)
        self.norm2 = nn.RMSNorm(d_model, device=device)
        self.ffn = ffn
        self.checkpointing = check_mode(checkpointing)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, L, H] → ([B, L, H], auxiliary loss float32 scalar); ``cache``: this block's
        attention reads and extends it as block ``layer`` (incremental decoding, no gradients)."""
        moe = (self.ffn,) if isinstance(self.ffn, MoELayer) else ()
        if self.checkpointing == "full" and torch.is_grad_enabled() and cache is None:
            return checkpointed(self._forward, x, moe_layers=moe)
        return self._forward(x, cache, layer)

    def _forward(self, x: torch.Tensor, cache: KVCache | None = None,
                 layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.norm1(x), cache, layer)
        moe = (self.ffn,) if isinstance(self.ffn, MoELayer) else ()
        if self.checkpointing == "moe" and moe and torch.is_grad_enabled():
            y, aux = checkpointed(self._ffn, x, moe_layers=moe)
        else:
            y, aux = self._ffn(x)
        return x + y, aux

    def _ffn(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, L, H = x.shape
        y, aux = self.ffn(self.norm2(x).reshape(B * L, H))
        return y.view(B, L, H), aux


class MoETransformer(nn.Module):
    """Byte-level decoder; ``forward(idx [B, L] int64) -> (logits [B, L, V] float32, aux loss)``.

    Expert-parallel over ``transport`` (its world size is the group's); ``moe.clone_slots`` per
    rank and layer are reserved for clones of hot experts.
    """

    def __init__(self, config: Config, transport: Transport, device: torch.device | str = "cpu"):
        super().__init__()
        m, e = config.model, config.moe
        dtype = torch_dtype(m.dtype)
        self.seed = config.train.seed
        self.tok_emb = skip_init(nn.Embedding, m.vocab_size, m.d_model, device=device)
        self.pos_emb = nn.Parameter(torch.empty(m.seq_len, m.d_model, device=device))
        blocks = []
        chooser = ExpertImplChooser()  # one per model: layers of one shape share the measurement
        for i in range(m.n_layers):
            if i == 0 and m.dense_first_layer:
                ffn: nn.Module = DenseMLP(m.d_model, m.dense_hidden or 4 * m.d_model, device)
            else:
                ffn = MoELayer(
                    m.d_model, e.num_experts, e.top_k, e.expert_hidden, transport,
                    layer_idx=i, seed=config.train.seed, dtype=dtype, expert_impl=e.expert_impl,
                    aux_loss_coef=e.aux_loss_coef, device=device, expert_chooser=chooser,
                    clone_slots=config.balance.clone_slots, pipeline_chunks=e.pipeline_chunks,
                )
            blocks.append(Block(m.d_model, m.n_heads, ffn, device, m.activation_checkpointing))
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = nn.RMSNorm(m.d_model, device=device)
        self.lm_head = skip_init(nn.Linear, m.d_model, m.vocab_size, bias=False, device=device)
        self.init_weights(torch.Generator().manual_seed(config.train.seed))
        for name, p in self.named_parameters():  # experts are built in dtype; routers stay float32
            if getattr(p, "expert_shard", None) is None and not name.endswith("ffn.router"):
                p.data = p.data.to(dtype=dtype)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Initial replicated weights from ``generator`` (a CPU generator: the same values on every
        rank and device) in module order; MoE layers reset from their own per-expert generators.

        Embeddings N(0, 1), positions N(0, 0.02²), linear layers U(±1/√fan_in) (PyTorch's
        defaults), norms 1.
        """
        for module in self.modules():
            if isinstance(module, MoELayer):
                module.reset_parameters()
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
            elif isinstance(module, nn.Linear):
                bound = 1.0 / math.sqrt(module.in_features)
                module.weight.copy_(torch.empty(module.weight.shape).uniform_(-bound, bound, generator=generator))
            elif isinstance(module, nn.RMSNorm):
                module.weight.fill_(1.0)
        self.pos_emb.copy_(torch.randn(self.pos_emb.shape, generator=generator) * 0.02)

    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoELayer)]

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """idx: int64/int32 [B, L] token ids → (final-norm hidden states [B, L, H] in the model
        dtype, aux loss float32 scalar). The LM head (``self.lm_head``) is applied by the caller
        (``forward`` for logits, :func:`ray_moe.model.loss.lm_loss` for the training loss).
        ``cache`` (:meth:`new_cache`): ``idx`` continues the cached positions, and is added to them."""
        B, L = idx.shape
        start = cache.length if cache is not None else 0
        if start + L > self.pos_emb.shape[0]:
            raise ValueError(f"sequence length {start + L} exceeds model.seq_len={self.pos_emb.shape[0]}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token ids must be int64 or int32, got {idx.dtype}")
        if idx.device.type == "cpu" and idx.numel():  # on GPUs the engine checks ids before the copy
            lo, hi = int(idx.min()), int(idx.max())
            V = self.tok_emb.num_embeddings
            if lo < 0 or hi >= V:
                raise ValueError(f"token ids must be in [0, {V}) (model.vocab_size), got min {lo}, max {hi}")
        x = self.tok_emb(idx) + self.pos_emb[start:start + L]
        aux = x.new_zeros((), dtype=torch.float32)
        for i, block in enumerate(self.blocks):
            x, a = block(x, cache, i)
            aux = aux + a
        if cache is not None:
            cache.advance(L)
        return self.norm_f(x), aux

    def new_cache(self, capacity: int) -> KVCache:
        """An empty KV cache for :meth:`hidden_states`, ``capacity`` (≤ ``model.seq_len``) positions long."""
        return KVCache(len(self.blocks), capacity)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx: int64/int32 [B, L] token ids → (logits float32 [B, L, V], aux loss float32 scalar)."""
        h, aux = self.hidden_states(idx)
        return self.lm_head(h).float(), aux
