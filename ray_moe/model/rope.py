"""Rotary position embeddings (RoPE), full or partial (the first ``rotary_dim`` of each head's
dimensions rotate, the rest pass through), in the "rotate half" layout of the Hugging Face
families (Llama, Qwen3-MoE, Mixtral, GLM-4.5)."""

from __future__ import annotations

import math

import torch

from ray_moe.arch import Yarn


def inv_frequencies(rotary_dim: int, theta: float, yarn: Yarn | None = None) -> torch.Tensor:
    """float32 [rotary_dim / 2]: ``theta ** (-2i / rotary_dim)``, or with ``yarn`` the blend of
    interpolated (/ factor) and original frequencies over YaRN's linear ramp, as transformers'
    ``_compute_yarn_parameters`` computes it."""
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    if yarn is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_tables(length: int, rotary_dim: int, theta: float, device: torch.device | str,
                dtype: torch.dtype, yarn: Yarn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [length, rotary_dim] in ``dtype``, for positions 0 .. length-1.

    Frequencies as transformers computes them (:func:`inv_frequencies`), angles
    ``position * frequency`` in float32, each repeated over both halves; with ``yarn`` both
    are multiplied by its ``attention_factor`` in float32 before the cast.
    """
    inv_freq = inv_frequencies(rotary_dim, theta, yarn)
    positions = torch.arange(length, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if yarn is not None:
        cos, sin = cos * yarn.attention_factor, sin * yarn.attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, L, D]; cos/sin: [L, R] with R <= D even → x with its first R dims rotated."""
    R = cos.shape[-1]
    rot, rest = (x, None) if R == x.shape[-1] else (x[..., :R], x[..., R:])
    half = R // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos + rotated * sin
    return out if rest is None else torch.cat([out, rest], dim=-1)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """x [..., R] with its rotary pairs interleaved (x0, x1), (x2, x3), ... (DeepSeek's layout) →
    [..., R] as (x0, x2, ...) | (x1, x3, ...), the "rotate half" layout :func:`apply_rope` takes;
    rotating that equals transformers' ``apply_rotary_pos_emb_interleave``, bit for bit."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
