"""The expert-parallel MoE layer: route → dispatch → experts → combine.

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

from ray_moe.comm.base import Layout, Transport, combine, dispatch, dispatch_payload
from ray_moe.model.expert_choice import ExpertChoice, ExpertImplChooser
from ray_moe.model.experts import EXPERT_PRECISIONS, SWIGLU, ExpertActivation, expert_ffn, fp8_weight_cache, resolve_impl
from ray_moe.model.router import SOFTMAX, Routing, balancing_bias_step, load_balancing_loss, route
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
    clone_slots: slots per rank for clones of hot experts; seed: with the layer index, seeds the
    router and every logical expert; router_bias: a learned float32 [E] bias on the router logits;
    expert_bias: each expert's up and down projections have biases (``b13`` [S, 2I], ``b2`` [S, H]);
    activation: the experts' gated activation (gpt-oss's clamped one; the Triton kernels apply it
    and the biases in their epilogues);
    expert_precision: bf16 (the weights' dtype) or fp8 (every expert GEMM in block-scaled FP8,
    :mod:`ray_moe.kernels.fp8_expert_ffn`, whatever expert_impl says);
    fp8_wire: with fp8 experts, the dispatch sends each row's FP8 quantisation (E4M3 bytes and
    float32 1×128 scales, H + 4·H/128 bytes instead of 2·H) and the up-projection reads it as is
    (the combine and the dispatch's backward stay in the model dtype); needs H % 4 == 0.
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
    expert_precision: str = "bf16"
    fp8_wire: bool = True
    seed: int = 0
    router_bias: bool = False
    expert_bias: bool = False
    activation: ExpertActivation = SWIGLU

    def __post_init__(self) -> None:
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
        if self.expert_precision not in EXPERT_PRECISIONS:
            raise ValueError(f"expert_precision={self.expert_precision!r} is not one of {', '.join(EXPERT_PRECISIONS)}")
        if self.expert_precision == "fp8" and self.fp8_wire and self.hidden % 4:
            raise ValueError(f"FP8 rows on the wire need hidden % 4 == 0 (the scales' alignment), got "
                             f"hidden={self.hidden}; set fp8_wire off")


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


@dataclass(frozen=True)
class _Received:
    """What one call's dispatch left on this rank: rows x [R, H] (model dtype), slot int32 [R, K]
    (-1: that k went elsewhere), weight float32 [R, K] (0 there) and the transport's layout (the
    combine sends the partial rows back by it). With FP8 rows on the wire, x_fp8 holds the
    received rows (E4M3 [R, H] and float32 scales [R, H/128], views of the received bytes) and x
    is their stand-in (no storage; the gradient w.r.t. it is the received rows')."""

    x: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    layout: Layout
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None


class MoELayer(nn.Module):
    """Expert-parallel SwiGLU MoE layer. :meth:`forward` runs four stages, each a method:
    :meth:`_route` (router, top-k, the replica of each chosen expert), :meth:`_dispatch` (each
    token row to the ranks of its experts), :meth:`_experts` (the SwiGLU experts over the received
    rows) and :meth:`_combine` (the weighted partial rows back to their tokens, summed).

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
        self.b13 = self.b2 = None
        if spec.expert_bias:
            self.b13 = nn.Parameter(torch.zeros(S, 2 * expert_hidden, dtype=dtype, device=device))
            self.b2 = nn.Parameter(torch.zeros(S, d_model, dtype=dtype, device=device))
            self.b13.expert_shard = self.b2.expert_shard = shard
        self.router_bias = (nn.Parameter(torch.zeros(num_experts, device=device)) if spec.router_bias else None)
        self.register_buffer("expert_tokens", torch.zeros(num_experts, device=device), persistent=False)
        self.register_buffer("received_pairs", torch.zeros(1, device=device), persistent=False)
        self.register_buffer("score_bias", torch.zeros(num_experts, device=device) if routing.bias else None,
                             persistent=routing.bias)
        self.placement = placement
        self.tables = placement.tables(device)
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

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic initial router and expert weights, independent of the world size (each
        logical expert from its own generator), and zeroed load counters."""
        self.router.copy_(router_init(self.seed, self.layer_idx, self.d_model, self.num_experts))
        for p in self.expert_params():
            p.zero_()
        if self.router_bias is not None:
            self.router_bias.zero_()
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

    def expert_params(self) -> list[nn.Parameter]:
        """The expert-sharded parameters, [S, ...] each: w13, w2 and, with biases, b13, b2 (what
        clones copy and whose clone-slot gradients go to the owners)."""
        return [self.w13, self.w2] + ([self.b13, self.b2] if self.b13 is not None else [])

    @torch.no_grad()
    def load_expert(self, slot: int, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> None:
        """Copy one expert's weights ([H, 2I], [I, H]) into a slot, and its biases ([2I], [H]) when
        given (a layer with biases keeps the slot's otherwise: zeros after a reset)."""
        self.w13[slot].copy_(w13)
        self.w2[slot].copy_(w2)
        if (b13 is None) != (b2 is None) or (b13 is not None and self.b13 is None):
            raise ValueError("load_expert takes both biases or neither, and only for a layer with expert biases")
        if b13 is not None:
            self.b13[slot].copy_(b13)
            self.b2[slot].copy_(b2)

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
        routed = self._route(x)
        received = self._dispatch(x, routed)
        partial = self._experts(received, routed.impl)
        out = self._combine(partial, received)
        if not self.recomputing:
            self._count(routed.ids, (received.slot >= 0).sum())
        return out, self._aux(routed.probs, routed.ids, x)

    # ------------------------------------------------------------------ the stages
    def _route(self, x: torch.Tensor) -> _Routed:
        """Router logits, top-k and, per (token, k), the rank and slot of the replica that computes
        it (a clone's replica is picked per token index)."""
        if x.dim() != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"MoELayer expects x of shape [T, {self.d_model}], got {tuple(x.shape)}")
        if x.dtype != self.w13.dtype:
            raise TypeError(f"MoELayer expects x of dtype {self.w13.dtype}, got {x.dtype}")
        impl = resolve_impl(self.expert_impl, x)
        fused_router = impl == "triton"
        weights, ids, probs = route(
            x, self.router, self.top_k, fused=fused_router, need_probs=self.aux_loss_coef > 0,
            routing=self.routing, score_bias=self.score_bias, logit_bias=self.router_bias,
        )
        dest_rank, dest_slot = self.tables.route(ids, self.rank)
        return _Routed(impl, weights, ids, probs, dest_rank, dest_slot)

    def _dispatch(self, x: torch.Tensor, routed: _Routed) -> _Received:
        """Each token row, once per rank that holds one of its experts, with its (slot, weight)
        pairs. Without autograd (decoding, evaluation) the received rows are consumed before the
        next layer dispatches: the transport may hand out its own outputs instead of allocating."""
        if self.fp8_weights is not None and self.spec.fp8_wire:
            from ray_moe.kernels.fp8_expert_ffn import default_ops
            from ray_moe.kernels.fp8_quant import pack_rows, packed_views

            # FP8 rows on the wire: x's 1×128 quantisation, sent as bytes; recv_x is a stand-in
            packed = pack_rows(x, default_ops(x.device).quantize_rows)
            recv_x, recv_p, recv_slot, recv_w, layout = dispatch_payload(
                self.transport, x, packed, routed.weights, routed.dest_rank, routed.dest_slot, reuse_outputs=True)
            return _Received(recv_x, recv_slot, recv_w, layout, packed_views(recv_p, x.shape[1]))
        recv_x, recv_slot, recv_w, layout = dispatch(self.transport, x, routed.weights, routed.dest_rank,
                                                     routed.dest_slot, reuse_outputs=True)
        return _Received(recv_x, recv_slot, recv_w, layout)

    def _experts(self, received: _Received, impl: str) -> torch.Tensor:
        """The SwiGLU experts of this rank's slots over the received rows → partial [R, H], each
        row the weighted sum of its pairs' expert outputs. Under ``expert_impl: auto`` with the
        Triton kernels, the implementation (and who computes the weight gradients) is measured
        once per shape (:class:`~ray_moe.model.expert_choice.ExpertImplChooser`)."""
        x, slot, weight = received.x, received.slot, received.weight
        if self.fp8_weights is not None:
            return expert_ffn(x, slot, weight, self.w13, self.w2, act=self.spec.activation, b13=self.b13,
                              b2=self.b2, precision="fp8", fp8_cache=self.fp8_weights, x_fp8=received.x_fp8)
        choice = ExpertChoice(impl)
        if self.expert_impl == "auto" and impl == "triton":
            needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, *self.expert_params()))
            act = None if self.spec.activation == SWIGLU else self.spec.activation
            choice = self.expert_chooser.choose(x, slot, weight, self.w13, self.w2, needs_grad, act, self.b13, self.b2)
        return expert_ffn(x, slot, weight, self.w13, self.w2, choice.impl, wgrad=choice.wgrad,
                          act=self.spec.activation, b13=self.b13, b2=self.b2)

    def _combine(self, partial: torch.Tensor, received: _Received) -> torch.Tensor:
        """partial [R, H] back to the ranks of its tokens, summed per token → out [T, H]."""
        return combine(self.transport, partial, received.layout)

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
