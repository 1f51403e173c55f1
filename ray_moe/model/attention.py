"""Causal attention of the decoder blocks, replicated (data parallel: each rank attends over its
own sequences):

- :class:`Attention`: grouped-query attention with RoPE (optionally partial; none with learned
  positions), optional q/k RMSNorm (per head, or over the whole projection: OLMoE), q/k/v (and o)
  biases, a sliding window and learned sinks: Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss, OLMoE and the
  byte model;
- :class:`LatentAttention`: DeepSeek-V3's multi-head latent attention (MLA).

Both call :func:`attend`. The sink of a head is a logit beside the keys that takes part in the
softmax but has no value (gpt-oss): with ``lse`` the log-sum-exp of a query's scores over its
keys, ``softmax([s, sink])[:-1] @ v = (softmax(s) @ v) · σ(lse − sink)``, so any kernel that
returns the log-sum-exp serves (torchtitan's gpt-oss computes sinks so on flex attention).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from ray_moe.arch import ArchSpec
from ray_moe.model.kv_cache import KVCache, causal_mask
from ray_moe.model.norm import RMSNorm
from ray_moe.model.rope import apply_rope, deinterleave


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last L of S positions.

    q: [B, Hq, L, Dqk]; k: [B, Hkv, S, Dqk]; v: [B, Hkv, S, Dv] (Hkv divides Hq); scale: the
    softmax scale; window > 0: a query at position i sees keys j with i - window < j <= i
    (transformers' sliding window); sinks: [Hq] float logits (see the module docstring).
    Returns [B, Hq, L, Dv] in q's dtype.

    On CUDA, a whole sequence (L == S) with a window or sinks runs on flex attention (compiled;
    its block mask skips the tiles outside the window, and it returns the log-sum-exp the sinks
    need); unequal head dims (MLA) run SDPA with v zero-padded to Dqk (the flash kernel wants
    one head dim). Elsewhere SDPA, with a boolean mask for the window and the log-sum-exp of the
    masked scores computed beside it for the sinks (the CPU path and decoding).
    """
    if q.is_cuda and q.shape[2] == k.shape[2] and (window or sinks is not None):
        return _flex(q, k, v, scale, window, sinks)
    return _sdpa(q, k, v, scale, window, sinks)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attend` on SDPA: a boolean mask for the window, the sinks' log-sum-exp computed beside."""
    L, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    pad = q.is_cuda and v.shape[-1] != q.shape[-1]
    Dv = v.shape[-1]
    if pad:
        v = F.pad(v, (0, q.shape[-1] - Dv))
    mask = window_mask(L, S, window, q.device) if window else None
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and causal_mask(L, S),
                                       scale=scale, enable_gqa=gqa)
    if pad:
        y = y[..., :Dv]
    if sinks is not None:
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1) if gqa else k
        scores = (q.float() @ kk.float().transpose(-1, -2)) * scale
        allowed = mask if mask is not None else window_mask(L, S, 0, q.device)
        lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)
        y = y * _sink_factor(lse, sinks).to(y.dtype)
    return y


def _sink_factor(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """σ(lse − sink): lse float32 [B, Hq, L] → [B, Hq, L, 1]."""
    return torch.sigmoid(lse - sinks.float()[None, :, None]).unsqueeze(-1)


def window_mask(queries: int, keys: int, window: int, device: torch.device | str) -> torch.Tensor:
    """bool [queries, keys]: the last ``queries`` of ``keys`` positions, causal, and within
    ``window`` positions of the query (0: no window)."""
    qpos = torch.arange(keys - queries, keys, device=device)[:, None]
    kpos = torch.arange(keys, device=device)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed = allowed & (kpos > qpos - window)
    return allowed


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _block_mask(length: int, window: int, device: str):
    return _make_block_mask(length, window, device)


def _make_block_mask(length: int, window: int, device: str):
    """flex attention's block mask of a causal sequence of ``length`` with a ``window`` (0: none)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_window(b, h, q_idx, kv_idx):
        ok = kv_idx <= q_idx
        return ok & (kv_idx > q_idx - window) if window else ok

    return create_block_mask(causal_window, None, None, length, length, device=device)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
          sinks: torch.Tensor | None) -> torch.Tensor:
    """:func:`attend` over a whole sequence on flex attention (CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():  # inside a compiled block (model.compile=blocks): traced there
        mask, flex = _make_block_mask(q.shape[2], window, str(q.device)), flex_attention
    else:  # eager blocks: the kernel compiled once, the mask built once per shape
        mask, flex = _block_mask(q.shape[2], window, str(q.device)), _compiled_flex()
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    import torch.nn.attention.flex_attention as fa

    if hasattr(fa, "AuxRequest"):  # torch >= 2.9 asks for the log-sum-exp so, older releases with return_lse
        y, aux = flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, return_aux=fa.AuxRequest(lse=True))
        lse = aux.lse
    else:
        y, lse = flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, return_lse=True)
    return y * _sink_factor(lse, sinks).to(y.dtype)


class Attention(nn.Module):
    """x [B, L, H] → [B, L, H]; ``num_heads`` query heads share ``num_kv_heads`` key/value heads.
    ``layer``: the block index (whether the spec's sliding window applies to it)."""

    def __init__(self, spec: ArchSpec, device: torch.device | str = "cpu", layer: int = 0):
        super().__init__()
        H, D = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, D
        self.q_proj = skip_init(nn.Linear, H, spec.num_heads * D, bias=spec.qkv_bias, device=device)
        self.k_proj = skip_init(nn.Linear, H, spec.num_kv_heads * D, bias=spec.qkv_bias, device=device)
        self.v_proj = skip_init(nn.Linear, H, spec.num_kv_heads * D, bias=spec.qkv_bias, device=device)
        self.o_proj = skip_init(nn.Linear, spec.num_heads * D, H, bias=spec.o_bias, device=device)
        # per head (Qwen3-MoE, GLM) or over the whole projection (OLMoE)
        self.norm_whole = spec.qk_norm_whole
        q_dim, k_dim = (spec.num_heads * D, spec.num_kv_heads * D) if self.norm_whole else (D, D)
        self.q_norm = RMSNorm(q_dim, spec.rms_norm_eps, device) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_dim, spec.rms_norm_eps, device) if spec.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(spec.num_heads, device=device)) if spec.attn_sinks else None
        self.scale = spec.attn_scale or D ** -0.5
        self.window = spec.sliding_window if spec.sliding_layers and spec.sliding_layers[layer] else 0

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x: [B, L, H]; cos/sin: [L, rotary_dim] of x's positions (:func:`ray_moe.model.rope.rope_tables`;
        None: no rotation, the positions are in x);
        with ``cache``, x holds the positions after the cached ones (read and extended as ``layer``)."""
        B, L, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None and self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, L, self.num_heads, self.head_dim)
        k = k.view(B, L, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, L, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        y = attend(q, k, v, self.scale, self.window, self.sinks)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))


class LatentAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention, x [B, L, H] → [B, L, H] (transformers'
    ``DeepseekV3Attention``): q = q_b(norm(q_a(x))) (or one ``q_proj`` without ``q_lora_rank``)
    as [heads, nope | rope]; one latent [kv_lora_rank] (normed) and one shared rope key
    [rotary_dim] per position from ``kv_a_proj_with_mqa``; ``kv_b_proj`` expands the latent into
    every head's key nope part and value [v_head_dim]. The KV cache keeps the latent and the
    rotated rope key (1 "head" each), not the expanded keys and values. The rope part's dims are
    de-interleaved first with ``rope_interleave`` (DeepSeek's checkpoint layout). The latent norms
    take transformers' default epsilon, 1e-6, whatever ``rms_norm_eps`` says."""

    LATENT_EPS = 1e-6

    def __init__(self, spec: ArchSpec, device: torch.device | str = "cpu", layer: int = 0):
        super().__init__()
        H, heads, D, R = spec.hidden_size, spec.num_heads, spec.head_dim, spec.rotary_dim
        self.num_heads, self.head_dim, self.rope_dim = heads, D, R
        self.v_head_dim, self.kv_lora_rank = spec.v_head_dim or D, spec.kv_lora_rank
        self.interleaved = spec.rope_interleave
        self.scale = spec.attn_scale or D ** -0.5
        qr = spec.q_lora_rank
        self.q_low_rank = bool(qr)
        if qr:
            self.q_a_proj = skip_init(nn.Linear, H, qr, bias=spec.qkv_bias, device=device)
            self.q_a_layernorm = RMSNorm(qr, self.LATENT_EPS, device)
            self.q_b_proj = skip_init(nn.Linear, qr, heads * D, bias=False, device=device)
        else:
            self.q_proj = skip_init(nn.Linear, H, heads * D, bias=False, device=device)
        self.kv_a_proj_with_mqa = skip_init(nn.Linear, H, spec.kv_lora_rank + R, bias=spec.qkv_bias, device=device)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, self.LATENT_EPS, device)
        self.kv_b_proj = skip_init(nn.Linear, spec.kv_lora_rank, heads * (D - R + self.v_head_dim), bias=False,
                                   device=device)
        self.o_proj = skip_init(nn.Linear, heads * self.v_head_dim, H, bias=spec.o_bias, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x: [B, L, H]; cos/sin: [L, rotary_dim] of x's positions; ``cache``: as :class:`Attention`'s
        (it holds the latent [B, 1, S, kv_lora_rank] and the rope key [B, 1, S, rotary_dim])."""
        B, L, _ = x.shape
        heads, D, R, V = self.num_heads, self.head_dim, self.rope_dim, self.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_low_rank else self.q_proj(x)
        q_pass, q_rot = q.view(B, L, heads, D).transpose(1, 2).split([D - R, R], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, R], dim=-1)
        latent = self.kv_a_layernorm(latent).view(B, 1, L, self.kv_lora_rank)
        k_rot = k_rot.view(B, 1, L, R)
        if self.interleaved:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q = torch.cat([q_pass, apply_rope(q_rot, cos, sin)], dim=-1)
        k_rot = apply_rope(k_rot, cos, sin)
        if cache is not None:
            latent, k_rot = cache.update(layer, latent, k_rot)
        S = latent.shape[2]
        kv = self.kv_b_proj(latent).view(B, S, heads, D - R + V).transpose(1, 2)
        k_nope, v = kv.split([D - R, V], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(B, heads, S, R)], dim=-1)
        y = attend(q, k, v, self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, heads * V))


def make_attention(spec: ArchSpec, device: torch.device | str = "cpu", layer: int = 0) -> nn.Module:
    """The attention module of block ``layer`` of ``spec``."""
    cls = LatentAttention if spec.attention == "mla" else Attention
    return cls(spec, device, layer)
