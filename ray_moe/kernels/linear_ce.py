"""Fused linear + cross-entropy: the LM head's loss and both gradients in one forward pass.

``linear_cross_entropy(hidden [N, H], weight [V, H], targets [N])`` returns the mean
cross-entropy of ``hidden @ weightᵀ`` over the counted rows together with its gradients
``d hidden`` [N, H] (hidden's dtype) and ``d weight`` [V, H] (float32), as Liger-Kernel and
:mod:`ray_moe.model.loss`'s chunked path do: the loss's backward only scales them. The full
logits ``[N, V]`` never exist; rows go through in chunks of ``c`` rows:

1. ``logits = h_c @ Wᵀ`` — cuBLAS, model dtype, float32 accumulation (the GEMMs run at cuBLAS
   speed; a Triton GEMM at this shape only matches it after per-GPU tuning).
2. :func:`ce_rows_` — one Triton program per row streams its logits twice: an online
   max / sum-exp over vocabulary tiles gives the log-sum-exp and the row's loss; the second
   pass writes ``(softmax − one hot) · valid / counted`` over the logits in place (float32
   arithmetic, stored in the logits' dtype). This replaces the chunked path's upcast, logsumexp,
   gather, sub/exp, scatter and scale kernels (one read of bf16 logits for each of them, most of
   them of the float32 copy) by two reads and one write of the bf16 logits.
3. ``dH_c = G @ W`` (cuBLAS, model dtype) and ``dW += Gᵀ @ h_c`` (cuBLAS with a float32 output
   where the GPU has it, so the weight gradient is summed over chunks in float32).

Chunk size (:func:`fused_chunk`): as many rows as make the chunk's logits no larger than the
float32 weight-gradient accumulator ``[V, H]`` the loss holds anyway (``c = 4H / element
size``, a power of two: 4096 rows for H = 2048 in bf16), or than 64 MiB where that is more
(a small vocabulary: one chunk of many rows). Large chunks matter: every chunk reads
and writes the whole float32 ``dW`` once (1.2 GB at V = 151,936, H = 2048), so Liger's and the
chunked path's rule (chunks of ~N / ⌈V / H⌉ rows, 256 rows at 16k tokens there) turns the
weight-gradient GEMMs memory-bound; with ``c = 2H`` that traffic is ``4·N·V`` bytes, about
what the logits themselves cost. Memory: ``c·V`` logits + the float32 ``dW`` + ``dH``.

Rows whose target is ``ignore_index`` count neither in the sum nor in the mean and get a zero
gradient; if every row is ignored the loss is NaN and the gradients 0, as ``F.cross_entropy``'s.
A counted target outside ``[0, V)`` makes the loss NaN (no out-of-bounds read; the step's
non-finite check then skips it) where ``F.cross_entropy`` raises a device-side assert.
No host synchronisation (the count of rows stays on the device).

:func:`benchmark` times it beside the full-logits torch loss (``python -m ray_moe.kernels.linear_ce``);
the float32 full-logits oracle is the tests' (tests/references.py).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from ray_moe.device import add_mm_t

IGNORE_INDEX = -100
SMALL_CHUNK_BYTES = 64 * 2**20  # logits chunks below this are never split further


@triton.jit
def _ce_rows_kernel(
    logits_ptr, stride_row, targets_ptr, loss_ptr, scale_ptr, V, ignore_index,
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr,
):
    """One row: loss_ptr[row] = (lse − x[target]) or 0 when ignored; with WRITE_GRAD the row's
    logits become (softmax − one hot) · valid · scale in place."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    t = tl.load(targets_ptr + row)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    safe_t = tl.where(valid & in_range, t, 0)  # never read outside the row
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    x_t = tl.load(base + safe_t).to(tl.float32)
    # a counted target outside [0, V) makes the loss NaN (F.cross_entropy raises a device assert)
    tl.store(loss_ptr + row, tl.where(valid, tl.where(in_range, lse - x_t, float("nan")), 0.0))
    if WRITE_GRAD:
        # ignored rows get 0 (also when no row counts and scale is inf, as in F.cross_entropy)
        f = tl.where(valid, tl.load(scale_ptr), 0.0)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(offs == safe_t, g - 1.0, g) * f
            tl.store(base + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)


def ce_rows_(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, loss_rows: torch.Tensor,
    *, ignore_index: int = IGNORE_INDEX, write_grad: bool = True, block_v: int = 0,
) -> None:
    """The fused softmax / cross-entropy epilogue over a chunk of logits, in place.

    Args:
        logits: [c, V] (float32 or bfloat16; rows contiguous). With ``write_grad`` it is
            overwritten by the logits' gradient ``(softmax − one hot) · valid · scale``.
        targets: int64 [c] in [0, V) or ``ignore_index``.
        scale: float32 [1] (device): 1 / counted rows of the whole batch.
        loss_rows: float32 [c] receives ``lse − logit[target]`` (0 for ignored rows).
        block_v: vocabulary tile (0: up to 8192, the next power of two of V at most).
    """
    c, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"ce_rows_ needs logits with contiguous rows, got strides {logits.stride()}")
    if targets.shape != (c,) or loss_rows.shape != (c,) or loss_rows.dtype != torch.float32:
        raise ValueError(f"ce_rows_ needs targets [{c}] and float32 loss_rows [{c}], got "
                         f"{tuple(targets.shape)} and {loss_rows.dtype} {tuple(loss_rows.shape)}")
    if c > 1 and (targets.stride(0) != 1 or loss_rows.stride(0) != 1):  # the kernel indexes them by row
        raise ValueError(f"ce_rows_ needs contiguous targets and loss_rows, got strides "
                         f"{targets.stride()} and {loss_rows.stride()}")
    if c == 0:
        return
    block = block_v or min(8192, triton.next_power_of_2(V))
    _ce_rows_kernel[(c,)](logits, logits.stride(0), targets, loss_rows, scale, V, ignore_index,
                          BLOCK_V=block, WRITE_GRAD=write_grad, num_warps=16 if block >= 4096 else 4)


def fused_chunk(rows: int, vocab: int, hidden: int, elem_bytes: int) -> int:
    """Rows per chunk: the largest power of two whose logits ``[c, V]`` take at most the float32
    ``[V, H]`` weight-gradient accumulator's bytes (``c ≤ 4·H / elem_bytes``) or 64 MiB, whichever
    is more (a small vocabulary then runs in few chunks), at least 16, at most N."""
    budget = max(4 * vocab * hidden, SMALL_CHUNK_BYTES)
    cap = max(16, budget // max(1, vocab * elem_bytes))
    return max(1, min(1 << (cap.bit_length() - 1), rows))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    rows: int = 0,
    ignore_index: int = IGNORE_INDEX,
    grad_hidden: bool = True,
    grad_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Mean cross-entropy of ``hidden @ weightᵀ`` and its gradients, chunk by chunk.

    Args:
        hidden: [N, H] (float32 or bfloat16), weight: [V, H] same dtype and device,
            targets: int64 [N] in [0, V) or ``ignore_index``.
        rows: rows per chunk (0: :func:`fused_chunk`).
        grad_hidden / grad_weight: whether to compute each gradient.
    Returns:
        (loss float32 scalar, d loss/d hidden [N, H] in hidden's dtype or None,
        d loss/d weight [V, H] float32 or None).
    """
    N, H = hidden.shape
    V = weight.shape[0]
    rows = rows or fused_chunk(N, V, H, hidden.element_size())
    targets = targets.contiguous()  # a view of a [B, S + 1] window, say: the kernel reads row by row
    valid = targets != ignore_index
    scale = valid.sum(dtype=torch.float32).reciprocal().reshape(1)  # inf when no row counts
    loss_rows = torch.empty(N, dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if grad_hidden else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight else None
    buf = torch.empty(min(rows, N), V, dtype=hidden.dtype, device=hidden.device)
    wt = weight.t()
    for s in range(0, N, rows):
        e = min(s + rows, N)
        h = hidden[s:e]
        logits = torch.mm(h, wt, out=buf[: e - s])
        ce_rows_(logits, targets[s:e], scale, loss_rows[s:e], ignore_index=ignore_index,
                 write_grad=grad_hidden or grad_weight)
        if dh is not None:
            torch.mm(logits, weight, out=dh[s:e])
        if dw is not None:
            add_mm_t(dw, logits, h)
    return loss_rows.sum() * scale[0], dh, dw


def benchmark(N: int = 16384, H: int = 2048, V: int = 151936, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Milliseconds of the fused loss + gradients and of the full-logits torch loss (bf16 logits
    upcast, as ``F.cross_entropy((h @ Wᵀ).float(), t)`` with autograd), on one CUDA GPU."""
    import triton.testing

    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(N, H, generator=g).to("cuda", dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to("cuda", dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).cuda()

    def full() -> None:
        loss = torch.nn.functional.cross_entropy((h @ w.t()).float(), t)
        torch.autograd.grad(loss, (h, w))

    out = {"fused_ms": triton.testing.do_bench(lambda: linear_cross_entropy(h.detach(), w.detach(), t),
                                               return_mode="median")}
    try:
        out["full_logits_ms"] = triton.testing.do_bench(full, return_mode="median")
    except torch.OutOfMemoryError:
        out["full_logits_ms"] = None
    out["gemm_tflop"] = 3 * 2 * N * H * V / 1e12
    return out


if __name__ == "__main__":
    print(benchmark(*(int(a) for a in sys.argv[1:4])))
