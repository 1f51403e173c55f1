"""Rotary position embeddings (RoPE), full or partial (the first ``rotary_dim`` of each head's
dimensions rotate, the rest pass through), in the "rotate half" layout of the Hugging Face
families (Llama, Qwen3-MoE, Mixtral, GLM-4.5)."""

from __future__ import annotations

import torch


def rope_tables(length: int, rotary_dim: int, theta: float, device: torch.device | str,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [length, rotary_dim] in ``dtype``, for positions 0 .. length-1.

    Frequencies as transformers computes them: float32 ``theta ** (-2i / rotary_dim)``,
    angles ``position * frequency`` in float32, each repeated over both halves.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    positions = torch.arange(length, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, L, D]; cos/sin: [L, R] with R <= D even → x with its first R dims rotated."""
    R = cos.shape[-1]
    rot, rest = (x, None) if R == x.shape[-1] else (x[..., :R], x[..., R:])
    half = R // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos + rotated * sin
    return out if rest is None else torch.cat([out, rest], dim=-1)
