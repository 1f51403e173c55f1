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
of backward, 18 during the update. With ``train.optimizer_state_dtype: bfloat16`` the moments
take 2 bytes each (DeepSeek-V3's recipe; float32 masters and gradients kept): 12 and 14. A gradient
that nothing reduces in float32 (the expert weights' under ``onepass``; on one rank, ``alone``,
every parameter's) is read by the one-pass kernel in the compute dtype and never copied: 2 bytes
instead of 4 until the update ends. An expert weight's clone slots (hot-expert re-cloning) hold
only the weight and its gradient (with float32 masters of bf16 weights; a float32 parameter is its
own master and keeps its moments for every slot): the master and moments cover the native slots (a clone's
gradient goes to its owner and its weight comes from the owner after the update).

Gradient reduction precision: float32 by default (``parallel.grad_reduce_dtype``; bfloat16 is
Megatron's default). The cross-rank sums (replicated gradients all-reduced, clone gradients added
onto their owners) run on the float32 master gradients. A bf16 reduction
would round every partial sum to 8 significant bits, an error that grows with the number of
ranks, to save bytes on the smaller part of an MoE model (attention, embeddings, norms, routers:
expert gradients are never all-reduced, since combine's backward already brings every rank's
tokens to the expert's rank, where the weight-gradient GEMM sums them with float32
accumulation); and the float32 gradients are needed for the update anyway. With bfloat16 the
clone sums are rounded once into the experts' bf16 gradients (``rounded_clone_sums``), which the
one-pass update then reads as it is, and ZeRO's buckets reduce in bf16
(:mod:`ray_moe.worker.zero`).

No weight decay (decided per tensor, for any architecture): tensors of rank < 2 (norm weights,
biases, scales), the weights of embedding modules (``nn.Embedding``: also an LM head tied to
one), and bare parameters whose name says they are an embedding table (``pos_emb``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from types import MappingProxyType

import torch
from torch import nn

from ray_moe.placement.placement import expert_shard

OPTIMIZER_IMPLS = ("auto", "onepass", "fused", "foreach", "for_loop")
STATE_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16})


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
        return "onepass" if all(t.is_cuda for t in tensors) else "foreach"
    return impl


def _one_pass_eligible(p: torch.Tensor, master: torch.Tensor, alone: bool = False,
                       rounded_clone_sums: bool = False) -> bool:
    """Whether the one-pass kernel can read ``p``'s gradient in the compute dtype: nothing reduces
    it in float32 first. Expert weights with a separate float32 master and no clone slots: their
    gradient is summed on the expert's rank by the weight-gradient GEMM (float32 accumulation) and
    never reduced again (layers with clone slots keep the float32 path, where clone gradients are
    added onto the owners in float32, unless ``rounded_clone_sums``: those sums are rounded into
    the compute-dtype gradient, ``parallel.grad_reduce_dtype: bfloat16``). ``alone`` (one rank):
    the replicated parameters too, whose gradients no rank then all-reduces."""
    if master is p:
        return False
    shard = expert_shard(p)
    if shard is None:
        return alone
    return rounded_clone_sums or p.shape[0] == len(shard.native_experts)


class MixedPrecisionAdamW:
    """AdamW over float32 masters of a model's parameters (see the module docstring).

    Args:
        model: the model; its parameters (any dtype) are the compute parameters.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (decoupled weight decay, applied
            to the parameters :func:`no_weight_decay` does not name).
        impl: ``auto`` (``onepass`` when every parameter is on CUDA, else foreach), ``onepass``
            (every parameter with a float32 master through
            :func:`ray_moe.worker.adamw_kernel.adamw_step`, one tensor at a time in registration
            order: the gradient read once, bf16 where nothing reduces it in float32, the master
            and moments updated in place, the parameter written, no separate refresh; float32
            parameters, their own masters, through torch's fused kernel), ``fused``, ``foreach`` or
            ``for_loop`` (one tensor at a time).
        master_weights: False updates the compute parameters directly (pure bf16 AdamW when
            ``model.dtype`` is bfloat16: updates smaller than half a bf16 ulp are lost). For
            comparison only.
        state_dtype: the AdamW moments' storage, ``float32`` or ``bfloat16`` (DeepSeek-V3's
            recipe: computed in float32, rounded when stored; 4 bytes less per parameter). With
            bf16 moments every parameter goes through the one-pass update
            (:func:`ray_moe.worker.adamw_kernel.adamw_step`: the Triton kernel on CUDA, its torch
            reference elsewhere); it needs float32 masters.
        exclude: names of parameters this optimizer leaves alone (the replicated ones when
            :class:`ray_moe.worker.zero.ShardedReplicatedState` holds their state).
        alone: one rank, whose replicated gradients are never all-reduced: in the one-pass update
            (``onepass``) their compute-dtype gradients are read as they are, like the expert
            weights', with no float32 copy (6 of ~32 bytes per parameter, and a norm read of 2
            bytes instead of 4).
        rounded_clone_sums: clone gradients are added onto their owners in the compute dtype
            (:class:`ray_moe.worker.clone_grads.CloneGradReduction`, ``rounded``), so the one-pass
            update reads the gradients of expert weights with clone slots as they are too.

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
        state_dtype: str = "float32",
        exclude: Collection[str] = (),
        alone: bool = False,
        rounded_clone_sums: bool = False,
    ) -> None:
        named = [(n, p) for n, p in model.named_parameters() if n not in exclude]
        self.names = tuple(n for n, _ in named)
        self.params = tuple(p for _, p in named)
        # an expert weight's clone slots get no master (nor moments): their gradients go to the
        # owners and their weights come from them, so the master covers the native slots only
        self.masters = tuple(_master(p) if master_weights and p.dtype != torch.float32 else p for p in self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # (compute parameter, master) pairs that are distinct tensors
        self._copies = tuple((p, m) for p, m in zip(self.params, self.masters, strict=True) if m is not p)
        self.impl = _resolve_impl(impl, self.masters)
        self.state_dtype = _state_dtype(state_dtype)
        exempt = no_weight_decay(model)
        self.betas, self.eps = betas, eps
        bf16_state = self.state_dtype != torch.float32
        if bf16_state and any(m.dtype != torch.float32 for m in self.masters):
            raise ValueError("train.optimizer_state_dtype=bfloat16 needs float32 masters "
                             "(train.master_weights=true, or model.dtype float32)")
        # (parameter, master, weight decay) updated by the one-pass kernel: every parameter with
        # a float32 master (onepass: 30 bytes a parameter where torch's fused AdamW on the float32
        # copy and the refresh move 40; in forward order, which train.overlap_update's block
        # events follow), or every parameter (bf16 moments: torch's AdamW keeps its moments in the
        # parameters' dtype); the rest by torch's AdamW
        self._one_pass = tuple(
            (p, m, 0.0 if n in exempt else weight_decay)
            for n, p, m in zip(self.names, self.params, self.masters, strict=True)
            if bf16_state or (self.impl == "onepass" and m is not p))
        # compute parameters whose own (compute-dtype) gradient the kernel reads: no float32 copy
        self._one_pass_ids = frozenset(
            id(p) for p, m, _ in self._one_pass if self.impl == "onepass" and _one_pass_eligible(p, m, alone, rounded_clone_sums))
        # (parameter, master) pairs whose parameter the update refreshes from its master (the
        # one-pass kernel writes its parameters itself)
        kernel_params = frozenset(id(p) for p, _, _ in self._one_pass)
        self._refreshed = tuple((p, m) for p, m in self._copies if id(p) not in kernel_params)
        self._one_pass_master_ids = frozenset(id(m) for _, m, _ in self._one_pass)
        rest = [(n, m) for n, m in zip(self.names, self.masters, strict=True) if id(m) not in self._one_pass_master_ids]
        groups = [
            {"params": [m for n, m in rest if n not in exempt], "weight_decay": weight_decay},
            {"params": [m for n, m in rest if n in exempt], "weight_decay": 0.0},
        ]
        inner = "fused" if self.impl == "onepass" else self.impl
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[inner]
        self.inner = _TorchAdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps, **kind)

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
        """The gradient the update will read for ``param``, from :meth:`gather_grads` until the
        update: the float32 master gradient (of an expert weight with clone slots, its native
        slots'), or, for a one-pass parameter, its own (compute-dtype) gradient, every slot."""
        if id(param) in self._one_pass_ids:
            return param.grad
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
            if m is p or id(p) in self._one_pass_ids:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                continue
            m.grad = torch.zeros_like(m) if p.grad is None else _like(p.grad, m).to(torch.float32)
            p.grad = None

    def drop_grads(self) -> None:
        """Free the float32 master gradients and the one-pass parameters' gradients (after an
        update, or when a step is skipped)."""
        for _, m in self._copies:
            m.grad = None
        for p, _, _ in self._one_pass:
            if id(p) in self._one_pass_ids:
                p.grad = None

    def one_pass_named(self) -> list[tuple[str, torch.Tensor]]:
        """(name, compute parameter) of the parameters the one-pass kernel updates, in the order
        :meth:`step` updates them (after every other parameter)."""
        names = {id(p): n for n, p in zip(self.names, self.params, strict=True)}
        return [(names[id(p)], p) for p, _, _ in self._one_pass]

    def pending_grads(self) -> list[torch.Tensor]:
        """Every gradient the next :meth:`step` reads (compute-dtype and float32 master ones)."""
        return [g for p, m in zip(self.params, self.masters, strict=True)
                for g in ({id(p.grad): p.grad, id(m.grad): m.grad}.values()) if g is not None]

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0,
             done: Callable[[torch.Tensor | None], None] | None = None) -> None:
        """One AdamW update of the masters with gradients scaled by ``clip_coef`` (≤ 1: the global
        norm clipping), then the compute parameters ← the masters (rounded to their dtype).
        Torch's AdamW goes first (with its parameters' refresh), then the one-pass parameters one by
        one, in :meth:`one_pass_named`'s order. ``done(None)`` is called between the two and
        ``done(param)`` after each one-pass parameter
        (:class:`ray_moe.worker.overlap.UpdateOverlap` records its block events there)."""
        for group in self.inner.param_groups:
            group["lr"] = lr
        if clip_coef != 1.0 and self.masters:  # (the one-pass kernel scales its own gradients as it reads them)
            if self.inner.defaults.get("fused"):  # the kernel divides the gradients by grad_scale
                self.inner.grad_scale = torch.full((), 1.0 / clip_coef, device=self.masters[0].device)
            else:
                grads = [m.grad for g in self.inner.param_groups for m in g["params"]]
                if grads:
                    torch._foreach_mul_(grads, clip_coef)
        try:
            self.inner.step()
        finally:
            self.inner.grad_scale = None
        if self._refreshed:  # compute parameters ← the updated masters, rounded to their dtype
            torch._foreach_copy_([_like(p, m) for p, m in self._refreshed], [m for _, m in self._refreshed])
        if done is not None:
            done(None)
        self._one_pass_step(lr, clip_coef, done)
        self.drop_grads()

    def _one_pass_step(self, lr: float, clip_coef: float,
                       done: Callable[[torch.Tensor | None], None] | None = None) -> None:
        from ray_moe.worker.adamw_kernel import adamw_step

        b1, b2 = self.betas
        for p, m, decay in self._one_pass:
            state = self.state[m]
            if not state:
                state.update(exp_avg=torch.zeros_like(m, dtype=self.state_dtype),
                             exp_avg_sq=torch.zeros_like(m, dtype=self.state_dtype),
                             step=torch.zeros((), dtype=torch.float32))
            state["step"] = state["step"].cpu() + 1  # a host counter: the bias corrections are host floats
            grad = _like(p.grad, m) if id(p) in self._one_pass_ids else m.grad
            adamw_step(grad, m, state["exp_avg"], state["exp_avg_sq"], _like(p, m), lr=lr, beta1=b1, beta2=b2,
                       eps=self.eps, weight_decay=decay, step=int(state["step"]), grad_scale=clip_coef)
            if done is not None:
                done(p)

    @torch.no_grad()
    def loaded(self) -> None:
        """After a checkpoint filled the masters and :attr:`state`: refresh the compute parameters
        and put the step counters where this update kernel keeps them (fused: float32 on the
        masters' device)."""
        if self._copies:  # compute parameters from the loaded masters (native slots; clones: the owners' push)
            torch._foreach_copy_([_like(p, m) for p, m in self._copies], [m for _, m in self._copies])
        for _, m, _ in self._one_pass:  # the kernel's moments in their storage dtype, a host step
            state = self.state.get(m)
            if state:
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key] = state[key].to(dtype=self.state_dtype)
                if "step" in state:
                    state["step"] = state["step"].cpu().float()
        if self.impl not in ("fused", "onepass"):
            return
        for m in self.masters:
            state = self.state.get(m)
            if state and "step" in state and id(m) not in self._one_pass_master_ids:
                state["step"] = state["step"].to(device=m.device, dtype=torch.float32)


class _TorchAdamW:
    """torch's AdamW update (``torch.optim.adam.adam`` with decoupled weight decay: the same fused,
    foreach and for-loop kernels, the same state) without ``torch.optim.Optimizer``, whose methods
    import ``torch._dynamo`` at their first call (~1.2 s of CPU in every worker process).

    ``param_groups``: dicts with ``params`` (float32 tensors with ``.grad``), ``weight_decay`` and
    ``lr``; ``state[param]``: ``exp_avg``, ``exp_avg_sq`` (float32, the parameter's shape) and
    ``step`` (float32 scalar: on the parameter's device when fused, else on the host), the layout
    ``torch.optim.AdamW`` uses, so checkpoints of either load into the other. ``grad_scale``:
    with ``fused``, a float32 scalar the kernel divides the gradients by (None: 1).
    Not what ``Optimizer.step`` adds around the update: no profiler label, no check against being
    captured in a CUDA graph (the host step counters would freeze there: never capture it), no
    complex parameters. Needs torch ≥ 2.7 (``adam``'s ``decoupled_weight_decay``).
    """

    def __init__(self, param_groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 fused: bool = False, foreach: bool = False) -> None:
        self.param_groups = [dict(g, lr=lr) for g in param_groups]
        self.betas, self.eps = betas, eps
        self.defaults = {"fused": fused, "foreach": foreach}
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)  # as torch.optim's
        self.grad_scale: torch.Tensor | None = None

    def _state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            fused = self.defaults["fused"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self) -> None:
        from torch.optim.adam import adam

        fused = self.defaults["fused"]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state_of(p) for p in params]
            adam(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                 [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                 foreach=None if fused else self.defaults["foreach"], fused=fused or None,
                 grad_scale=self.grad_scale if fused else None, found_inf=None, has_complex=False,
                 decoupled_weight_decay=True, amsgrad=False, beta1=self.betas[0], beta2=self.betas[1],
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=self.eps, maximize=False)


def _state_dtype(name: str) -> torch.dtype:
    if name not in STATE_DTYPES:
        raise ValueError(f"train.optimizer_state_dtype={name!r} is not allowed; choose one of {', '.join(STATE_DTYPES)}")
    return STATE_DTYPES[name]


def _master(p: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``p`` with its ``expert_shard`` mark; of an expert weight with clone
    slots, of its native slots only."""
    shard = expert_shard(p)
    native = p.detach() if shard is None else p.detach()[: len(shard.native_experts)]
    m = torch.empty_like(native, dtype=torch.float32, requires_grad=False).copy_(native)
    if shard is not None:
        m.expert_shard = shard
    return m


def _like(t: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``t`` (a compute parameter or its gradient) where its master mirrors it: the native slots
    of an expert weight with clone slots (a contiguous view), else ``t`` itself."""
    if t.shape == master.shape:
        return t
    if t.shape[1:] != master.shape[1:] or t.shape[0] < master.shape[0]:
        raise ValueError(f"a tensor of shape {tuple(t.shape)} does not hold the slots of a master {tuple(master.shape)}")
    return t[: master.shape[0]]
