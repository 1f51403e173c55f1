"""Engine: one rank's training state and step — model shard, optimizer, data, gradient sync.

Usable inside an EPWorker (a Ray actor, over a real transport) or directly in one process
(W = 1 with :class:`ray_moe.comm.local.LocalTransport`): the single-process reference that
expert-parallel training is compared with.

Loss scaling: each rank's loss is the mean over its tokens and the global loss is the mean of
the ranks' losses, so the gradient is the sum over ranks divided by W: replicated gradients are
summed (all-reduced, or reduce-scattered during backward at ``parallel.zero_stage`` 1 or 2), an expert's is already
summed over every rank's tokens by combine's backward, and the 1/W rides on the update's gradient
scale (no pass of its own).

Precision: parameters in ``model.dtype``; float32 master weights, gradients and AdamW state in
:class:`~ray_moe.worker.optim.MixedPrecisionAdamW`, which is where the gradients are reduced
across ranks (in float32) and where checkpoints read and write weights.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ray_moe import checkpoint
from ray_moe.arch import ArchSpec, ResolvedArch
from ray_moe.comm.base import BufferSpec, Transport
from ray_moe.config import DTYPES, Config, element_size
from ray_moe.device import synchronize
from ray_moe.mesh import MeshSpec
from ray_moe.model.build import build_model
from ray_moe.model.interface import LanguageModel
from ray_moe.model.loss import lm_loss, resolve_loss_impl
from ray_moe.model.moe import pop_loads
from ray_moe.model.state import persistent_buffers
from ray_moe.placement.clones import push_clone_weights
from ray_moe.placement.placement import Placement, expert_shard
from ray_moe.topology import RankInfo
from ray_moe.worker.clone_grads import CloneGradReduction
from ray_moe.worker.mesh_groups import MeshGroups
from ray_moe.worker.data import open_corpus
from ray_moe.worker.optim import STATE_DTYPES, MixedPrecisionAdamW, no_weight_decay
from ray_moe.worker.overlap import UpdateOverlap
from ray_moe.worker.replica_grads import ReplicaGradReduction
from ray_moe.worker.step_clock import StepClock
from ray_moe.worker.zero import ShardedReplicatedState


def buffer_spec(config: Config, world_size: int, spec: ArchSpec) -> BufferSpec:
    """What the transport must hold for training with ``config`` on ``world_size`` ranks: each
    rank passes ``ceil(train.batch_size / W) * model.seq_len`` token rows of the resolved
    architecture ``spec``'s hidden size H, each routed to at most its top-k K experts."""
    m = config.model
    return BufferSpec(
        max_tokens=max(1, -(-config.train.batch_size // world_size)) * m.seq_len,
        hidden=spec.hidden_size,
        elem_bytes=element_size(m.dtype),
        max_top_k=spec.top_k,
    )


@dataclass(frozen=True)
class ModelReport:
    """What a worker tells the driver about the model it built (the driver recomputes none of it).

    moe_layers: block indices of the MoE layers; native_placement: ``Placement.to_dict()`` of a
    layer's starting placement (the same for every layer); expert_bytes: bytes of one expert's
    weights (what a clone copies).
    """

    rank: int
    device: str
    transport: str
    moe_layers: tuple[int, ...]
    num_experts: int
    native_placement: dict
    expert_bytes: int
    replicated_params: int
    expert_params_local: int
    corpus_train_bytes: int
    corpus_files: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _no_mark(phase: str) -> None:
    """The default phase marker of :meth:`Engine.train_step`: nothing."""


class Engine:
    """One rank's training state; ``arch``: the architecture the driver resolved
    (:meth:`~ray_moe.config.Config.resolve_arch`), built here without re-resolving; ``mesh``: the
    rank mesh the driver resolved (default: expert parallelism over the whole world), whose EP
    group is the transport's peers.

    The rank mesh (:mod:`ray_moe.mesh`): the data and the replicated parameters' reduction span
    the world; the experts and the transport the EP group; an expert's gradient is summed over
    its EP group by combine's backward and over its DP replicas here
    (:class:`~ray_moe.worker.replica_grads.ReplicaGradReduction`, or ZeRO over the DP group at
    ``parallel.zero_stage`` >= 1), so every rank's gradient is the world's sum, as at DP 1."""

    model: LanguageModel

    def __init__(self, config: Config, rank_info: RankInfo, transport: Transport, device: torch.device,
                 arch: ResolvedArch, mesh: MeshSpec | None = None):
        self.config, self.rank_info, self.transport, self.device = config, rank_info, transport, device
        self.rank, self.world_size = rank_info.rank, rank_info.world_size
        self.mesh = mesh or MeshSpec.whole(self.world_size)
        self.dp_rank, self.ep_rank = self.mesh.coords(self.rank)
        if (transport.world_size, transport.rank) != (self.mesh.ep, self.ep_rank):
            raise ValueError(f"rank {self.rank} is EP rank {self.ep_rank} of {self.mesh.ep} ({self.mesh}) but its "
                             f"transport is rank {transport.rank} of {transport.world_size}")
        self.distributed = self.world_size > 1 and dist.is_initialized()
        self.corpus = open_corpus(config, arch.spec.vocab_size)  # byte corpus, or memory-mapped token datasets
        transport.reserve(buffer_spec(config, self.world_size, arch.spec))
        self.model = build_model(config, arch, transport, device)  # with model.init_from's weights
        self.sharded = [p for p in self.model.parameters() if expert_shard(p) is not None]
        self.replicated = [p for p in self.model.parameters() if expert_shard(p) is None]
        t = config.train
        self.loss_impl = resolve_loss_impl(t.loss_impl, device)  # may refuse: before the ZeRO group exists
        # the replicated parameters' state sharded over the ranks (parallel.zero_stage 1, 2)
        self.zero = self._sharded_replicated_state() if config.parallel.zero_stage else None
        self.clone_grads = None
        self.replica_grads: ReplicaGradReduction | None = None
        self.zero_experts: ShardedReplicatedState | None = None
        # this engine's EP group (clone rows) and DP group (the replicas' expert gradients)
        self.groups = MeshGroups.create(self.mesh, self.rank) if self.distributed else None
        try:
            rounded = config.parallel.grad_reduce_dtype != "float32"
            has_clones = any(layer.placement.clone_slots for layer in self.model.moe_layers())
            if self.mesh.dp > 1:  # the replicas' expert gradients: ZeRO over DP, or all-reduced in buckets
                if config.parallel.zero_stage:  # (with clones the buckets wait for the clones' sums)
                    self.zero_experts = self._sharded_expert_state(hold=has_clones)
                else:
                    self.replica_grads = ReplicaGradReduction(self.model.moe_layers(), self.groups.dp,
                                                              DTYPES[config.parallel.grad_reduce_dtype])
            # hot-expert clones' gradients leave for their owners while backward runs (with DP
            # replicas: after the replicas' sums, or, under ZeRO, inside the held buckets before
            # their reduce-scatter; in sync_grads)
            if has_clones:
                group = self.groups.ep if self.groups else None
                self.clone_grads = CloneGradReduction(
                    self.model.moe_layers(), group, rounded, in_backward=self.mesh.dp == 1,
                    source=self.zero_experts.gradient if self.zero_experts else None)
            excluded = (self.zero.names if self.zero else frozenset()) | (
                self.zero_experts.names if self.zero_experts else frozenset())
            self.optimizer = MixedPrecisionAdamW(
                self.model, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay,
                impl=t.optimizer_impl, master_weights=t.master_weights, state_dtype=t.optimizer_state_dtype,
                exclude=frozenset(excluded), alone=not self.distributed,
                rounded_clone_sums=rounded,
            )
        except BaseException:  # a half-built engine is never closed by anyone else
            self.close()
            raise
        # gradients are reduced as sums; the mean's 1/W is folded into the update's gradient scale
        self.grad_divisor = self.world_size if self.distributed else 1
        self.transport.timer.enabled = True  # communication time in the step breakdown
        # train.overlap_update: the update beside the next forward (CUDA; in place elsewhere)
        self.overlap = self._update_overlap() if t.overlap_update and device.type == "cuda" else None
        self.step = 0  # steps taken (skipped ones included) == the data position
        self.opt_steps = 0  # optimizer updates applied (Adam's bias-correction counter)
        self.skipped = 0

    def _sharded_replicated_state(self) -> ShardedReplicatedState | None:
        """ZeRO stage 1 or 2 for the replicated parameters (None on one rank), reducing on a
        process group of its own (made by every rank, in the same order)."""
        if not self.distributed:
            return None
        t = self.config.train
        names = {id(p): n for n, p in self.model.named_parameters()}
        return ShardedReplicatedState(
            [(names[id(p)], p) for p in self.replicated], no_weight_decay(self.model),
            group=dist.new_group(list(range(self.world_size))), weight_decay=t.weight_decay,
            betas=(t.beta1, t.beta2), eps=t.eps, state_dtype=STATE_DTYPES[t.optimizer_state_dtype],
            bucket_size=self.config.parallel.grad_bucket_size, shard_grads=self.config.parallel.zero_stage >= 2,
            grad_dtype=DTYPES[self.config.parallel.grad_reduce_dtype])

    def _sharded_expert_state(self, hold: bool) -> ShardedReplicatedState:
        """ZeRO stage 1 or 2 for the expert parameters over this rank's DP replicas: their float32
        masters and moments split over the replicas, gradients reduce-scattered in buckets while
        backward runs, bf16 weights all-gathered after the update (the replicated parameters'
        machinery on the DP group). ``hold`` (hot-expert clones): the buckets are reduce-scattered
        after backward, once the clone slots' gradients are on their owners' native slots; every
        slot has a master and moments (a clone's are never read: its gradient is zeroed and its
        weights are pushed from the owner after the all-gather)."""
        t = self.config.train
        names = {id(p): n for n, p in self.model.named_parameters()}
        return ShardedReplicatedState(
            [(names[id(p)], p) for p in self.sharded], no_weight_decay(self.model),
            group=self.groups.dp, weight_decay=t.weight_decay,
            betas=(t.beta1, t.beta2), eps=t.eps, state_dtype=STATE_DTYPES[t.optimizer_state_dtype],
            bucket_size=self.config.parallel.grad_bucket_size, shard_grads=self.config.parallel.zero_stage >= 2,
            grad_dtype=DTYPES[self.config.parallel.grad_reduce_dtype], hold=hold)

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's EP group (clone rows move on it; None on one rank)."""
        return self.groups.ep if self.groups else None

    def _update_overlap(self) -> UpdateOverlap:
        """The side stream and block events of ``train.overlap_update`` over the one-pass
        parameters, and with ``parallel.overlap_param_gather`` ZeRO's sharded ones too; blocks
        with clone slots whose expert weights are not updated one by one wait for the whole update
        (their clones are refreshed after it; the others' right after their own, :meth:`_update`)."""
        named = self.optimizer.one_pass_named()
        if self.zero_beside:
            by_id = {id(p): n for n, p in self.model.named_parameters()}
            sharded = [self.zero] + ([self.zero_experts] if self.zero_experts else [])
            named = [(by_id[id(p)], p) for z in sharded for b in z.buckets for p in b.params] + named
        one_by_one = {id(p) for _, p in named}
        late = {1 + layer.layer_idx for layer in self.model.moe_layers()
                if layer.placement.clone_slots and not {id(p) for p in layer.expert_params()} <= one_by_one}
        return UpdateOverlap(self.model, [n for n, _ in named], [p for _, p in named], self.device, late)

    @property
    def zero_beside(self) -> bool:
        """Whether ZeRO's update and all-gathers run on the overlapped update's side stream
        (``parallel.overlap_param_gather`` on CUDA with sharded replicated state; the experts'
        state sharded over the DP replicas too, where there is one)."""
        return (self.zero is not None and self.config.parallel.overlap_param_gather
                and self.config.train.overlap_update and self.device.type == "cuda")

    def settle(self) -> None:
        """Let the current stream wait for a pending overlapped update (before anything reads the
        parameters or the optimizer state outside a training step's forward)."""
        if self.overlap is not None:
            self.overlap.wait_all()

    def describe(self) -> ModelReport:
        layers = self.model.moe_layers()
        first = layers[0] if layers else None
        return ModelReport(
            rank=self.rank, device=str(self.device), transport=self.transport.name,
            moe_layers=tuple(layer.layer_idx for layer in layers),
            num_experts=first.num_experts if first else 0,
            native_placement=(Placement.native(first.num_experts, self.mesh.ep, first.placement.clone_slots)
                              .to_dict() if first else {}),
            expert_bytes=(first.w13[0].numel() * first.w13.element_size()
                          + first.w2[0].numel() * first.w2.element_size()) if first else 0,
            replicated_params=sum(p.numel() for p in self.replicated),
            expert_params_local=sum(p.numel() for p in self.sharded),
            corpus_train_bytes=self.corpus.train_tokens, corpus_files=self.corpus.files,
        )

    # ------------------------------------------------------------------ helpers
    def lr_at(self, step: int) -> float:
        t = self.config.train
        if t.warmup_steps and step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def batch(self, split: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, m = self.config.train, self.config.model
        x, y = self.corpus.batch(split, t.seed, step, t.batch_size, m.seq_len, self.rank, self.world_size)
        V = self.model.spec.vocab_size
        if int(x.max()) >= V:  # host tensors: no device sync
            raise ValueError(
                f"the corpus has byte values up to {int(x.max())} but model.vocab_size={V}; "
                "byte-level data needs vocab_size 256"
            )
        return x.to(self.device), y.to(self.device)

    def loss(self, x: torch.Tensor, y: torch.Tensor,
             mark: Callable[[str], None] = _no_mark) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: int64 [B, L] inputs and next-token targets → (mean cross-entropy, aux loss);
        ``mark``: called after the decoder ("forward") and after the LM head + loss."""
        if self.overlap is not None:  # the embeddings' update; each block waits for its own
            self.overlap.wait_group(0)
        h, aux = self.model.hidden_states(x)
        mark("forward")
        ce = lm_loss(h.reshape(-1, h.shape[-1]), self.model.lm_head.weight, y.reshape(-1),
                     impl=self.loss_impl, chunk=self.config.train.loss_chunk)
        mark("lm head + loss")
        return ce, aux

    # ------------------------------------------------------------------ training
    def train_step(self, poison: bool = False, mark: Callable[[str], None] = _no_mark) -> dict[str, Any]:
        """One optimizer step on this rank's slice of global batch ``self.step``.

        ``poison`` injects a NaN into this rank's activations (to test the non-finite policy).
        ``mark(phase)`` is called at the phase boundaries ("start", "forward", "lm head + loss",
        "backward", "grad sync", "optimizer"; ``ray-moe bench train`` records CUDA events there).
        """
        self.model.train()
        self.transport.timer.pop()  # drop anything timed outside a training step
        t0 = time.perf_counter()
        clock = StepClock(self.device)  # phase times read after the step's last wait: no sync between phases
        x, y = self.batch("train", self.step)
        mark("start")
        clock.mark("start")
        ce, aux = self.loss(x, y, mark)
        if poison:
            ce = ce + float("nan")
        loss = ce + aux
        clock.mark("forward")
        self.optimizer.zero_grad()
        if self.zero:
            self.zero.begin()  # replicated gradients reduce-scattered as backward produces them
        if self.zero_experts:
            self.zero_experts.begin()  # expert gradients reduce-scattered over the replicas
        if self.replica_grads:
            self.replica_grads.begin()  # expert gradients all-reduced over the replicas
        if self.clone_grads:
            self.clone_grads.begin()  # clones' gradients sent to their owners as backward produces them
        loss.backward()
        mark("backward")
        clock.mark("backward")
        grad_norm, loss_finite = self.sync_grads(ce.detach(), clock)
        mark("grad sync")
        clock.mark("grad sync")  # the norm and the loss check were read on the host: the device is idle
        finite = math.isfinite(grad_norm) and loss_finite
        lr = self.lr_at(self.step)
        skipped = False
        if finite:
            clip = self.config.train.grad_clip
            scale = (clip / (grad_norm + 1e-6) if clip > 0 and grad_norm > clip else 1.0) / self.grad_divisor
            beside = self.zero_beside
            if self.overlap is not None:  # on a side stream; the next forward waits block by block
                self.overlap.launch(lambda done: self._update(lr, scale, done, zero=beside),
                                    self.optimizer.pending_grads())
            else:
                self._update(lr, scale)
            if self.zero and not beside:
                self.zero.step(lr, scale)
            self.opt_steps += 1
            self.update_routing_bias()
        else:  # weights and optimizer state untouched
            skipped = True
            self.skipped += 1
            self.optimizer.drop_grads()
        self.step += 1
        mark("optimizer")
        clock.mark("optimizer")
        if self.overlap is not None:  # this stream only: the update stays in flight
            torch.cuda.current_stream(self.device).synchronize()
        else:
            synchronize(self.device)
        self.transport.check()  # device-side timeouts become an error naming the cause
        t1 = time.perf_counter()
        return {
            "rank": self.rank, "step": self.step, "loss": ce.item(), "aux_loss": float(aux.detach()),
            "tokens": x.numel(), "grad_norm": grad_norm, "lr": lr, "skipped": skipped,
            "nonfinite": not finite, "load": self.expert_load(),
            "time": {"forward": clock.seconds("start", "forward"), "backward": clock.seconds("forward", "backward"),
                     "optimizer": clock.seconds("backward", "optimizer"),
                     "grad_sync": clock.seconds("backward", "grad sync"),
                     "grad_reduce": clock.seconds("reduce", "reduced") if self.distributed else 0.0,
                     "replica_reduce": clock.seconds("replicas", "replicas reduced") if self.mesh.dp > 1 else 0.0,
                     "update": clock.seconds("grad sync", "optimizer"),
                     "step": t1 - t0, "comm": self.transport.timer.pop()},
        }

    def _update(self, lr: float, scale: float, done: Callable[[torch.Tensor | None], None] | None = None,
                zero: bool = False) -> None:
        """The optimizer's update (``done``: :meth:`MixedPrecisionAdamW.step`'s) and the clone
        slots refreshed from their owners: each MoE layer's as soon as its expert weights are
        updated, before ``done`` hears of the last of them (so the block's event covers its clones), the rest
        after the update; ``zero``: ZeRO's sharded update and all-gathers first (in forward
        order: the embeddings' are what the next forward needs first).

        The experts' state sharded over the DP replicas is updated first: with ``zero`` beside
        the next forward (each layer's clones pushed on this stream once the all-gathers writing
        its expert weights are waited for here), else with every all-gather waited for before the
        clones are pushed (the all-gather writes the clone slots from their own, stale, masters)."""
        if zero:
            self.zero.step(lr, scale, done)
        left = {id(p): layer for layer in self.model.moe_layers() if layer.placement.clones()
                for p in layer.expert_params()}
        gathers: dict[int, list] = {}  # id(layer) -> the all-gathers writing its expert weights

        def pushing(param: torch.Tensor | None, *work) -> None:
            layer = left.pop(id(param), None)
            if layer is not None:
                gathers.setdefault(id(layer), []).extend(work)
                if not any(id(p) in left for p in layer.expert_params()):
                    for w in gathers.pop(id(layer)):
                        w.wait()  # (NCCL: this stream waits, not the host)
                    push_clone_weights(layer, layer.placement, self.ep_group)
            done(param, *work)

        if self.zero_experts is not None:
            self.zero_experts.step(lr, scale, pushing if zero else None)
        self.optimizer.step(lr, scale, pushing if done is not None else None)
        for layer in self.model.moe_layers():  # those whose expert weights were not reported one by one
            if any(id(p) in left for p in layer.expert_params()):
                push_clone_weights(layer, layer.placement, self.ep_group)

    def close(self) -> None:
        """Release what outlives the engine's memory: the ZeRO state's and the clone reduction's
        gradient hooks and their process groups (a new engine on the same ranks makes its own; without this every engine
        built on a group, e.g. one per Trainer on a kept group, would leave a communicator
        behind). Every rank calls it (the group's destruction is local). Idempotent."""
        if getattr(self, "overlap", None) is not None:
            self.overlap.close()
            self.overlap = None
        if getattr(self, "clone_grads", None) is not None:
            self.clone_grads.close()  # (its process group is the mesh groups' EP group, destroyed below)
            self.clone_grads = None
        if self.zero is not None:
            self.zero.close()
            if self.distributed and dist.is_initialized():
                dist.destroy_process_group(self.zero.group)
            self.zero = None
        for name in ("replica_grads", "zero_experts"):
            if getattr(self, name, None) is not None:
                getattr(self, name).close()
                setattr(self, name, None)
        if getattr(self, "groups", None) is not None:
            self.groups.destroy()
            self.groups = None

    def counters(self) -> dict[str, int]:
        return {"step": self.step, "opt_steps": self.opt_steps, "skipped": self.skipped}

    def sync_grads(self, loss: torch.Tensor, clock: StepClock | None = None) -> tuple[float, bool]:
        """Reduce gradients across ranks into the optimizer's (float32) master gradients; return
        the global gradient norm (inf if non-finite) and whether every rank's ``loss`` (a scalar
        tensor on this rank's device) is finite. ``clock`` gets the marks "reduce" and "reduced"
        around the replicated gradients' reduction, i.e. its time exposed after backward (stage 0:
        all of it; stages 1 and 2: the wait for the buckets still in flight), on more than one
        rank. The loss check rides on the norm's all-reduce and host read: one of each per step.

        The gradients are left as sums over ranks (replicated ones summed here, or reduce-scattered
        during backward at ZeRO stage 1 or 2; an expert's already summed by combine's
        backward): the mean's 1/W is folded into the update's gradient scale and into the norm."""
        opt = self.optimizer
        clones = self.clone_grads
        replicas = self.replica_grads

        def timed(fn: Callable[[], Any]) -> Any:  # the replicas' reduction exposed after backward
            if clock is not None:
                clock.mark("replicas")
            out = fn()
            if clock is not None:
                clock.mark("replicas reduced")
            return out

        experts = self.zero_experts
        if replicas and clones:  # the replicas' sums first (clone slots too), then to the owners
            timed(lambda: replicas.finish(lambda p: p.grad))
        if clones and not experts:
            clones.launch_rest()  # the layers backward did not launch (DP replicas)
            if clones.rounded:  # the clone sums into the bf16 gradients
                clones.add_received(lambda p: p.grad)
        opt.gather_grads()
        if replicas and not clones:  # into the gradients the update reads (float32 masters: exact)
            timed(lambda: replicas.finish(opt.grad))
        if clones and not clones.rounded and not experts:  # into the float32 master gradients
            clones.add_received(opt.grad)
        if experts:  # this rank's chunks of the replicas' sums (Σ over all ranks: the norm's part)
            def to_owners() -> None:  # clones' gradients onto their owners' slots in the held buckets
                clones.launch_rest()
                clones.add_received(experts.gradient)

            local = timed(lambda: experts.finish(to_owners if clones else None))
        elif self.dp_rank == 0:  # the experts' gradients, once per EP group's worth (the replicas' are equal)
            local = _sum_of_squares([opt.grad(p) for p in self.sharded], self.device)
        else:
            local = torch.zeros((), dtype=torch.float32, device=self.device)
        replicated = []
        if clock is not None and self.distributed:
            clock.mark("reduce")
        if self.zero:
            local = local + self.zero.finish()  # this rank's chunks of the reduced replicated grads
        else:
            replicated = [opt.grad(p) for p in self.replicated]
            if self.distributed:
                flat = torch.cat([g.reshape(-1).to(DTYPES[self.config.parallel.grad_reduce_dtype])
                                  for g in replicated])
                dist.all_reduce(flat)
                offset = 0
                for g in replicated:
                    n = g.numel()
                    g.copy_(flat[offset: offset + n].view_as(g))
                    offset += n
        if clock is not None and self.distributed:
            clock.mark("reduced")
        # [Σ grad² of what ranks hold apart, ranks whose loss is not finite]: one all-reduce
        reduced = torch.stack([local, (~torch.isfinite(loss.float())).float().to(self.device)])
        if self.distributed:
            dist.all_reduce(reduced)
        reduced[0] += _sum_of_squares(replicated, self.device)
        total, bad_losses = reduced.tolist()
        total /= self.grad_divisor ** 2
        return (math.sqrt(total) if math.isfinite(total) else math.inf), bad_losses == 0

    def update_routing_bias(self) -> None:
        """Aux-loss-free balancing (sigmoid routers with a balancing bias): one bias step per MoE
        layer from the step's *global* tokens per expert (one all-reduce for all layers), so every
        rank's bias stays the same. No-op for other routers or ``moe.bias_update_rate: 0``."""
        rate = self.config.moe.bias_update_rate
        layers = [layer for layer in self.model.moe_layers() if layer.score_bias is not None]
        if not layers or rate <= 0:
            return
        tokens = torch.stack([layer.expert_tokens for layer in layers])
        if self.distributed:
            dist.all_reduce(tokens)
        for layer, t in zip(layers, tokens):
            layer.update_score_bias(t, rate)

    def push_clones(self) -> int:
        return sum(push_clone_weights(layer, layer.placement, self.ep_group) for layer in self.model.moe_layers())

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, temperature: float, seed: int) -> list[int]:
        """Continue ``prompt`` (token ids) by ``max_new_tokens`` tokens; returns the new ids.

        Collective: every rank runs the same context through the model (the MoE layers need all
        ranks); rank 0 samples (greedy at ``temperature`` <= 0, else from softmax(logits / T) with a
        generator seeded by ``seed``) and broadcasts the token. The context is the last
        ``model.seq_len`` tokens: the prompt's forward fills a KV cache, then each new token is
        one position's forward over it; once the context is longer than ``model.seq_len``, each
        token re-reads the last ``model.seq_len`` (the positions move). Load statistics of these
        forwards are dropped."""
        if not prompt:
            raise ValueError("generate needs a prompt of at least one token")
        V = self.model.lm_head.weight.shape[0]
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"prompt token ids must be in [0, {V}), got min {min(prompt)}, max {max(prompt)}")
        self.settle()
        self.model.eval()
        gen = torch.Generator().manual_seed(seed)
        ids = list(prompt)
        L = self.config.model.seq_len
        cache = None
        for _ in range(max_new_tokens):
            if cache is not None and cache.length < L:  # one new position over the cache
                ctx = ids[-1:]
            elif len(ids) <= L:  # the prompt fills a new cache
                cache, ctx = self.model.new_cache(L), ids
            else:  # the window has moved past seq_len: the positions shift, no cache is reusable
                cache, ctx = None, ids[-L:]
            h, _ = self.model.hidden_states(torch.tensor([ctx], dtype=torch.int64, device=self.device), cache)
            logits = (h[0, -1] @ self.model.lm_head.weight.t()).float().cpu()
            if temperature <= 0:
                token = logits.argmax().view(1)
            else:
                token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen)
            if self.distributed:
                token = token.to(self.device)
                dist.broadcast(token, 0)
            ids.append(int(token))
        pop_loads(self.model.moe_layers())
        return ids[len(prompt):]

    @torch.no_grad()
    def eval_sum(self, start: int, stop: int, running: float = 0.0) -> float:
        """This rank's float64 sum of the mean cross-entropy of validation batches [start, stop),
        added in batch order onto ``running`` (its sum over batches [0, start)): calls over
        consecutive ranges give the bits of one call over their union (a float64 passes through
        a Python float exactly). Collective: every rank calls it with the same range."""
        self.settle()
        self.model.eval()
        total = torch.tensor(running, dtype=torch.float64)
        for i in range(start, stop):
            x, y = self.batch("val", i)
            ce, _ = self.loss(x, y)
            total += ce.double().cpu()
        pop_loads(self.model.moe_layers())  # evaluation does not count towards expert-load statistics
        return float(total)

    def eval_mean(self, total: float, batches: int) -> float:
        """The validation loss from each rank's :meth:`eval_sum` ``total`` over ``batches``
        batches: the mean over ranks and batches (collective; the same value on every rank)."""
        summed = torch.tensor(total, dtype=torch.float64)
        if self.distributed:
            summed = summed.to(self.device)
            dist.all_reduce(summed)
            summed = summed.cpu() / self.world_size
        return float(summed) / batches

    def expert_load(self) -> dict[str, Any]:
        """Tokens routed from this rank to each logical expert, per MoE layer, since the last call."""
        tokens, pairs = pop_loads(self.model.moe_layers())
        return {"rank": self.rank, "expert_tokens": tokens.tolist(), "received_pairs": pairs.tolist()}

    # ------------------------------------------------------------------ placement
    def set_placements(self, placements: list[dict | None]) -> int:
        """New placements per MoE layer (None keeps a layer's); fills clone slots from the owners.

        Returns the bytes of clone weights this rank received.
        """
        self.settle()
        layers = self.model.moe_layers()
        if len(placements) != len(layers):
            raise ValueError(f"got {len(placements)} placements for {len(layers)} MoE layers")
        for layer, p in zip(layers, placements):
            if p is not None:
                layer.set_placement(Placement.from_dict(p))
        return self.push_clones()

    def placements(self) -> list[dict]:
        """The current placement of every MoE layer (``Placement.to_dict()``), for checkpoints."""
        return [layer.placement.to_dict() for layer in self.model.moe_layers()]

    # ------------------------------------------------------------------ checkpoints
    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's part of a checkpoint (schema: :mod:`ray_moe.checkpoint`): the float32 master
        weights under the parameters' names, their AdamW state, and the persistent buffers."""
        self.settle()
        named, state = self.optimizer.named_masters(), dict(self.optimizer.state)
        if self.zero:  # the replicated masters and moments, whole on rank 0 (a collective)
            for name, whole in self.zero.gather_state().items():
                named.append((name, whole["master"]))
                state[whole["master"]] = whole
        if self.zero_experts:  # the experts' masters and moments, whole on DP rank 0 (a collective)
            marks = {n: expert_shard(p) for n, p in self.model.named_parameters()}
            for name, whole in self.zero_experts.gather_state().items():
                native = len(marks[name].native_experts)  # (clone slots' state is never read)
                whole = {k: v[:native] for k, v in whole.items()}
                whole["master"].expert_shard = marks[name]
                named.append((name, whole["master"]))
                state[whole["master"]] = whole
        if self.dp_rank:  # whole experts once: the first replica writes them
            named = [(n, p) for n, p in named if expert_shard(p) is None]
        return checkpoint.shard_state(named, state, self.rank, self.device,
                                      named_buffers=persistent_buffers(self.model))

    def load_state(self, tensors: dict[str, torch.Tensor], step: int, opt_steps: int) -> None:
        """Load a full checkpoint (all ranks' tensors merged) into this rank's shard; every layer
        goes back to its native placement (checkpoints hold native experts only). Fills the master
        weights (a checkpoint of compute-dtype weights is upcast) and refreshes the parameters."""
        self.settle()
        for layer in self.model.moe_layers():
            layer.set_placement(Placement.native(layer.num_experts, self.mesh.ep, layer.placement.clone_slots))
        named = self.optimizer.named_masters()
        whole: dict[str, torch.Tensor] = {}
        experts: dict[str, torch.Tensor] = {}
        names = {id(p): n for n, p in self.model.named_parameters()}
        if self.zero:  # whole float32 host tensors, checked by the same code; this rank keeps its chunks
            whole = {names[id(p)]: torch.empty(p.shape, dtype=torch.float32) for p in self.replicated}
            named = named + list(whole.items())
        if self.zero_experts:  # this EP rank's native experts, whole, marked as the parameters are
            for p in self.sharded:
                native = len(expert_shard(p).native_experts)
                experts[names[id(p)]] = torch.zeros((native, *p.shape[1:]), dtype=torch.float32)
                experts[names[id(p)]].expert_shard = expert_shard(p)
            named = named + list(experts.items())
        state = self.optimizer.state
        checkpoint.load_shard_state(named, state, tensors, opt_steps, self.rank, self.device,
                                    named_buffers=persistent_buffers(self.model))
        if self.zero:
            self.zero.load(whole, {n: state.pop(w) for n, w in whole.items() if w in state}, opt_steps)
        if self.zero_experts:  # clone slots' masters and moments zero (their weights: pushed below)
            moments = {n: {k: _slots(v, p) for k, v in state.pop(w).items() if k != "step"}
                       for (n, w), p in zip(experts.items(), self.sharded, strict=True) if w in state}
            self.zero_experts.load({n: _slots(w, p) for (n, w), p in zip(experts.items(), self.sharded, strict=True)},
                                   moments, opt_steps)
        self.optimizer.loaded()
        self.step, self.opt_steps = step, opt_steps
        self.push_clones()


def _slots(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` (a native-slot expert tensor [native, ...]) with zero rows for ``p``'s clone slots."""
    if t.shape[0] == p.shape[0]:
        return t
    return torch.cat([t, t.new_zeros((p.shape[0] - t.shape[0], *t.shape[1:]))])


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ‖t‖² over ``tensors`` as a float32 scalar on ``device`` (one foreach norm; 0 for none)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()
