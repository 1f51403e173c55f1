"""Random problems and comparisons shared by the CPU (interpreter) and GPU kernel tests.

``random_case`` draws fresh inputs with a named slot pattern; ``check_expert_ffn`` runs the
Triton path and the exact ``loop`` path of :func:`ray_moe.model.experts.expert_ffn` (in float64 on the
CPU, from the same values, rounding the pre-activations where the kernels do: :func:`reference_expert_ffn`)
and returns the relative error of the output and of each gradient.
"""

from __future__ import annotations

import dataclasses

import torch

from ray_moe.model.experts import ExpertActivation, expert_ffn
from ray_moe.validation.errors import rel_err

PATTERNS = ("random", "all_one_expert", "sparse")


def random_case(
    R: int, K: int, S: int, H: int, I: int, pattern: str, dtype: torch.dtype, device: str | torch.device, seed: int,
    biases: bool = False,
) -> dict[str, torch.Tensor]:
    """Inputs of ``expert_ffn``; with ``biases`` also b13 [S, 2I] and b2 [S, H] (dtype).

    pattern: ``random`` (slots uniform, ~20% of pairs -1, slot 1 never used when S > 2),
    ``all_one_expert`` (every pair to slot S-1), ``sparse`` (each slot gets 0 or 1 pair; needs R*K small).
    Returns x [R, H], w13 [S, H, 2I], w2 [S, I, H] (dtype), slot int64 [R, K], weight float32 [R, K]
    (0 where slot is -1), all on ``device``.
    """
    g = torch.Generator().manual_seed(seed)
    if pattern == "random":
        slot = torch.randint(0, S, (R, K), generator=g)
        if S > 2:
            slot[slot == 1] = 0  # an empty slot
        slot[torch.rand(R, K, generator=g) < 0.2] = -1
    elif pattern == "all_one_expert":
        slot = torch.full((R, K), S - 1, dtype=torch.int64)
    elif pattern == "sparse":
        slot = torch.full((R * K,), -1, dtype=torch.int64)
        chosen = torch.randperm(R * K, generator=g)[: min(S // 2, R * K)]
        slot[chosen] = torch.randperm(S, generator=g)[: chosen.numel()]
        slot = slot.reshape(R, K)
    else:
        raise ValueError(f"pattern {pattern!r} is not one of {PATTERNS}")
    weight = torch.rand(R, K, generator=g) * (slot >= 0)
    case = {
        "x": torch.randn(R, H, generator=g).to(device=device, dtype=dtype),
        "w13": (torch.randn(S, H, 2 * I, generator=g) * H**-0.5).to(device=device, dtype=dtype),
        "w2": (torch.randn(S, I, H, generator=g) * I**-0.5).to(device=device, dtype=dtype),
        "slot": slot.to(device),
        "weight": weight.float().to(device),
    }
    if biases:
        case["b13"] = (torch.randn(S, 2 * I, generator=g) * 0.5).to(device=device, dtype=dtype)
        case["b2"] = (torch.randn(S, H, generator=g) * 0.5).to(device=device, dtype=dtype)
    return case


# gpt-oss's activation with a limit that the unit-variance pre-activations of random_case cross
# often (gpt-oss: 7.0), so that both clamps are active on a good share of the elements
CLAMPED_TEST_LIMIT = 1.0


@dataclasses.dataclass(frozen=True)
class RoundedActivation(ExpertActivation):
    """The activation applied to the pre-activations rounded to ``dtype`` first (their gradient passes
    through the rounding unchanged): the rounding point of the kernels, which save the gate and up
    pre-activations in the activations' dtype and compute the activation from the saved values,
    as transformers' bf16 model does. Where a clamp makes the derivative jump, the elements that
    rounding moves across the limit change their gradient by O(1), which no bound on the float64
    reference without that rounding can absorb (~6 % of dx at limit 1.0 in bf16, 2026-12-08)."""

    dtype: torch.dtype = torch.bfloat16

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        h = h + (h.to(self.dtype).to(h.dtype) - h).detach()
        return super().__call__(h)


def reference_expert_ffn(leaves: dict[str, torch.Tensor], slot: torch.Tensor, act: ExpertActivation,
                         grad_out: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The float64 loop path on ``leaves`` (x, weight, w13, w2 and optional b13, b2, float64 with
    grad) and its gradients for ``grad_out`` [R, H] float64; for a reduced-precision case
    (``dtype`` bf16 or fp16) with the pre-activations rounded to ``dtype``
    (:class:`RoundedActivation`). Returns (out [R, H], the leaves' gradients in their order)."""
    if dtype in (torch.bfloat16, torch.float16):
        act = RoundedActivation(act.kind, act.alpha, act.limit, dtype)
    out = expert_ffn(leaves["x"], slot, leaves["weight"], leaves["w13"], leaves["w2"], impl="loop", act=act,
                     b13=leaves.get("b13"), b2=leaves.get("b2"))
    return out, torch.autograd.grad(out, list(leaves.values()), grad_out)


def check_expert_ffn(case: dict[str, torch.Tensor], seed: int = 1, plan=None, act=None) -> dict[str, float]:
    """Relative errors of the triton path vs the float64 loop reference
    (:func:`reference_expert_ffn`): out, x, weight, w13, w2 (and b13, b2 when the case has biases);
    plus ``empty_slot_grad``: max |dW| (and |db|) over slots with no valid pair (must be exactly 0).
    ``plan``: a :class:`ray_moe.kernels.grouped_swiglu.KernelPlan` (None → the default); ``act``: an
    :class:`~ray_moe.model.experts.ExpertActivation` (None → SwiGLU); with the clamped one,
    ``clamped_share``: the share of pre-activation elements where a clamp holds."""
    from ray_moe.kernels.expert_ffn import expert_ffn_triton
    from ray_moe.model.experts import SWIGLU

    names = ("x", "weight", "w13", "w2") + (("b13", "b2") if "b13" in case else ())
    leaves = {n: case[n].detach().clone().requires_grad_() for n in names}
    out = expert_ffn_triton(leaves["x"], case["slot"], leaves["weight"], leaves["w13"], leaves["w2"], plan=plan,
                            act=act, b13=leaves.get("b13"), b2=leaves.get("b2"))
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], grad_out)

    ref_leaves = {n: case[n].detach().double().cpu().requires_grad_() for n in names}
    slot_cpu = case["slot"].cpu()
    ref, ref_grads = reference_expert_ffn(ref_leaves, slot_cpu, act or SWIGLU, grad_out.double().cpu(), case["x"].dtype)

    result = {"out": rel_err(out, ref)}
    result.update({f"d{n}": rel_err(a, b) for n, a, b in zip(names, grads, ref_grads)})
    S = case["w13"].shape[0]
    used = torch.zeros(S, dtype=torch.bool)
    valid = slot_cpu[(slot_cpu >= 0) & (slot_cpu < S)]
    used[valid] = True
    empty = (~used).nonzero().squeeze(1)
    result["empty_slot_grad"] = max(
        [grads[i][empty].abs().max().item() if empty.numel() else 0.0 for i in range(2, len(names))]
    )
    result["n_empty_slots"] = float(empty.numel())
    if act is not None and act.kind == "clamped_swiglu":
        result["clamped_share"] = _clamped_share(ref_leaves, slot_cpu, act)
    return result


def check_router_logits(logits_fn, T: int, H: int, E: int, device: str | torch.device, seed: int = 0) -> dict[str, float]:
    """Relative errors of ``logits_fn(x bf16 [T, H], w float32 [H, E]) -> float32 [T, E]`` and of
    its gradients against the float64 product on fresh random inputs (0.0 everywhere when T=0).
    Also checks the output's dtype/shape and that dx comes back in bf16 (raises otherwise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(H, E, generator=g) / H**0.5).to(device).requires_grad_()
    got = logits_fn(x, w)
    if got.dtype != torch.float32 or tuple(got.shape) != (T, E):
        raise AssertionError(f"logits must be float32 [{T}, {E}], got {got.dtype} {tuple(got.shape)}")
    if T == 0:
        return {"logits": 0.0, "dx": 0.0, "dw": 0.0}
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = xr @ wr
    go = torch.randn(T, E, generator=g).to(device)
    dx, dw = torch.autograd.grad(got, (x, w), go)
    rx, rw = torch.autograd.grad(want, (xr, wr), go.double())
    if dx.dtype != torch.bfloat16:
        raise AssertionError(f"dx must be bf16 like x, got {dx.dtype}")
    return {"logits": rel_err(got, want), "dx": rel_err(dx, rx), "dw": rel_err(dw, rw)}


def _clamped_share(leaves: dict[str, torch.Tensor], slot: torch.Tensor, act) -> float:
    """Share of the valid pairs' gate and up elements where gpt-oss's clamp holds."""
    K = slot.shape[1]
    flat = slot.reshape(-1)
    clamped = total = 0
    with torch.no_grad():
        for s in range(leaves["w13"].shape[0]):
            rows = (flat == s).nonzero().squeeze(1) // K
            h = leaves["x"][rows] @ leaves["w13"][s]
            if "b13" in leaves:
                h = h + leaves["b13"][s]
            gate, up = h.chunk(2, dim=-1)
            clamped += int((gate > act.limit).sum() + (up.abs() > act.limit).sum())
            total += h.numel()
    return clamped / max(total, 1)
