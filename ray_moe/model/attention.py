"""Causal grouped-query attention with RoPE (optionally partial; none with learned positions) and
optional per-head q/k RMSNorm and q/k/v (and o) biases: the attention of Qwen3-MoE, Mixtral,
GLM-4.5 and the byte model (multi-head, learned positions added to the embeddings).
Replicated (data parallel): each rank attends over its own sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from ray_moe.arch import ArchSpec
from ray_moe.model.kv_cache import KVCache, causal_mask
from ray_moe.model.norm import RMSNorm
from ray_moe.model.rope import apply_rope


class Attention(nn.Module):
    """x [B, L, H] → [B, L, H]; ``num_heads`` query heads share ``num_kv_heads`` key/value heads."""

    def __init__(self, spec: ArchSpec, device: torch.device | str = "cpu"):
        super().__init__()
        H, D = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, D
        self.q_proj = skip_init(nn.Linear, H, spec.num_heads * D, bias=spec.qkv_bias, device=device)
        self.k_proj = skip_init(nn.Linear, H, spec.num_kv_heads * D, bias=spec.qkv_bias, device=device)
        self.v_proj = skip_init(nn.Linear, H, spec.num_kv_heads * D, bias=spec.qkv_bias, device=device)
        self.o_proj = skip_init(nn.Linear, spec.num_heads * D, H, bias=spec.o_bias, device=device)
        self.q_norm = RMSNorm(D, spec.rms_norm_eps, device) if spec.qk_norm else None
        self.k_norm = RMSNorm(D, spec.rms_norm_eps, device) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x: [B, L, H]; cos/sin: [L, rotary_dim] of x's positions (:func:`ray_moe.model.rope.rope_tables`;
        None: no rotation, the positions are in x);
        with ``cache``, x holds the positions after the cached ones (read and extended as ``layer``)."""
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, L, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, L, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal_mask(L, k.shape[2]), scale=self.head_dim ** -0.5,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))
