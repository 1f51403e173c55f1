"""The language-model loss from final hidden states: LM head + cross-entropy, never the full logits.

At a real vocabulary the logits are the largest tensor of a step (V=151936, N=32768 tokens:
20 GB in float32, and as much again for their gradient). :func:`lm_loss` computes the loss and
both gradients chunk by chunk of rows instead:

- ``chunked`` (any device; ``auto``'s choice off CUDA): a custom autograd function. Per chunk of ``c`` rows it
  forms the chunk's logits in the model dtype (as ``hidden @ weightᵀ`` would), upcasts them to
  float32 for the log-sum-exp, and turns them in place into the logits' gradient (softmax − one
  hot, divided by the number of counted rows), from which it takes the chunk's hidden-state
  gradient and adds its share of the head's weight gradient (accumulated in float32 across
  chunks). Only one chunk of logits ``[c, V]`` exists at a time; the gradients are kept for
  backward, which scales them by the incoming gradient. No host synchronisation.
- ``fused`` (CUDA; or the CPU under ``TRITON_INTERPRET=1``): :mod:`ray_moe.kernels.linear_ce` —
  the same three GEMMs (cuBLAS) around one Triton kernel per chunk that does the log-sum-exp, the
  loss and the logits' gradient in place in the model dtype (the chunked path's ~6 elementwise
  kernels over float32 copies), and chunks of ``4·H / element size`` rows or 64 MiB (4096 at H = 2048
  bf16), so the float32 weight-gradient accumulator is read and written a few times per step
  instead of once per 256 rows. No host synchronisation.
- ``liger``: Liger-Kernel's fused linear cross-entropy (Triton; the same chunking with the softmax
  and its gradient in one kernel per chunk), weight gradient accumulated in float32. CUDA only; it
  reads two scalars on the host per call (the counted rows, and whether the incoming gradient is 1).

``auto`` is a rule, not a measurement (timing three loss variants at a real vocabulary costs
seconds of GEMMs and as much memory as the loss itself): on CUDA ``fused`` (Triton ships with
torch there), else ``liger`` when it imports, else ``chunked`` — with a warning, once, when that
fallback happens on CUDA. ``ray-moe bench train --loss-only`` times all of them at a shape.

Rows whose target is ``ignore_index`` count neither in the sum nor in the mean (as in
``F.cross_entropy``); if every row is ignored the loss is NaN, as there.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

import torch

from ray_moe.device import add_mm_t

log = logging.getLogger(__name__)

LOSS_IMPLS = ("auto", "chunked", "fused", "liger")
IGNORE_INDEX = -100
SMALL_LOGITS_BYTES = 64 * 2**20  # float32 logits chunks below this are never split further


def liger_available() -> bool:
    """Whether Liger-Kernel's fused linear cross-entropy imports here and takes ``accum_dtype``
    (0.6.2 and later: the float32 weight-gradient accumulator)."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:  # ImportError, or a Triton/CUDA mismatch raised while importing
        return False
    return "accum_dtype" in inspect.signature(liger_fused_linear_cross_entropy).parameters


def fused_available(device: torch.device) -> bool:
    """Whether :mod:`ray_moe.kernels.linear_ce` runs on ``device``: CUDA with Triton, or any
    device under Triton's interpreter (``TRITON_INTERPRET=1``, for tests)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import ray_moe.kernels.linear_ce  # noqa: F401
    except Exception:  # no triton, or a Triton/CUDA mismatch raised while importing
        return False
    return True


@functools.cache
def _warn_fallback(device_type: str) -> None:
    """Warn once per process (per device type) that ``auto`` fell back to the slow chunked path."""
    log.warning("train.loss_impl=auto on %s runs the chunked loss (several times slower at a large "
                "vocabulary): Triton does not import here and neither does liger-kernel "
                "(pip install 'liger-kernel>=0.6.2')", device_type)


def resolve_loss_impl(name: str, device: torch.device) -> str:
    """``train.loss_impl`` → the implementation to run on ``device``: ``auto`` is ``fused`` on
    CUDA, else ``liger`` there when it imports, else ``chunked`` (warned once on CUDA). Raises
    ValueError for ``fused`` or ``liger`` where they cannot run."""
    if name not in LOSS_IMPLS:
        raise ValueError(f"train.loss_impl={name!r} is not allowed; choose one of {', '.join(LOSS_IMPLS)}")
    if name == "auto":
        if device.type != "cuda":
            return "chunked"
        if fused_available(device):
            return "fused"
        if liger_available():
            return "liger"
        _warn_fallback(device.type)
        return "chunked"
    if name == "fused" and not fused_available(device):
        raise ValueError(f"train.loss_impl=fused needs CUDA with Triton but the device is {device}; "
                         "use chunked or auto")
    if name == "liger":
        if device.type != "cuda":
            raise ValueError(f"train.loss_impl=liger needs CUDA but the device is {device}; use chunked or auto")
        if not liger_available():
            raise ValueError("train.loss_impl=liger but liger_kernel does not import "
                             "(pip install 'liger-kernel>=0.6.2'); use chunked or auto")
    return name


def auto_chunk(rows: int, vocab: int, hidden: int) -> int:
    """Rows per chunk such that a chunk's logits ``[c, V]`` hold about as many elements as the
    hidden states ``[N, H]`` (Liger-Kernel's rule: the next power of two of N / ceil(V / H)), but
    never fewer rows than 64 MiB of float32 logits hold (smaller chunks save nothing worth their
    per-chunk cost), and at most N."""
    per = -(-vocab // hidden)
    c = 1 << max(0, (-(-rows // per) - 1).bit_length())
    floor = 1 << max(0, (SMALL_LOGITS_BYTES // (4 * vocab)).bit_length() - 1)
    return max(1, min(max(c, floor), rows))


def lm_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    impl: str = "chunked",
    chunk: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ head_weightᵀ`` without materialising the logits.

    Args:
        hidden: [N, H] final hidden states (model dtype: float32 or bfloat16).
        head_weight: [V, H] the LM head's weight, same dtype and device as ``hidden``.
        targets: int64 [N] token ids in [0, V), or ``ignore_index``.
        impl: ``chunked``, ``fused``, ``liger`` or ``auto`` (see the module docstring and
            :func:`resolve_loss_impl`).
        chunk: rows per chunk for ``chunked`` and ``fused``; 0 = :func:`auto_chunk` (chunked),
            :func:`ray_moe.kernels.linear_ce.fused_chunk` (fused).
        ignore_index: target value of rows that are not counted.
    Returns:
        float32 scalar: mean over the counted rows of -log softmax(hidden @ head_weightᵀ)[target].
    """
    _check(hidden, head_weight, targets)
    if impl == "auto":
        impl = resolve_loss_impl(impl, hidden.device)
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(hidden, head_weight, targets, ignore_index=ignore_index,
                                                accum_dtype=torch.float32).float()
    if impl not in ("chunked", "fused"):
        raise ValueError(f"lm_loss impl={impl!r} is not allowed; choose one of {', '.join(LOSS_IMPLS)}")
    N, H = hidden.shape
    rows = chunk or (0 if impl == "fused" else auto_chunk(N, head_weight.shape[0], H))
    if torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, head_weight, targets, rows, ignore_index, impl)
    return _loss_and_grads(impl, hidden, head_weight, targets, rows, ignore_index, False, False)[0]


def _loss_and_grads(
    impl: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
    ignore_index: int, grad_hidden: bool, grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, d hidden or None, d weight float32 or None) by ``impl`` (chunked | fused)."""
    if impl == "fused":
        from ray_moe.kernels.linear_ce import linear_cross_entropy

        return linear_cross_entropy(hidden, weight, targets, rows=rows, ignore_index=ignore_index,
                                    grad_hidden=grad_hidden, grad_weight=grad_weight)
    return _chunked(hidden, weight, targets, rows, ignore_index, grad_hidden, grad_weight)


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"lm_loss needs hidden [N, H] and head_weight [V, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"lm_loss needs targets [N] for hidden [N, H], got {tuple(targets.shape)} "
                         f"for {tuple(hidden.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"lm_loss needs hidden and head_weight of one dtype, got {hidden.dtype} and {weight.dtype}")


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rows: int,
    ignore_index: int,
    grad_hidden: bool,
    grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss float32 scalar, d loss/d hidden [N, H] in hidden's dtype or None, d loss/d weight
    [V, H] float32 or None), chunk by chunk of ``rows`` rows."""
    N = hidden.shape[0]
    valid = targets != ignore_index
    scale = valid.sum().float().reciprocal()  # 1 / counted rows (inf when none: the loss is NaN)
    safe = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if grad_hidden else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight else None
    for s in range(0, N, rows):
        e = min(s + rows, N)
        h, t, keep = hidden[s:e], safe[s:e], valid[s:e]
        logits = (h @ weight.t()).float()  # [c, V]: the model dtype's GEMM, as the full path's
        lse = torch.logsumexp(logits, dim=1)
        total += ((lse - logits.gather(1, t).squeeze(1)) * keep).sum()
        if not (grad_hidden or grad_weight):
            continue
        g = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place
        g.scatter_add_(1, t, torch.full_like(t, -1, dtype=g.dtype))  # − one hot
        g = _scaled(g, (keep * scale).unsqueeze(1), hidden.dtype)
        if dh is not None:
            torch.mm(g, weight, out=dh[s:e])
        if dw is not None:
            add_mm_t(dw, g, h)
    return total * scale, dh, dw


def _scaled(x: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * factor (float32 arithmetic) stored in ``dtype``: in place when x already has it."""
    if x.dtype == dtype:
        return x.mul_(factor)
    return torch.mul(x, factor, out=torch.empty_like(x, dtype=dtype))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """(chunked and fused) Loss in forward with both gradients computed there (the logits never outlive a chunk);
    backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, ignore_index, impl):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, dh, dw = _loss_and_grads(impl, hidden, weight, targets, rows, ignore_index, need_h, need_w)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        if dh is not None:
            dh = torch.mul(dh, grad_loss, out=torch.empty_like(dh))
        if dw is not None:
            dw = torch.mul(dw, grad_loss, out=torch.empty_like(dw, dtype=ctx.weight_dtype))
        return dh, dw, None, None, None, None
