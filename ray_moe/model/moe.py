"""The expert-parallel MoE layer: route → place → dispatch → experts → combine.

Every rank holds the router (replicated) and the weights of its expert *slots*: its E/W native
experts followed by ``clone_slots`` clones of other ranks' experts (see :mod:`ray_moe.placement`).
The world size comes from the transport (which the worker group built); the layer's native
placement is derived from it. The same code runs over every transport; the single-process
oracle is :func:`ray_moe.model.experts.reference_moe`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ray_moe.comm.base import Transport, combine, dispatch, dispatch_early
from ray_moe.chunks import chunk_weights
from ray_moe.comm.pipeline import pipelined_exchange
from ray_moe.comm.streams import current, made, run_on, used_on, wait
from ray_moe.model.expert_choice import ExpertChoice, ExpertImplChooser
from ray_moe.model.experts import EXPERT_GRIDS, EXPERT_PRECISIONS, EarlyRows, expert_ffn, fp8_weight_cache, resolve_impl
from ray_moe.model.recompute import checkpointed
from ray_moe.model.router import SOFTMAX, Routing, balancing_bias_step, load_balancing_loss, route
from ray_moe.model.wgrad import WgradDeferral
from ray_moe.placement.placement import ExpertShard, Placement


def expert_init(
    seed: int, layer: int, expert: int, d_model: int, hidden: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic float32 weights of one logical expert, independent of world size, drawn on
    ``device`` from the expert's own generator (on a GPU: the host would take minutes for E large
    experts; a CUDA generator draws other values than a CPU one, the same on every rank).

    Returns w13 [H, 2I] (gate|up) and w2 [I, H].
    """
    g = torch.Generator(device=device).manual_seed(_mix(seed, layer, expert, 1))
    w13 = torch.randn(d_model, 2 * hidden, generator=g, device=device) / math.sqrt(d_model)
    w2 = torch.randn(hidden, d_model, generator=g, device=device) / math.sqrt(hidden)
    return w13, w2


def router_init(seed: int, layer: int, d_model: int, num_experts: int) -> torch.Tensor:
    """Deterministic float32 router weights [H, E]."""
    g = torch.Generator().manual_seed(_mix(seed, layer, 0, 2))
    return torch.randn(d_model, num_experts, generator=g) / math.sqrt(d_model)


def _mix(*xs: int) -> int:
    h = 0x243F6A88
    for x in xs:
        h = (h * 0x100000001B3 ^ (x + 0x9E37)) & 0x7FFFFFFFFFFFFFFF
    return h


EXPERT_IMPLS = ("auto", "loop", "grouped_mm", "triton")


@dataclass(frozen=True)
class MoELayerSpec:
    """The shape and behaviour of one MoE layer, the same on every rank (the one owner of the
    layer-shape rules: :meth:`__post_init__` refuses a bad value naming the field).

    hidden: H, the token width; num_experts: E logical experts; top_k: K experts per token;
    expert_hidden: I, each expert's SwiGLU width (w13 [H, 2I], w2 [I, H]); routing: the router
    variant; dtype: the expert weights' dtype (the router stays float32); expert_impl: auto |
    loop | grouped_mm | triton; aux_loss_coef: the load-balancing loss's weight (0: off);
    clone_slots: slots per rank for clones of hot experts; pipeline_chunks: C, 1 runs dispatch →
    experts → combine over all tokens, C > 1 splits each rank's tokens into C chunks whose
    exchange overlaps the experts of the neighbouring chunks (:mod:`ray_moe.comm.pipeline`; the
    same results), or a tuple of relative chunk sizes (``(1, 6, 1)``: small first and last
    chunks, whose exchanges nothing hides); delay_wgrad: with the Triton experts, their weight
    gradients run on a side stream (:class:`~ray_moe.model.wgrad.WgradDeferral`): in the
    sequential layer beside the dispatch's backward exchange (the same results in ``.grad``, as
    ``backward()`` leaves them: ``torch.autograd.grad`` gets none for w13 and w2), in the
    pipelined layer each chunk's beside the next chunk's backward and the last chunk's return
    exchange (autograd gets them as usual); early_experts: D > 0, in the sequential layer over a
    transport that can return before the peers' rows arrive (``supports_early_rows``: NVSHMEM's
    peer path), the up-projection of each rank's own rows for its first D slots runs while the
    peers' rows are on the way (:class:`~ray_moe.model.experts.EarlyRows`; the same GEMM
    tiles otherwise, so the experts' GEMMs do not shrink as with chunks); 0: off; expert_grid:
    the Triton experts' row GEMMs on a persistent grid or one program per tile
    (:data:`~ray_moe.model.experts.EXPERT_GRIDS`); expert_precision: bf16 (the weights' dtype) or
    fp8 (every expert GEMM in block-scaled FP8, :mod:`ray_moe.kernels.fp8_expert_ffn`, whatever
    expert_impl says); seed: with
    the layer index, seeds the router and every logical expert.
    """

    hidden: int
    num_experts: int
    top_k: int
    expert_hidden: int
    routing: Routing = SOFTMAX
    dtype: torch.dtype = torch.float32
    expert_impl: str = "auto"
    aux_loss_coef: float = 0.0
    clone_slots: int = 0
    pipeline_chunks: int | tuple[int, ...] = 1
    delay_wgrad: bool = False
    early_experts: int = 0
    expert_grid: str = "persistent"
    expert_precision: str = "bf16"
    seed: int = 0

    def __post_init__(self) -> None:
        weights = chunk_weights(self.pipeline_chunks)  # raises ValueError naming what is allowed
        if not isinstance(self.pipeline_chunks, int):
            object.__setattr__(self, "pipeline_chunks", weights)  # a list from a config: hashable
        for name in ("hidden", "num_experts", "top_k", "expert_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")
        if isinstance(self.clone_slots, bool) or not isinstance(self.clone_slots, int) or self.clone_slots < 0:
            raise ValueError(f"clone_slots must be an integer >= 0, got {self.clone_slots!r}")
        if self.expert_impl not in EXPERT_IMPLS:
            raise ValueError(f"expert_impl={self.expert_impl!r} is not one of {', '.join(EXPERT_IMPLS)}")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"aux_loss_coef={self.aux_loss_coef} must be >= 0")
        if not isinstance(self.routing, Routing):
            raise ValueError(f"routing must be a Routing, got {self.routing!r}")
        if not isinstance(self.delay_wgrad, bool):
            raise ValueError(f"delay_wgrad must be true or false, got {self.delay_wgrad!r}")
        if isinstance(self.early_experts, bool) or not isinstance(self.early_experts, int) or self.early_experts < 0:
            raise ValueError(f"early_experts must be an integer >= 0, got {self.early_experts!r}")
        if self.expert_grid not in EXPERT_GRIDS:
            raise ValueError(f"expert_grid={self.expert_grid!r} is not one of {', '.join(EXPERT_GRIDS)}")
        if self.expert_precision not in EXPERT_PRECISIONS:
            raise ValueError(f"expert_precision={self.expert_precision!r} is not one of {', '.join(EXPERT_PRECISIONS)}")


@dataclass(frozen=True)
class _Routed:
    """One call's routing: impl (the experts' implementation); weights float32 [T, K]; ids int64
    [T, K] logical experts; probs float32 [T, E] or None (the aux loss's); dest_rank, dest_slot
    int32 [T, K] (the replica picked)."""

    impl: str
    weights: torch.Tensor
    ids: torch.Tensor
    probs: torch.Tensor | None
    dest_rank: torch.Tensor
    dest_slot: torch.Tensor


@dataclass
class MoEInFlight:
    """One :class:`MoELayer` call between its stages (:meth:`MoELayer.start`, ``run_experts``,
    ``finish``): the routing and input x [T, H], the side stream (None on the CPU), and per stage
    what it left: the dispatch's (recv_x, recv_slot, recv_w, layout) and its event ``sent``; the
    received pairs (int64 scalar), the combine's output [T, H] and its event ``combined``."""

    routed: _Routed
    x: torch.Tensor
    side: object
    recv: tuple | None = None
    sent: object = None
    pairs: torch.Tensor | None = None
    out: torch.Tensor | None = None
    combined: object = None


class MoELayer(nn.Module):
    """Expert-parallel SwiGLU MoE layer.

    Parameters: ``router`` float32 [H, E] (replicated); ``w13`` [S, H, 2I] and ``w2`` [S, I, H]
    in the model dtype, where S = E/W native slots + ``clone_slots``; both carry an
    :class:`~ray_moe.placement.placement.ExpertShard` mark (``param.expert_shard``).

    Buffers (device-side load statistics, never read inside forward):
    ``expert_tokens`` float32 [E] tokens routed to each logical expert from this rank, and
    ``received_pairs`` float32 [1] (token, expert) pairs this rank's slots computed, both
    accumulated since the last :meth:`pop_load` (not while :attr:`recomputing`: a forward that
    activation checkpointing replays in backward counts once). With a routing that has a
    balancing bias: ``score_bias`` float32 [E], a persistent buffer (replicated, checkpointed)
    that :meth:`update_score_bias` moves after each optimizer step.
    """

    def __init__(
        self,
        spec: MoELayerSpec,
        transport: Transport,
        placement: Placement | None = None,
        layer_idx: int = 0,
        device: torch.device | str = "cpu",
        expert_chooser: ExpertImplChooser | None = None,
        reset: bool = True,
    ) -> None:
        """``spec``: the layer's shape and behaviour (:class:`MoELayerSpec`, the same on every
        rank). ``placement``: the initial placement (default: native, with ``spec.clone_slots``
        free clone slots per rank); the world size is the transport's. ``layer_idx``: the block
        index (it seeds the layer's weights with ``spec.seed``). ``reset=False`` leaves the expert
        weights zero for a caller that loads them (a checkpoint, an HF model, a benchmark: drawing
        E large experts on the host takes minutes)."""
        super().__init__()
        self.spec = spec
        num_experts, d_model, expert_hidden = spec.num_experts, spec.hidden, spec.expert_hidden
        dtype, seed, routing = spec.dtype, spec.seed, spec.routing
        if placement is None:
            placement = Placement.native(num_experts, transport.world_size, spec.clone_slots)
        self._check_placement(placement, num_experts, transport.world_size)
        self.layer_idx = layer_idx
        self.transport, self.rank = transport, transport.rank
        self.recomputing = False  # set by activation checkpointing while it replays this forward
        # with expert_impl "auto" on a GPU that runs the Triton kernels: measured per shape, shared by
        # the model's layers (ray_moe.model.expert_choice)
        self.expert_chooser = expert_chooser or ExpertImplChooser()
        S = placement.slots_per_rank
        self.router = nn.Parameter(router_init(seed, layer_idx, d_model, num_experts).to(device))
        # zeros, not empty: with reset=False the clone slots are never loaded until a placement uses them
        self.w13 = nn.Parameter(torch.zeros(S, d_model, 2 * expert_hidden, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.zeros(S, expert_hidden, d_model, dtype=dtype, device=device))
        shard = ExpertShard(tuple(range(transport.rank * placement.experts_per_rank,
                                        (transport.rank + 1) * placement.experts_per_rank)))
        self.w13.expert_shard = shard
        self.w2.expert_shard = shard
        self.register_buffer("expert_tokens", torch.zeros(num_experts, device=device), persistent=False)
        self.register_buffer("received_pairs", torch.zeros(1, device=device), persistent=False)
        self.register_buffer("score_bias", torch.zeros(num_experts, device=device) if routing.bias else None,
                             persistent=routing.bias)
        self.placement = placement
        self.tables = placement.tables(device)
        self.wgrad_deferral = WgradDeferral(device) if spec.delay_wgrad else None
        # fp8: the experts' FP8 weight copies, remade once per parameter version (after each update)
        self.fp8_weights = fp8_weight_cache() if spec.expert_precision == "fp8" else None
        if reset:
            self.reset_parameters()

    # the spec's fields under the layer's names (one truth: the spec)
    d_model = property(lambda self: self.spec.hidden)
    num_experts = property(lambda self: self.spec.num_experts)
    top_k = property(lambda self: self.spec.top_k)
    expert_hidden = property(lambda self: self.spec.expert_hidden)
    seed = property(lambda self: self.spec.seed)
    expert_impl = property(lambda self: self.spec.expert_impl)
    aux_loss_coef = property(lambda self: self.spec.aux_loss_coef)
    routing = property(lambda self: self.spec.routing)
    pipeline_chunks = property(lambda self: self.spec.pipeline_chunks)
    early_experts = property(lambda self: self.spec.early_experts)
    expert_grid = property(lambda self: self.spec.expert_grid)

    def join_wgrad(self) -> None:
        """Make the current stream wait for weight gradients still running on the deferral's side
        stream (``spec.delay_wgrad``; the dispatch's backward joins them already, this is for a
        backward that did not reach it). No-op otherwise."""
        if self.wgrad_deferral is not None:
            self.wgrad_deferral.join()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic initial router and expert weights, independent of the world size (each
        logical expert from its own generator), and zeroed load counters."""
        self.router.copy_(router_init(self.seed, self.layer_idx, self.d_model, self.num_experts))
        self.w13.zero_()
        self.w2.zero_()
        for slot, e in enumerate(self.placement.slot_experts()[self.rank].tolist()):
            if e >= 0:
                w13, w2 = expert_init(self.seed, self.layer_idx, e, self.d_model, self.expert_hidden,
                                      device=self.w13.device)
                self.load_expert(slot, w13, w2)
        self.expert_tokens.zero_()
        self.received_pairs.zero_()
        if self.score_bias is not None:
            self.score_bias.zero_()

    @staticmethod
    def _check_placement(placement: Placement, num_experts: int, world_size: int) -> None:
        if placement.num_experts != num_experts or placement.world_size != world_size:
            raise ValueError(
                f"placement is for E={placement.num_experts}, W={placement.world_size}; the layer "
                f"has E={num_experts} over a transport of W={world_size}"
            )

    # ------------------------------------------------------------------ weights
    @property
    def native_experts(self) -> tuple[int, ...]:
        """Logical ids of the experts this rank owns (slots 0 .. E/W-1)."""
        return self.w13.expert_shard.native_experts

    @torch.no_grad()
    def load_expert(self, slot: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Copy one expert's weights ([H, 2I], [I, H]) into a slot."""
        self.w13[slot].copy_(w13)
        self.w2[slot].copy_(w2)

    def set_placement(self, placement: Placement) -> None:
        """Switch routing tables (the caller moves clone weights, see ray_moe.placement.clones)."""
        self._check_placement(placement, self.num_experts, self.transport.world_size)
        if placement.slots_per_rank != self.w13.shape[0]:
            raise ValueError(
                f"placement has {placement.slots_per_rank} slots per rank; layer has {self.w13.shape[0]}"
            )
        self.placement = placement
        self.tables = placement.tables(self.w13.device)

    # ------------------------------------------------------------------ forward
    @property
    def forward(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`eager_forward`, never traced: collectives over the transport, Triton launches and
        data-dependent shapes. Inside a ``torch.compile``'d caller it is wrapped in
        ``torch.compiler.disable`` there and then (a graph break), so a process that never compiles
        never imports ``torch._dynamo`` (~1.2 s of CPU in every worker)."""
        if torch.compiler.is_compiling():
            return torch.compiler.disable(self.eager_forward)
        return self.eager_forward

    def eager_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] (model dtype) → (out [T, H], auxiliary loss float32 scalar). Runs eagerly
        inside a ``torch.compile``'d caller too (a graph break; ``model.compile=blocks`` compiles
        the dense parts around it)."""
        r = self._route(x)
        if len(chunk_weights(self.pipeline_chunks)) > 1:
            out, pairs = pipelined_exchange(self.transport, x, r.weights, r.dest_rank, r.dest_slot, (self.w13, self.w2),
                                            self._expert_fn(r.impl), self.pipeline_chunks,
                                            deferral=self.wgrad_deferral)
        else:
            deferral = self.wgrad_deferral
            join = deferral.join if deferral else None
            early = None
            if self.early_experts and self.transport.supports_early_rows:
                recv_x, recv_slot, recv_w, layout, in_flight = dispatch_early(
                    self.transport, x, r.weights, r.dest_rank, r.dest_slot, after_backward=join)
                early = EarlyRows(in_flight.local_lo, in_flight.local_hi, self.early_experts, in_flight.wait,
                                  in_flight.source, in_flight.source_rows)
            else:
                # without autograd (decoding, evaluation) the received rows are consumed before the next
                # layer dispatches: the transport may hand out its own outputs instead of allocating
                recv_x, recv_slot, recv_w, layout = dispatch(self.transport, x, r.weights, r.dest_rank, r.dest_slot,
                                                             after_backward=join, reuse_outputs=True)
            partial = self._expert_fn(r.impl)(recv_x, recv_slot, recv_w, self.w13, self.w2, deferral, early)
            out = combine(self.transport, partial, layout)
            pairs = (recv_slot >= 0).sum()
        if not self.recomputing:
            self._count(r.ids, pairs)
        return out, self._aux(r.probs, r.ids, x)

    # ------------------------------------------------------------------ staged (two-batch overlap)
    def start(self, x: torch.Tensor, token_offset: int = 0, capacity: int | None = None) -> "MoEInFlight":
        """The first stage of a call whose exchanges run on the transport's side stream while the
        current stream computes something else (the decoder's ``moe.two_batch_overlap``: the other
        half batch). Routes x [T, H] (model dtype) on the current stream and issues the dispatch
        on the side stream. ``token_offset``: x's first row in the rank's whole batch (a clone's
        replica is picked per token index, so the halves pick what the whole batch would);
        ``capacity``: the dispatch's (:meth:`Transport.split_capacity`).
        Then :meth:`run_experts`, then :meth:`finish`; every rank calls the stages of its calls
        in one order (they are collectives). The sequential layer's exchange only: no chunks, no
        early experts, no reused outputs (two calls are in flight)."""
        r = self._route(x, token_offset)
        side = self.transport.comm_stream(x.device)
        if side is not None:
            side.wait_stream(current(x))  # the routing is made on the current stream
            used_on((x, r.weights, r.dest_rank, r.dest_slot), side)
        join = self.wgrad_deferral.join if self.wgrad_deferral else None
        recv, sent = run_on(side, current(x), lambda: dispatch(self.transport, x, r.weights, r.dest_rank,
                                                                r.dest_slot, capacity, after_backward=join))
        return MoEInFlight(routed=r, x=x, side=side, recv=recv, sent=sent)

    def run_experts(self, call: "MoEInFlight", recompute: bool = False) -> None:
        """The second stage: once the dispatch is in, the experts on the current stream, then the
        combine issued on the side stream. ``recompute``: the experts' activations are recomputed
        in backward (``model.activation_checkpointing``: moe or full), not kept."""
        wait(current(call.x), call.sent)
        recv_x, recv_slot, recv_w, layout = call.recv
        fn = self._expert_fn(call.routed.impl)
        args = (recv_x, recv_slot, recv_w, self.w13, self.w2, self.wgrad_deferral)
        partial = checkpointed(fn, *args, moe_layers=(self,)) if recompute else fn(*args)
        call.pairs = (recv_slot >= 0).sum()
        call.recv = None
        if call.side is not None:
            used_on(partial, call.side)
        (call.out,), call.combined = run_on(call.side, current(call.x),
                                            lambda: (combine(self.transport, partial, layout),), after=made(partial))

    def finish(self, call: "MoEInFlight") -> torch.Tensor:
        """The last stage: the current stream waits for the combine. Returns out [T, H] (the
        auxiliary loss of a batch's calls: :meth:`aux_loss`)."""
        wait(current(call.x), call.combined)
        self._count(call.routed.ids, call.pairs)
        return call.out

    def aux_loss(self, calls: Sequence["MoEInFlight"]) -> torch.Tensor:
        """The auxiliary loss (float32 scalar) of the tokens of ``calls`` taken as one batch: what
        :meth:`eager_forward` returns for them in one call (the loss is not a sum over parts)."""
        probs = torch.cat([c.routed.probs for c in calls]) if self.aux_loss_coef > 0 else None
        return self._aux(probs, torch.cat([c.routed.ids for c in calls]), calls[0].x)

    # ------------------------------------------------------------------ the stages' parts
    def _route(self, x: torch.Tensor, token_offset: int = 0) -> "_Routed":
        if x.dim() != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"MoELayer expects x of shape [T, {self.d_model}], got {tuple(x.shape)}")
        if x.dtype != self.w13.dtype:
            raise TypeError(f"MoELayer expects x of dtype {self.w13.dtype}, got {x.dtype}")
        impl = resolve_impl(self.expert_impl, x)
        weights, ids, probs = route(
            x, self.router, self.top_k, fused=impl == "triton", need_probs=self.aux_loss_coef > 0,
            routing=self.routing, score_bias=self.score_bias,
        )
        dest_rank, dest_slot = self.tables.route(ids, self.rank, token_offset)  # replicas by global token index
        return _Routed(impl, weights, ids, probs, dest_rank, dest_slot)

    def _expert_fn(self, impl: str) -> Callable[..., torch.Tensor]:
        """``fn(recv_x, recv_slot, recv_w, w13, w2, deferral=None, early=None) -> partial [R, H]``:
        the experts over received rows, their implementation measured per shape under ``auto``."""
        def experts(recv_x, recv_slot, recv_w, w13, w2, deferral=None, early=None):
            if self.fp8_weights is not None:
                return expert_ffn(recv_x, recv_slot, recv_w, w13, w2, deferral=deferral, early=early,
                                  precision="fp8", fp8_cache=self.fp8_weights)
            choice = ExpertChoice(impl)
            if self.expert_impl == "auto" and impl == "triton":
                needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (recv_x, recv_w, w13, w2))
                if early is not None and not self.expert_chooser.knows(recv_x, recv_slot, w13, needs_grad,
                                                                       self.expert_grid):
                    early.wait()  # the first call of a shape times the candidates on every row
                choice = self.expert_chooser.choose(recv_x, recv_slot, recv_w, w13, w2, needs_grad, self.expert_grid)
            return expert_ffn(recv_x, recv_slot, recv_w, w13, w2, choice.impl, wgrad=choice.wgrad, deferral=deferral,
                              early=early, grid=self.expert_grid)
        return experts

    @torch.no_grad()
    def _count(self, ids: torch.Tensor, pairs: torch.Tensor) -> None:
        self.expert_tokens.scatter_add_(0, ids.flatten(), torch.ones(ids.numel(), device=ids.device))
        self.received_pairs += pairs

    def _aux(self, probs: torch.Tensor | None, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        aux = load_balancing_loss(probs, ids) if self.aux_loss_coef > 0 else x.new_zeros((), dtype=torch.float32)
        return aux * self.aux_loss_coef

    def update_score_bias(self, tokens: torch.Tensor, rate: float) -> None:
        """One aux-loss-free balancing step of ``score_bias`` from ``tokens`` (float32 [E], the
        global tokens per logical expert of the step: the same on every rank, so every rank's
        bias stays the same). No-op without a balancing bias."""
        if self.score_bias is not None and rate > 0:
            balancing_bias_step(self.score_bias, tokens.to(self.score_bias), rate)

    def pop_load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert_tokens [E], received_pairs [1]) since the last call, then reset (host copies)."""
        tokens, pairs = pop_loads([self])
        return tokens[0], pairs


def pop_loads(layers: Sequence[MoELayer]) -> tuple[torch.Tensor, torch.Tensor]:
    """The load counters of ``layers`` (same number of experts each) since their last pop, then
    reset: (expert_tokens float32 [len(layers), E], received_pairs float32 [len(layers)]) on the
    host, in one device-to-host copy (a training step reads every MoE layer's)."""
    if not layers:
        return torch.zeros(0, 0), torch.zeros(0)
    E = layers[0].expert_tokens.numel()
    if any(layer.expert_tokens.numel() != E for layer in layers):
        raise ValueError(f"pop_loads needs layers of one expert count, got {[l.expert_tokens.numel() for l in layers]}")
    counters = [layer.expert_tokens for layer in layers] + [layer.received_pairs for layer in layers]
    host = torch.cat(counters).cpu()
    torch._foreach_zero_(counters)
    n = len(layers)
    return host[: n * E].view(n, E), host[n * E:]
