"""Mixed-precision AdamW: float32 master weights and optimizer state behind compute-dtype parameters.

The recipe of Megatron and torchtitan. The model's parameters stay in the compute dtype
(``model.dtype``) and are what forward and backward use. For every parameter that is not float32
this optimizer keeps a float32 *master* copy (made once from the parameter), a float32 gradient
buffer and float32 AdamW moments; float32 parameters (all of them with ``model.dtype: float32``,
the routers of a bf16 model) are their own masters, with no copy. One update:

1. :meth:`MixedPrecisionAdamW.gather_grads`: the parameters' gradients become float32 master
   gradients (each bf16 gradient is freed as soon as it is copied);
2. the caller reduces those across ranks, measures the global norm and applies its non-finite
   policy: a skipped step never calls :meth:`~MixedPrecisionAdamW.step`, so weights and state
   stay untouched;
3. :meth:`~MixedPrecisionAdamW.step`: clipping folded into the update (the ``grad_scale`` input
   of torch's fused kernel, else one foreach multiply), AdamW on the masters (torch's fused
   kernel on CUDA, foreach elsewhere), then the masters rounded into the compute parameters and
   the master gradients freed.

Memory per bf16 parameter: 2 bytes (weight) + 12 (float32 master and two moments), plus its
gradient: 2 bytes (bf16) from backward until :meth:`~MixedPrecisionAdamW.gather_grads`, 4 bytes
(float32) from there until the update ends, when the activations are gone: 16 bytes at the peak
of backward, 18 during the update.

Gradient reduction precision: float32. The cross-rank sums (replicated gradients all-reduced,
clone gradients added onto their owners) run on the float32 master gradients. A bf16 reduction
would round every partial sum to 8 significant bits, an error that grows with the number of
ranks, to save bytes on the smaller part of an MoE model (attention, embeddings, norms, routers:
expert gradients are never all-reduced, since combine's backward already brings every rank's
tokens to the expert's rank, where the weight-gradient GEMM sums them with float32
accumulation); and the float32 gradients are needed for the update anyway.

No weight decay (decided per tensor, for any architecture): tensors of rank < 2 (norm weights,
biases, scales), the weights of embedding modules (``nn.Embedding``: also an LM head tied to
one), and bare parameters whose name says they are an embedding table (``pos_emb``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ray_moe.placement.placement import expert_shard

OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for_loop")


def no_weight_decay(model: nn.Module) -> frozenset[str]:
    """Names (as ``model.named_parameters()`` gives them) of the parameters AdamW must not decay."""
    exempt: set[int] = set()
    for module in model.modules():
        for local, p in module.named_parameters(recurse=False):
            if p.dim() < 2 or isinstance(module, nn.Embedding) or "emb" in local:
                exempt.add(id(p))
    return frozenset(name for name, p in model.named_parameters() if id(p) in exempt)


def _resolve_impl(impl: str, tensors: Iterable[torch.Tensor]) -> str:
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"train.optimizer_impl={impl!r} is not allowed; choose one of {', '.join(OPTIMIZER_IMPLS)}")
    if impl == "auto":
        return "fused" if all(t.is_cuda for t in tensors) else "foreach"
    return impl


class MixedPrecisionAdamW:
    """AdamW over float32 masters of a model's parameters (see the module docstring).

    Args:
        model: the model; its parameters (any dtype) are the compute parameters.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (decoupled weight decay, applied
            to the parameters :func:`no_weight_decay` does not name).
        impl: ``auto`` (torch's fused kernel when every parameter is on CUDA, else foreach),
            ``fused``, ``foreach`` or ``for_loop`` (one tensor at a time).
        master_weights: False updates the compute parameters directly (pure bf16 AdamW when
            ``model.dtype`` is bfloat16: updates smaller than half a bf16 ulp are lost). For
            comparison only.

    Masters carry the parameters' ``expert_shard`` marks and are saved under the parameters'
    names (:meth:`named_masters`), with their AdamW state (:attr:`state`, keyed by master).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        impl: str = "auto",
        master_weights: bool = True,
    ) -> None:
        named = list(model.named_parameters())
        self.names = tuple(n for n, _ in named)
        self.params = tuple(p for _, p in named)
        self.masters = tuple(_master(p) if master_weights and p.dtype != torch.float32 else p for p in self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # (compute parameter, master) pairs that are distinct tensors
        self._copies = tuple((p, m) for p, m in zip(self.params, self.masters, strict=True) if m is not p)
        self.impl = _resolve_impl(impl, self.masters)
        exempt = no_weight_decay(model)
        groups = [
            {"params": [m for n, m in zip(self.names, self.masters, strict=True) if n not in exempt],
             "weight_decay": weight_decay},
            {"params": [m for n, m in zip(self.names, self.masters, strict=True) if n in exempt],
             "weight_decay": 0.0},
        ]
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[self.impl]
        self.inner = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps, **kind)

    # ------------------------------------------------------------------ access
    @property
    def state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """AdamW's per-master state (``exp_avg``, ``exp_avg_sq`` float32 shaped like the master, ``step``)."""
        return self.inner.state

    def named_masters(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, master) for every parameter: what a checkpoint holds."""
        return list(zip(self.names, self.masters, strict=True))

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The master of compute parameter ``param`` (``param`` itself when it is float32)."""
        return self.masters[self._index[id(param)]]

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        """The master gradient of ``param`` (float32 with masters), from :meth:`gather_grads` until
        the update."""
        return self.master(param).grad

    # ------------------------------------------------------------------ one update
    def zero_grad(self) -> None:
        """Drop the compute parameters' gradients: backward writes fresh ones (no zeroing pass over
        them; the master gradients are overwritten by :meth:`gather_grads`)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def gather_grads(self) -> None:
        """Master gradients ← the compute parameters' gradients (zeros where backward left none);
        a compute-dtype gradient is freed once copied."""
        for p, m in zip(self.params, self.masters, strict=True):
            if m is p:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                continue
            m.grad = torch.zeros_like(m) if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    def drop_grads(self) -> None:
        """Free the float32 master gradients (after an update, or when a step is skipped)."""
        for _, m in self._copies:
            m.grad = None

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0) -> None:
        """One AdamW update of the masters with gradients scaled by ``clip_coef`` (≤ 1: the global
        norm clipping), then the compute parameters ← the masters (rounded to their dtype)."""
        for group in self.inner.param_groups:
            group["lr"] = lr
        if clip_coef != 1.0:
            if self.impl == "fused":  # the kernel divides the gradients by grad_scale: no extra pass
                self.inner.grad_scale = torch.full((), 1.0 / clip_coef, device=self.masters[0].device)
            else:
                torch._foreach_mul_([m.grad for m in self.masters], clip_coef)
        try:
            self.inner.step()
        finally:
            self.inner.grad_scale = None
        self.refresh_params()
        self.drop_grads()

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Compute parameters ← masters (after an update, or after a checkpoint filled the masters)."""
        if self._copies:
            torch._foreach_copy_([p for p, _ in self._copies], [m for _, m in self._copies])

    def loaded(self) -> None:
        """After a checkpoint filled the masters and :attr:`state`: refresh the compute parameters
        and put the step counters where this update kernel keeps them (fused: float32 on the
        masters' device)."""
        self.refresh_params()
        if self.impl != "fused":
            return
        for m in self.masters:
            state = self.state.get(m)
            if state and "step" in state:
                state["step"] = state["step"].to(device=m.device, dtype=torch.float32)


def _master(p: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``p`` with its ``expert_shard`` mark."""
    m = torch.empty_like(p, dtype=torch.float32, requires_grad=False).copy_(p.detach())
    shard = expert_shard(p)
    if shard is not None:
        m.expert_shard = shard
    return m
