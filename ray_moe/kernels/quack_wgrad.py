"""Optional backend for the two weight-gradient GEMMs: quack's varlen-K CUTLASS GEMM.

quack (``quack-kernels``, the GEMM library under SonicMoE; Hopper and Blackwell, CUTLASS DSL)
has a grouped GEMM whose groups run along the contraction (``cu_seqlens_k``) and which gathers
the rows of A by an index (``A_idx``): exactly dW_s = Σ_{p in group s} A[row(p)]ᵀ B[p]. It is
autotuned per shape by quack itself (two consumer warpgroups per tile, TMA for B, 2×1 clusters),
and groups with no rows store exact zeros (its sm_90 kernel zero-fills the accumulator when a
group has no k tiles). On an H100 at T=32768, H=4096, I=1536, K=8, E=128, timed alone under the
same sustained load: dW13 11.0 ms and dW2 5.8 ms against 14.9 and 7.6 ms for the Triton
kernels, same error against float32 (measured 2026-11-24). Where quack is installed the
expert chooser (``moe.expert_impl: auto``) measures it beside the Triton weight gradients and keeps
whichever is faster for the shape; without quack nothing changes.

Mapping (the gathered side must be A, the position-indexed side B):
    dW13 [S, H, 2I] = Σ x[row(p)]ᵀ dh13[p]      → gemm(xᵀ, dh13, out=dW13, cu_seqlens_k=offsets, A_idx=rows)
    dW2  [S, I, H]  = Σ aw[p]ᵀ grad_out[row(p)] → its transpose, written through the view
                      dW2.transpose(1, 2) [S, H, I]: gemm(grad_outᵀ, aw, out=…, A_idx=rows)
``rows`` = sorted_pair // K (int32, per position); positions past offsets[S] are never read.
"""

from __future__ import annotations

import importlib.util

import torch

from ray_moe.kernels.routing import PairLayout


def quack_available() -> bool:
    """Whether quack can be imported here (a cheap check: the module is found, not imported)."""
    return importlib.util.find_spec("quack") is not None


def grouped_wgrad_quack(
    a_src: torch.Tensor, b_src: torch.Tensor, layout: PairLayout, top_k: int, gather_a: bool, gather_b: bool,
) -> torch.Tensor:
    """:func:`ray_moe.kernels.grouped_swiglu.grouped_wgrad` through quack's varlen-K GEMM.

    Args:
        a_src: [R, M] rows (``gather_a``) or [R*K, M] positions, bf16/fp16, row-contiguous.
        b_src: [R, N] rows (``gather_b``) or [R*K, N] positions, same dtype.
        layout: PairLayout of the [R, K] slots (offsets int32 [S+1] = quack's ``cu_seqlens_k``).
        top_k: K. Exactly one of ``gather_a`` / ``gather_b`` (quack gathers one operand).
    Returns:
        [S, M, N] in a_src's dtype: out[s] = Σ_{p in group s} A[p]ᵀ B[p] (float32 accumulation);
        slots with no pairs are exactly 0. Sync-free; graph-capturable once quack has tuned the
        shape (its autotuner times configs on the first call of each shape, outside any capture).
    """
    if gather_a == gather_b:
        raise ValueError("the quack weight-gradient backend needs exactly one gathered operand")
    for name, t in (("a_src", a_src), ("b_src", b_src)):
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} must be a row-contiguous matrix, got shape {tuple(t.shape)} strides {t.stride()}")
        if (t.shape[1] * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name} rows must be 16-byte multiples and aligned (quack uses TMA)")
    if a_src.dtype != b_src.dtype or a_src.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"quack weight gradients need bf16/fp16 operands of one dtype, got {a_src.dtype}, {b_src.dtype}")
    if layout.offsets.dtype != torch.int32 or not layout.offsets.is_contiguous():
        raise TypeError("layout.offsets must be contiguous int32")
    from quack.gemm_interface import gemm

    S = layout.offsets.numel() - 1
    rows = torch.div(layout.sorted_pair, top_k, rounding_mode="floor").to(torch.int32)
    gathered, positional = (a_src, b_src) if gather_a else (b_src, a_src)
    out = torch.empty(S, a_src.shape[1], b_src.shape[1], dtype=a_src.dtype, device=a_src.device)
    target = out if gather_a else out.transpose(1, 2)  # [S, gathered cols, positional cols]
    gemm(gathered.t(), positional, out=target, cu_seqlens_k=layout.offsets, A_idx=rows)
    return out
