"""Sharded replicated state: ZeRO stage 1 (Megatron's distributed optimizer) and 2 for the replicated parameters.

Expert weights are already sharded (expert parallelism); everything else (attention, embeddings,
LM head, norms, routers, shared experts) is replicated, and without this class every rank holds
its float32 master and both AdamW moments whole: 12 bytes per replicated parameter on every rank.
Here they are split over the W ranks:

- **Buckets.** The replicated parameters, in reverse registration order (about the order backward
  produces their gradients), fill buckets of ``bucket_size`` elements, one dtype per bucket. A
  bucket's gradient buffer (float32, or ``grad_dtype``) is padded to a multiple of W; rank r owns the r-th of its W
  equal chunks, for which it keeps the float32 master and the moments (``state_dtype``): 12/W
  (bf16 moments: 8/W) bytes per replicated parameter instead of 12. Stage 1 keeps the gradient
  buffers (made once: no fresh flat buffer per step; 4 bytes per replicated parameter, 2 in bf16); stage 2
  (``shard_grads``) takes a bucket's buffer from the allocator when its first gradient arrives
  and lets it go once the bucket is reduced: a third bucket's launch waits for the oldest one in
  flight (on NCCL the wait orders the compute stream after it, the host does not block), so only
  the reduced chunks (4/W bytes, 2/W in bf16) and two buckets stay.
- **Overlap.** A ``post_accumulate_grad`` hook copies each gradient into its bucket as
  backward produces it and frees the compute-dtype gradient; a bucket whose gradients are all in
  is reduce-scattered at once (``async_op``: on NCCL the collective runs on the process group's
  own stream, beside backward's kernels), buckets strictly in index order on every rank (DDP's
  rule: the collectives match across ranks whatever order the hooks fire in). The reduction runs
  on a process group of its own, so it never interleaves with the expert-parallel transport's
  collectives in backward. :meth:`finish` zero-fills what backward did not reach, launches the
  rest and waits.
- **Reduction dtype.** ``grad_dtype`` float32 (the default, as torchtitan's FSDP reduces) or
  bfloat16 (Megatron's default): the bucket buffers and the reduce-scatter in that dtype, half the
  bytes over the wire and in the buffers; the update and the norm read the reduced bf16 chunk as
  it is (no widening pass: ~1 ms after backward at W=2 for Qwen3-30B-A3B's two 311 M-element
  tables).
- **Update.** Each rank updates its chunks with the one-pass AdamW
  (:func:`ray_moe.worker.adamw_kernel.adamw_step`; at most two launches per bucket: within a
  bucket the decayed parameters come first), the reduced *sums* scaled by ``grad_scale``
  (clipping and the 1/W of the mean folded in), writes the rounded chunk and all-gathers it in the
  parameters' dtype into the parameters themselves (below).
- **Parameters in bucket buffers.** As Megatron's param-and-grad buffers: each bucket's parameters
  are views into one contiguous buffer (``pbuf``, [W * chunk] in their dtype, bucket order), so
  the all-gather writes them in place, no copy. Buckets go in forward order (the embeddings'
  first), each all-gather beside the next bucket's update, and ``done(param, work)`` hands each
  parameter's collective to :class:`~ray_moe.worker.overlap.UpdateOverlap`, which runs the update
  on a side stream beside the next forward (``parallel.overlap_param_gather``, Megatron's
  ``--overlap-param-gather``): each block's forward waits for its own buckets' all-gathers only.

Why hand-written: FSDP2's ``fully_shard`` shards the parameters themselves (ZeRO-3: an all-gather
in every forward and backward) and owns their mixed precision, where ray_moe keeps its own float32
masters; DDP's reducer all-reduces (every rank then holds the whole gradient and the whole state)
and needs the model's ``forward`` to run through its wrapper, while the engine calls
``hidden_states`` and the loss. The pieces used are torch's: ``register_post_accumulate_grad_hook``,
``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (``*_single`` where torch has them; gloo and NCCL).

Checkpoints keep their schema (whole replicated tensors from rank 0): :meth:`gather_state` brings
the chunks together (a collective, bucket by bucket) and :meth:`load` takes a rank's chunks from
whole tensors, so a checkpoint moves between world sizes and between sharded and unsharded runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 names these *_single and warns at every call of the old names; an older torch (the
# GPU image's 2.11) may have only the old ones. Same arguments either way.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

ALIGN = 64  # elements: every chunk starts on a 256-byte boundary (float32)


@dataclass
class _Bucket:
    """One bucket. ``flat`` [W * chunk] in the reduction dtype: the gradients (then the gathered
    parameters); ``grad`` [chunk] in the reduction dtype (this rank's reduced sums), ``master``
    float32 [chunk], ``exp_avg``/``exp_avg_sq`` [chunk] in the state dtype, ``send`` [chunk] in
    the parameters' dtype (the master for float32 parameters): this rank's; ``pbuf`` [W * chunk] in
    the parameters' dtype: the parameters' own storage (each is a view of it)."""

    params: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    decayed: int  # elements [0, decayed) decay, the rest does not
    chunk: int
    flat: torch.Tensor | None  # (None at stage 2 outside backward)
    grad: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    send: torch.Tensor
    pbuf: torch.Tensor
    got: list[bool] = field(default_factory=list)
    work: object = None

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o: o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets, strict=True)]


class ShardedReplicatedState:
    """The float32 masters and AdamW moments of the replicated parameters, sharded over a process
    group, with their gradients reduce-scattered while backward runs (see the module docstring).

    Args:
        named_params: (name, parameter) of the replicated parameters (any dtypes, contiguous).
        no_decay: names of those not to decay.
        group: the process group to reduce over (a group of its own: see the module docstring).
        weight_decay, betas, eps: AdamW's hyper-parameters.
        state_dtype: the moments' dtype (float32 or bfloat16).
        bucket_size: elements per bucket (a parameter larger than it gets a bucket of its own).
        shard_grads: ZeRO stage 2 (gradient buffers live only until their bucket is reduced).
        grad_dtype: the reduction's dtype (float32 or bfloat16).
        hold: the buckets wait for :meth:`finish` instead of launching during backward, so the
            caller can move gradients between them first (:meth:`gradient`; the rank mesh's
            hot-expert clones send theirs to their owners before the replicas' reduce-scatter).
            At stage 2 every bucket's buffer then lives until :meth:`finish`.

    One step: :meth:`begin` before backward, :meth:`finish` after it (returns Σ g² of this rank's
    reduced chunks), :meth:`step` when the step is not skipped.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], no_decay: Collection[str], *,
                 group: dist.ProcessGroup, weight_decay: float, betas: tuple[float, float], eps: float,
                 state_dtype: torch.dtype, bucket_size: int, shard_grads: bool = False,
                 grad_dtype: torch.dtype = torch.float32, hold: bool = False) -> None:
        self.group, self.hold = group, hold
        self.shard_grads, self.grad_dtype = shard_grads, grad_dtype
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.weight_decay, self.betas, self.eps, self.state_dtype = weight_decay, betas, eps, state_dtype
        self.steps = 0  # updates applied (the bias corrections' counter)
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}  # id(param) → (bucket, index in it)
        self._next = 0  # the next bucket to launch
        self._in_flight: list[_Bucket] = []  # stage 2: launched, not waited for
        self._armed = False
        open_: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, p in reversed(list(named_params)):
            members = open_.setdefault(p.dtype, [])
            members.append((name, p))
            if sum(q.numel() for _, q in members) >= bucket_size:
                self._close(open_.pop(p.dtype), no_decay)
        for members in open_.values():
            self._close(members, no_decay)
        self.names = frozenset(name for name, _ in named_params)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named_params]

    @torch.no_grad()
    def _close(self, members: list[tuple[str, torch.Tensor]], no_decay: Collection[str]) -> None:
        members = sorted(members, key=lambda m: m[0] in no_decay)  # decayed first (stable)
        sizes = [p.numel() for _, p in members]
        n, W = sum(sizes), self.world_size
        chunk = -(-n // (W * ALIGN)) * ALIGN
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        device, dtype = members[0][1].device, members[0][1].dtype
        pbuf = torch.zeros(W * chunk, dtype=dtype, device=device)  # the parameters move into it (views)
        for (_, p), o in zip(members, offsets, strict=True):
            pbuf[o: o + p.numel()].copy_(p.detach().reshape(-1))
            p.data = pbuf[o: o + p.numel()].view_as(p)
        master = pbuf[self.rank * chunk: (self.rank + 1) * chunk].to(torch.float32, copy=True)
        b = _Bucket(
            params=tuple(p for _, p in members), names=tuple(n for n, _ in members), offsets=tuple(offsets),
            decayed=sum(s for (name, _), s in zip(members, sizes, strict=True) if name not in no_decay),
            chunk=chunk, flat=None if self.shard_grads else torch.zeros(W * chunk, dtype=self.grad_dtype, device=device),
            grad=torch.zeros(chunk, dtype=self.grad_dtype, device=device), master=master,
            exp_avg=torch.zeros(chunk, dtype=self.state_dtype, device=device),
            exp_avg_sq=torch.zeros(chunk, dtype=self.state_dtype, device=device),
            send=master if dtype == torch.float32 else torch.empty(chunk, dtype=dtype, device=device),
            pbuf=pbuf, got=[False] * len(members))
        for i, p in enumerate(b.params):
            self._where[id(p)] = (b, i)
        self.buckets.append(b)

    # ------------------------------------------------------------------ gradients
    def begin(self) -> None:
        """Before backward: gradients from now on go into the buckets."""
        for b in self.buckets:
            b.got = [False] * len(b.params)
            b.work = None
        self._next = 0
        self._in_flight = []
        self._armed = True

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:  # a backward outside a training step: leave the gradient where it is
            return
        b, i = self._where[id(p)]
        o = b.offsets[i]
        self._buffer(b)[o: o + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None
        b.got[i] = True
        if not self.hold:
            self._launch_ready()

    def gradient(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient in its bucket (a view, ``p``'s shape, the reduction dtype), to read or
        change before the bucket is launched: with ``hold``, from backward's hook until
        :meth:`finish`'s ``before_launch`` returns."""
        b, i = self._where[id(p)]
        o = b.offsets[i]
        return self._buffer(b)[o: o + p.numel()].view_as(p)

    def _buffer(self, b: _Bucket) -> torch.Tensor:
        """The bucket's gradient buffer in the reduction dtype (stage 2: taken now, the padding zeroed)."""
        if b.flat is None:
            b.flat = torch.empty(b.chunk * self.world_size, dtype=self.grad_dtype, device=b.grad.device)
            n = b.offsets[-1] + b.params[-1].numel()
            b.flat[n:].zero_()
        return b.flat

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and all(self.buckets[self._next].got):
            b = self.buckets[self._next]
            b.work = _reduce_scatter(b.grad, self._buffer(b), group=self.group, async_op=True)
            if self.shard_grads:  # the collective holds the buffer until it is waited for
                b.flat = None
                self._in_flight.append(b)
                while len(self._in_flight) > 2:  # at most two buckets' buffers alive
                    done = self._in_flight.pop(0)
                    done.work.wait()
                    done.work = None
            self._next += 1

    @torch.no_grad()
    def finish(self, before_launch: Callable[[], None] | None = None) -> torch.Tensor:
        """After backward: zeros for the gradients backward did not produce, ``before_launch()``
        (which may change the gradients not yet launched through :meth:`gradient`), the remaining
        buckets launched, every reduction waited for. Returns Σ g² over this rank's chunks of the reduced
        (summed over ranks) gradients, a float32 scalar: the chunks partition the replicated
        gradients, so the sum of this over ranks is their squared norm."""
        for b in self.buckets:
            for i, got in enumerate(b.got):
                if not got:
                    o = b.offsets[i]
                    self._buffer(b)[o: o + b.params[i].numel()].zero_()
                    b.params[i].grad = None
                    b.got[i] = True
        if before_launch is not None:
            before_launch()
        self._launch_ready()
        self._armed = False
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        self._in_flight = []
        norms = torch._foreach_norm([b.grad for b in self.buckets], 2, dtype=torch.float32)
        return torch.stack(norms).square().sum()

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def step(self, lr: float, grad_scale: float, done: Callable[[torch.Tensor, object], None] | None = None) -> None:
        """AdamW on this rank's chunks with gradients × ``grad_scale``, then every parameter ←
        the all-gathered rounded masters (in place: the parameters live in the buckets' buffers);
        bucket by bucket in forward order, each bucket's all-gather beside the next one's update.

        ``done(param, work)``: called for each parameter once its bucket's all-gather is issued;
        the caller then makes whatever reads the parameter wait for ``work`` (``work.wait()`` on
        the reading stream: NCCL orders the stream, the host does not block). Without ``done``,
        the current stream waits for every all-gather before this returns."""
        self.steps += 1
        works = []
        for b in self.buckets[::-1]:  # built from the last parameter backward: reversed, the forward's order
            self._update_chunk(b, lr, grad_scale)
            work = _all_gather(b.pbuf, b.send, group=self.group, async_op=True)
            for p in b.params:  # written in place through the bucket (the FP8 weight cache keys on versions)
                torch.autograd.graph.increment_version(p)
            if done is None:
                works.append(work)
            else:
                for p in b.params:
                    done(p, work)
        for work in works:
            work.wait()

    def _update_chunk(self, b: _Bucket, lr: float, grad_scale: float) -> None:
        from ray_moe.worker.adamw_kernel import adamw_step

        b1, b2 = self.betas
        start = self.rank * b.chunk  # this chunk's place in the bucket
        cut = min(max(b.decayed - start, 0), b.chunk)  # [0, cut) decays
        for lo, hi, decay in ((0, cut, self.weight_decay), (cut, b.chunk, 0.0)):
            if hi > lo:
                adamw_step(b.grad[lo:hi], b.master[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi],
                           b.send[lo:hi], lr=lr, beta1=b1, beta2=b2, eps=self.eps, weight_decay=decay,
                           step=self.steps, grad_scale=grad_scale)

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def gather_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Collective. On rank 0: {name: {"master", "exp_avg", "exp_avg_sq"}} whole CPU tensors
        (the moments in the state dtype; none before the first update); elsewhere {}."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for b in self.buckets:
            for key in ("master", "exp_avg", "exp_avg_sq") if self.steps else ("master",):
                mine = getattr(b, key)
                whole = self._scratch(b, mine.dtype)
                _all_gather(whole, mine, group=self.group)
                if self.rank == 0:
                    for name, v in zip(b.names, b.views(whole), strict=True):
                        out.setdefault(name, {})[key] = v.cpu().clone()
        return out

    @torch.no_grad()
    def load(self, masters: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]],
             steps: int) -> None:
        """This rank's chunks from whole tensors (every rank gets all of them): ``masters`` {name:
        tensor} for every replicated parameter, ``moments`` {name: {exp_avg, exp_avg_sq}} (empty
        when ``steps`` is 0); the parameters are refreshed from the masters."""
        for b in self.buckets:
            mine = slice(self.rank * b.chunk, (self.rank + 1) * b.chunk)
            for key in ("master", "exp_avg", "exp_avg_sq"):
                if key != "master" and not steps:
                    getattr(b, key).zero_()
                    continue
                whole = self._scratch(b, torch.float32).zero_()
                for name, v in zip(b.names, b.views(whole), strict=True):
                    v.copy_(masters[name] if key == "master" else moments[name][key])
                getattr(b, key).copy_(whole[mine])
                if key == "master":
                    torch._foreach_copy_(list(b.params), b.views(whole))
        self.steps = steps

    def _scratch(self, b: _Bucket, dtype: torch.dtype) -> torch.Tensor:
        """A whole bucket's worth of ``dtype`` outside backward: the gradient buffer (stage 1;
        free between the reduction and the next backward), or a transient one (stage 2, or a
        buffer of narrower elements)."""
        n = b.chunk * self.world_size
        if b.flat is None or b.flat.element_size() < dtype.itemsize:
            return torch.empty(n, dtype=dtype, device=b.grad.device)
        return b.flat.view(dtype)[:n]

    def close(self) -> None:
        """Remove the gradient hooks (the parameters then keep their gradients again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
