"""One-pass AdamW for a compute-dtype parameter with float32 master weights and float32 or bf16 moments.

Torch's fused AdamW wants gradients in the master's dtype, so the float32 recipe reads a bf16
gradient, writes a float32 copy, reads it back for the norm and for the update, and writes the
bf16 parameter in another pass: ~46 bytes per parameter. This kernel reads the bf16 gradient once
(scaled by the clipping and world-size factor as it is loaded), updates the float32 master and
both moments in place and writes the bf16 parameter: 28 bytes per parameter (gradient 2, master
4+4, moments 8+8, parameter 2), the floor for float32 masters and state.

BF16 moments (``train.optimizer_state_dtype: bfloat16``, DeepSeek-V3's recipe): the moments are
loaded from bf16, updated and used in float32, and rounded to bf16 (nearest) only when stored:
20 bytes per parameter (moments 4+4) and 4 bytes less of state per parameter.

``adamw_step`` (the launcher) and ``adamw_step_reference`` (torch, any device) compute the same
update as ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

MOMENT_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _adamw_kernel(grad_ptr, master_ptr, m_ptr, v_ptr, param_ptr, n, lr, beta1, beta2, eps, decay,
                  grad_scale, step_size, inv_sqrt_bc2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * (1.0 - lr * decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)


def _factors(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(step size lr / (1 - β1^t), 1 / sqrt(1 - β2^t)) for update number ``step`` (≥ 1)."""
    return lr / (1.0 - beta1 ** step), 1.0 / math.sqrt(1.0 - beta2 ** step)


def adamw_step(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               param: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               step: int, grad_scale: float = 1.0, block: int = 2048) -> None:
    """One AdamW update in one pass, in place.

    Args:
        grad: the compute parameter's gradient (bf16 or float32), any shape, contiguous.
        master: float32, same shape: the master weight (updated).
        exp_avg, exp_avg_sq: float32 or bfloat16 (both the same), same shape: the moments
            (updated; computed in float32 either way, rounded when stored in bf16).
        param: the compute parameter (its dtype), same shape: written with the rounded master.
        step: this update's number (1 for the first), for the bias corrections.
        grad_scale: multiplies the gradient as it is read (global-norm clipping, 1/W).
    """
    tensors = (grad, master, exp_avg, exp_avg_sq, param)
    if any(t.shape != master.shape or not t.is_contiguous() or t.device != master.device for t in tensors):
        raise ValueError("adamw_step wants contiguous tensors of one shape on one device")
    if master.dtype != torch.float32:
        raise TypeError(f"the master must be float32, got {master.dtype}")
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in MOMENT_DTYPES:
        raise TypeError(f"the moments must both be float32 or both bfloat16, got {exp_avg.dtype} and {exp_avg_sq.dtype}")
    n = master.numel()
    if n == 0:
        return
    if not master.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":  # the CPU path: same update
        adamw_step_reference(grad, master, exp_avg, exp_avg_sq, param, lr=lr, beta1=beta1, beta2=beta2,
                             eps=eps, weight_decay=weight_decay, step=step, grad_scale=grad_scale)
        return
    step_size, inv_sqrt_bc2 = _factors(lr, beta1, beta2, step)
    _adamw_kernel[(triton.cdiv(n, block),)](
        grad, master, exp_avg, exp_avg_sq, param, n, lr, beta1, beta2, eps, weight_decay,
        grad_scale, step_size, inv_sqrt_bc2, BLOCK=block, num_warps=8)
    # the kernel wrote param in place: say so in its version counter, as a torch in-place op would
    # (the FP8 experts' weight copies are remade when it moves: kernels.fp8_expert_ffn.Fp8WeightCache)
    torch.autograd.graph.increment_version(param)


@torch.no_grad()
def adamw_step_reference(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                         exp_avg_sq: torch.Tensor, param: torch.Tensor, *, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float, step: int,
                         grad_scale: float = 1.0) -> None:
    """:func:`adamw_step` in torch operations (same arguments, same in-place results; bf16
    moments are computed in float32 and rounded when stored, as the kernel does)."""
    step_size, inv_sqrt_bc2 = _factors(lr, beta1, beta2, step)
    g = grad.float() * grad_scale
    master.mul_(1.0 - lr * weight_decay)
    if exp_avg.dtype == torch.float32:
        m, v = exp_avg, exp_avg_sq  # in place
    else:
        m, v = exp_avg.float(), exp_avg_sq.float()
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    master.sub_(step_size * m / (v.sqrt() * inv_sqrt_bc2 + eps))
    if m is not exp_avg:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if param is not master:
        param.copy_(master)
