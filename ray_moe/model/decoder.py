"""The one decoder: the byte-level model and the Hugging Face MoE families (Qwen3-MoE, Mixtral,
GLM-4.5, DeepSeek-V3 with latent attention, gpt-oss), built from an :class:`~ray_moe.arch.ArchSpec`.

Embeddings, attention, norms, dense layers and shared experts are replicated (data parallel);
every routed-expert FFN is an expert-parallel :class:`~ray_moe.model.moe.MoELayer` (dispatch,
experts, combine over any transport; clones and re-cloning). Tokens flow DP → EP → DP: each rank
attends over its own sequences, then the MoE layers move token rows to the experts and back.
Module names follow transformers' (``layers.3.self_attn.q_proj``, ``layers.3.mlp.shared_experts``)
so the weight map to HF checkpoints (:mod:`ray_moe.model.hf`) is short; the routed experts of
block i are ``layers.i.mlp.routed`` (router [H, E] float32, ``w13``/``w2`` by slot,
``score_bias``). The byte model (``positions: learned``) adds ``embed_positions`` [seq_len, H].

Initial weights (without ``model.init_from``) come from the model's own generator seeded by
``train.seed`` in module order (the same on every rank; the global RNG is neither seeded nor
advanced), by the spec's ``init`` scheme (:class:`~ray_moe.arch.ArchSpec`); experts and routers
from the MoE layer's per-expert generators (independent of the world size).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import skip_init

from ray_moe.arch import ArchSpec
from ray_moe.comm.base import Transport
from ray_moe.config import Config, torch_dtype
from ray_moe.model.attention import Attention, make_attention
from ray_moe.model.dense_fp8 import convert_dense_to_fp8
from ray_moe.model.expert_choice import ExpertImplChooser
from ray_moe.model.experts import ExpertActivation
from ray_moe.model.kv_cache import KVCache
from ray_moe.model.mlp import GatedMLP
from ray_moe.model.moe import MoELayer, MoELayerSpec
from ray_moe.model.norm import RMSNorm
from ray_moe.model.recompute import check_mode, checkpointed
from ray_moe.model.rope import rope_tables
from ray_moe.model.router import Routing


def _dense(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:  # its own code object: its own compile cache
    return mlp(h)


class MoEBlock(nn.Module):
    """Routed experts (expert parallel) plus, optionally, a shared expert (replicated) that every
    token passes through: x [T, H] → (routed(x) + shared(x) [T, H], aux loss float32 scalar)."""

    def __init__(self, routed: MoELayer, shared: GatedMLP | None):
        super().__init__()
        self.routed = routed
        self.shared_experts = shared

    def forward(self, x: torch.Tensor, dense: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _dense
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``dense(shared_experts, x)`` runs the shared expert (:attr:`BlockRegions.dense`: eager or
        compiled)."""
        y, aux = self.routed(x)
        if self.shared_experts is not None:
            y = y + dense(self.shared_experts, x)
        return y, aux


@dataclass(frozen=True)
class BlockRegions:
    """The dense parts of a decoder block, as functions of the block (or of its MLP), that
    ``model.compile=blocks`` compiles (:meth:`compiled`; regional ``torch.compile``, as torchtitan
    compiles per block) while the MoE layer (routing, dispatch and combine over the transport, the
    Triton expert kernels) runs eagerly between them. One instance is shared by every block of a
    model: each function's compiled graph serves every block of the same shapes (the parameters are
    graph inputs), so a deep model compiles once per region, not once per block.

    attention: (layer, x [B, L, H], cos, sin) → x + attn(input_layernorm(x)) [B, L, H];
    ffn_input: (layer, x [B, L, H]) → post_attention_layernorm(x) [B·L, H];
    dense: (mlp, h [T, H]) → mlp(h) [T, H], a dense block's MLP or a shared expert.
    """

    attention: Callable[..., torch.Tensor]
    ffn_input: Callable[..., torch.Tensor]
    dense: Callable[[nn.Module, torch.Tensor], torch.Tensor]

    @classmethod
    def eager(cls) -> "BlockRegions":
        return cls(DecoderLayer.attention_half, DecoderLayer.ffn_input, _dense)

    def compiled(self, backend: str = "inductor") -> "BlockRegions":
        """Each function through ``torch.compile(fullgraph=True)`` with ``backend`` (inductor; the
        tests also take ``aot_eager``, which runs the same autograd graphs without code generation)."""
        return BlockRegions(*(torch.compile(f, backend=backend, fullgraph=True)
                              for f in (self.attention, self.ffn_input, self.dense)))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(x)); the FFN is an :class:`MoEBlock` or
    a dense :class:`GatedMLP`. ``checkpointing``: none | moe (recompute the MoE FFN in backward) |
    full (recompute the whole block). ``regions``: the dense parts' functions (:class:`BlockRegions`,
    eager or compiled; a forward with a KV cache always runs them eagerly: its shapes change every
    token)."""

    def __init__(self, spec: ArchSpec, mlp: nn.Module, checkpointing: str, device: torch.device | str,
                 layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)
        self.self_attn = make_attention(spec, device, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)
        self.mlp = mlp
        self.checkpointing = check_mode(checkpointing)
        self.regions = BlockRegions.eager()

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cache: KVCache | None = None, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, L, H] → ([B, L, H], aux loss float32 scalar); cos/sin: the RoPE tables of x's
        positions (None with learned positions); ``cache``: the attention reads and extends it as
        layer ``layer`` (incremental decoding, no gradients)."""
        if self.checkpointing == "full" and torch.is_grad_enabled() and cache is None:
            return checkpointed(self._forward, x, cos, sin, moe_layers=self._moe())
        return self._forward(x, cos, sin, cache, layer)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                 cache: KVCache | None = None, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if cache is None:
            regions = self.regions
            x = regions.attention(self, x, cos, sin)
        else:  # one position per forward: compiled regions would recompile for every cache length
            regions = BlockRegions.eager()
            x = self.attention_half(x, cos, sin, cache, layer)
        if self.checkpointing == "moe" and self._moe() and torch.is_grad_enabled():
            y, aux = checkpointed(self._ffn, x, regions, moe_layers=self._moe())
        else:
            y, aux = self._ffn(x, regions)
        return x + y, aux

    def attention_half(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                       cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x [B, L, H] → x + attn(input_layernorm(x)) [B, L, H]."""
        return x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer)

    def ffn_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, H] → post_attention_layernorm(x) as token rows [B·L, H]."""
        B, L, H = x.shape
        return self.post_attention_layernorm(x).reshape(B * L, H)

    def _ffn(self, x: torch.Tensor, regions: BlockRegions) -> tuple[torch.Tensor, torch.Tensor]:
        h = regions.ffn_input(self, x)
        if isinstance(self.mlp, MoEBlock):
            y, aux = self.mlp(h, regions.dense)
        else:
            y, aux = regions.dense(self.mlp, h), h.new_zeros((), dtype=torch.float32)
        return y.view(x.shape), aux

    def _moe(self) -> tuple[MoELayer, ...]:
        return (self.mlp.routed,) if isinstance(self.mlp, MoEBlock) else ()


def moe_layer_spec(spec: ArchSpec, config: Config) -> MoELayerSpec:
    """The MoE layer of every routed block of ``spec`` under ``config`` (dtype, expert
    implementation, aux loss, clone slots, seed)."""
    e = config.moe
    routing = Routing(scoring=spec.scoring, normalize=spec.norm_topk_prob, n_group=spec.n_group,
                      topk_group=spec.topk_group, scale=spec.routed_scaling_factor, bias=spec.score_bias)
    return MoELayerSpec(spec.hidden_size, spec.num_experts, spec.top_k, spec.expert_hidden, routing=routing,
                        dtype=torch_dtype(config.model.dtype), expert_impl=e.expert_impl,
                        aux_loss_coef=e.aux_loss_coef, clone_slots=config.balance.clone_slots,
                        seed=config.train.seed, router_bias=spec.router_bias, expert_bias=spec.expert_bias,
                        activation=ExpertActivation(spec.activation, spec.swiglu_alpha, spec.swiglu_limit),
                        expert_precision=e.expert_precision)


class Decoder(nn.Module):
    """Decoder-only MoE LM of ``spec`` (the byte model or an HF family); ``forward(idx [B, L]) ->
    (logits [B, L, V] float32, aux loss)``, ``hidden_states(idx) -> (final-norm hidden [B, L, H],
    aux)``, ``lm_head`` ([V, H]; the embedding's weight when ``tie_word_embeddings``). Implements
    :class:`~ray_moe.model.interface.LanguageModel`.

    ``model.compile=blocks`` compiles each block's dense parts (:meth:`compile_blocks`);
    ``model.dense_precision=fp8`` swaps the blocks' dense linears for torchao's Float8Linear
    (:mod:`ray_moe.model.dense_fp8`; their names in ``fp8_dense``).
    Expert-parallel over ``transport`` (its world size is the group's); ``balance.clone_slots``
    per rank and layer are reserved for clones of hot experts. ``init=False`` leaves the weights
    uninitialised (``model.init_from`` or a checkpoint fills them).
    """

    def __init__(self, spec: ArchSpec, config: Config, transport: Transport,
                 device: torch.device | str = "cpu", init: bool = True):
        super().__init__()
        self.spec = spec
        dtype = torch_dtype(config.model.dtype)
        self.seed = config.train.seed
        H = spec.hidden_size
        layer_spec = moe_layer_spec(spec, config)
        chooser = ExpertImplChooser()  # one per model: layers of one shape share the measurement
        # uninitialised like skip_init, without nn.Embedding's meta-device normal_, which imports
        # torch._dynamo (skip_init of nn.Linear, below, does not)
        self.embed_tokens = nn.Embedding(spec.vocab_size, H, _weight=torch.empty(spec.vocab_size, H, device=device))
        self.embed_positions = (nn.Parameter(torch.empty(spec.max_position_embeddings, H, device=device))
                                if spec.positions == "learned" else None)
        layers = []
        for i in range(spec.num_layers):
            if spec.moe_layers[i]:
                routed = MoELayer(layer_spec, transport, layer_idx=i, device=device, expert_chooser=chooser,
                                  reset=init)
                shared = GatedMLP(H, spec.shared_hidden, device) if spec.shared_hidden else None
                mlp: nn.Module = MoEBlock(routed, shared)
            else:
                mlp = GatedMLP(H, spec.dense_hidden, device)
            layers.append(DecoderLayer(spec, mlp, config.model.activation_checkpointing, device, i))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(H, spec.rms_norm_eps, device)
        self.lm_head = skip_init(nn.Linear, H, spec.vocab_size, bias=False, device=device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if config.model.compile_on(torch.device(device).type) == "blocks":
            self.compile_blocks()
        if init:
            self.init_weights(torch.Generator().manual_seed(self.seed))
        for name, p in self.named_parameters():  # experts are built in dtype; routers stay float32
            if getattr(p, "expert_shard", None) is None and not name.endswith((".router", ".router_bias")):
                p.data = p.data.to(dtype=dtype)
        # model.dense_precision=fp8: the blocks' dense linears become torchao Float8Linears (same parameters)
        self.fp8_dense = convert_dense_to_fp8(self, device) if config.model.dense_precision == "fp8" else ()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Replicated weights from ``generator`` (CPU: the same values on every rank and device) in
        module order, then the position table; MoE layers reset from their own per-expert
        generators. ``init: normal``: linear and embedding weights N(0, init_std²), biases 0;
        ``init: byte``: embeddings N(0, 1), linear weights U(±1/√fan_in), positions N(0, init_std²).
        Norms 1."""
        std, byte = self.spec.init_std, self.spec.init == "byte"
        for module in self.modules():
            if isinstance(module, MoELayer):
                module.reset_parameters()
            elif isinstance(module, nn.Linear) and byte:
                bound = 1.0 / math.sqrt(module.in_features)
                module.weight.copy_(torch.empty(module.weight.shape).uniform_(-bound, bound, generator=generator))
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, (nn.Embedding, nn.Linear)):
                scale = 1.0 if byte else std
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * scale)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            if isinstance(module, Attention) and module.sinks is not None:
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=generator) * std)
        if self.embed_positions is not None:
            self.embed_positions.copy_(torch.randn(self.embed_positions.shape, generator=generator) * std)

    def compile_blocks(self, backend: str = "inductor") -> None:
        """``model.compile=blocks``: every block's dense parts through ``torch.compile`` (one
        :class:`BlockRegions` shared by the blocks); the MoE layers, the embedding, the final norm
        and the LM head stay eager. Parameter names and the state dict do not change."""
        regions = BlockRegions.eager().compiled(backend)
        for layer in self.layers:
            layer.regions = regions

    def moe_layers(self) -> list[MoELayer]:
        """The routed-expert layers, in block order."""
        return [layer.mlp.routed for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """idx: int64/int32 [B, L] token ids → (final-norm hidden states [B, L, H] in the model
        dtype, aux loss float32 scalar). The LM head (``self.lm_head``) is applied by the caller
        (``forward`` for logits, :func:`ray_moe.model.loss.lm_loss` for the training loss).
        ``cache`` (:meth:`new_cache`): ``idx`` continues the cached positions, and is added to them."""
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token ids must be int64 or int32, got {idx.dtype}")
        start, L = (cache.length if cache is not None else 0), idx.shape[1]
        if self.embed_positions is not None and start + L > self.embed_positions.shape[0]:
            raise ValueError(f"sequence length {start + L} exceeds model.seq_len={self.embed_positions.shape[0]}")
        if idx.device.type == "cpu" and idx.numel():  # on GPUs the engine checks ids before the copy
            lo, hi, V = int(idx.min()), int(idx.max()), self.spec.vocab_size
            if lo < 0 or hi >= V:
                where = "model.vocab_size" if self.spec.family == "byte" else "the HF config's vocab_size"
                raise ValueError(f"token ids must be in [0, {V}) ({where}), got min {lo}, max {hi}")
        x = self.embed_tokens(idx)
        if self.embed_positions is not None:
            x = x + self.embed_positions[start:start + L]
            cos = sin = None
        else:
            cos, sin = rope_tables(start + L, self.spec.rotary_dim, self.spec.rope_theta, x.device, x.dtype,
                                   self.spec.yarn)
            cos, sin = cos[start:], sin[start:]
        aux = x.new_zeros((), dtype=torch.float32)
        for i, layer in enumerate(self.layers):
            x, a = layer(x, cos, sin, cache, i)
            aux = aux + a
        if cache is not None:
            cache.advance(L)
        return self.norm(x), aux

    def new_cache(self, capacity: int) -> KVCache:
        """An empty KV cache for :meth:`hidden_states`, ``capacity`` positions long."""
        return KVCache(len(self.layers), capacity)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx: int64/int32 [B, L] → (logits float32 [B, L, V], aux loss float32 scalar)."""
        h, aux = self.hidden_states(idx)
        return self.lm_head(h).float(), aux
