"""Architectures: a Hugging Face ``config.json`` (or a named preset) → :class:`ArchSpec`.

Five families besides the embedded byte-level model (``model.arch: byte``):

- ``qwen3_moe`` (``Qwen3MoeForCausalLM``): RMSNorm, RoPE, grouped-query attention with q/k norm,
  softmax top-k (``norm_topk_prob``), routed SwiGLU experts, dense layers from
  ``decoder_sparse_step`` / ``mlp_only_layers``.
- ``mixtral`` (``MixtralForCausalLM``): softmax top-k renormalised, no sliding window.
- ``glm4_moe`` (``Glm4MoeForCausalLM``, DeepSeek-V3-style MoE blocks with standard attention):
  sigmoid scores with an ``e_score_correction_bias`` for the choice, group-limited top-k
  (``n_group``, ``topk_group``), ``routed_scaling_factor``, shared experts, the first
  ``first_k_dense_replace`` layers dense, partial rotary.
- ``deepseek_v3`` (``DeepseekV3ForCausalLM``; Kimi K2 and Moonlight-16B-A3B): GLM's MoE blocks with
  multi-head latent attention (``attention="mla"``: low-rank q and kv projections with their own
  norms, a decoupled, interleaved RoPE part, value heads narrower than query/key heads) and YaRN
  with its softmax-scale correction (``mscale_all_dim``).
- ``gpt_oss`` (``GptOssForCausalLM``): learned attention sinks, sliding-window attention on the
  layers ``layer_types`` names, YaRN, q/k/v/o biases, a router with a bias whose top-k logits go
  through a softmax, experts with biases and the clamped SwiGLU ``(up + 1) · gate · σ(α · gate)``.

- ``olmoe`` (``OlmoeForCausalLM``): Qwen3-MoE's blocks with the q/k RMSNorm over the whole
  projection (``qk_norm_whole``), softmax top-k (``norm_topk_prob``), every layer MoE; ``clip_qkv``
  must be null.
- ``minimax_m2`` (``MiniMaxM2ForCausalLM``): OLMoE's whole-projection q/k norms, partial RoPE (the
  released configs' ``rotary_dim``), sigmoid scores with the balancing bias for the choice and
  renormalised weights (no groups, no scaling), every layer MoE; Mixtral's checkpoint names.

Other MoE families (``ernie4_5_moe``, ...) are refused by their ``model_type``.

Pure Python (no torch): the driver resolves the architecture while it validates the config, so a
config.json that ray_moe cannot reproduce exactly is refused before any worker starts, with the
key, its value and what is supported. Keys that do not change the computation (token ids, cache
flags, ...) are ignored; keys that would (a sliding window, RoPE scaling, another activation,
dropout, router jitter) must have their neutral value.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from ray_moe import usage

FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss", "olmoe", "minimax_m2")
BYTE = "byte"  # the embedded byte-level model (``model.arch: byte``): :meth:`ArchSpec.byte`
POSITIONS = ("rope", "learned")
INITS = ("normal", "byte")
ARCHITECTURES = MappingProxyType({
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
})
# model_types that are another family's architecture (Kimi K2's config.json names its own type, with
# DeepseekV3ForCausalLM as the architecture)
ALIASES = MappingProxyType({"kimi_k2": "deepseek_v3"})
ATTENTIONS = ("gqa", "mla")
ACTIVATIONS = ("swiglu", "clamped_swiglu")
EXPERT_PRECISIONS = ("bf16", "fp8")  # moe.expert_precision: what the memory model counts for each
DENSE_PRECISIONS = ("bf16", "fp8")  # model.dense_precision (model/dense_fp8.py): likewise
FP8_DENSE_MULTIPLE = 16  # a dense linear runs in FP8 where both weight dimensions are multiples of this
FP8_TILE = 128  # 1×128 activation tiles, 128×128 weight blocks (kernels/fp8_quant.py's TILE)


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one row in 1×128-tiled E4M3: H bytes and a float32 scale per 128 columns (the FP8
    experts' saved x and their rows on the wire; ``kernels.fp8_quant.wire_row_bytes``)."""
    return hidden + 4 * -(-hidden // FP8_TILE)


class ArchError(ValueError):
    """An HF config is not one ray_moe can build; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling (transformers' ``_compute_yarn_parameters``): the inverse frequencies
    blend interpolated (/ ``factor``) and original ones over a linear ramp between the correction
    dimensions of ``beta_fast`` / ``beta_slow`` rotations at ``original_max_position_embeddings``
    (floored/ceiled when ``truncate``); cos and sin are multiplied by ``attention_factor``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 · mscale · ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ArchSpec:
    """Everything the model builder needs, in one family-independent form.

    ``moe_layers[i]`` says whether block i has a routed-expert FFN (else a dense SwiGLU of
    ``dense_hidden``). Routing: ``scoring`` softmax | sigmoid; ``norm_topk_prob`` renormalises
    the chosen weights; ``n_group``/``topk_group`` limit the choice to the best groups;
    ``routed_scaling_factor`` scales the weights; ``score_bias`` adds the aux-loss-free balancing
    bias to the scores used for the choice (not to the weights). ``shared_hidden`` > 0 adds a
    shared SwiGLU expert beside the routed ones.

    ``positions``: ``rope`` (rotary, ``rotary_dim`` of each head) or ``learned`` (an absolute
    position table [max_position_embeddings, H] added to the embeddings; the byte model).
    ``rms_norm_eps`` None: ``torch.nn.RMSNorm``'s default (float32's machine epsilon, in which
    it normalises bf16 inputs too).
    ``init``: the initial weights without a checkpoint: ``normal`` (the HF families: linear and
    embedding weights N(0, init_std²), biases 0, norms 1) or ``byte`` (embeddings N(0, 1),
    positions N(0, init_std²), linear weights U(±1/√fan_in), norms 1).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float | None
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    init_std: float
    num_experts: int
    top_k: int
    expert_hidden: int
    dense_hidden: int
    moe_layers: tuple[bool, ...]
    scoring: str
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    score_bias: bool
    shared_hidden: int
    positions: str = "rope"
    init: str = "normal"
    # multi-head latent attention (attention="mla"): head_dim is the query/key head dim
    # (qk_nope + qk_rope), rotary_dim the rope part (the last dims of a head), v_head_dim the value's
    attention: str = "gqa"
    q_lora_rank: int = 0  # 0: one q projection
    kv_lora_rank: int = 0
    v_head_dim: int = 0  # 0: head_dim
    rope_interleave: bool = False  # the rope part's dims in (even, odd) pairs (DeepSeek's checkpoints)
    yarn: Yarn | None = None
    attn_scale: float = 0.0  # the softmax scale; 0: head_dim ** -0.5
    sliding_window: int = 0  # keys within this many positions of the query, on sliding_layers
    sliding_layers: tuple[bool, ...] = ()
    attn_sinks: bool = False  # a learned logit per head beside the keys (gpt-oss)
    router_bias: bool = False  # a learned [E] bias on the router logits (gpt-oss)
    expert_bias: bool = False  # biases on each expert's gate|up and down projections (gpt-oss)
    activation: str = "swiglu"  # swiglu | clamped_swiglu (gpt-oss: (up + 1) · gate · σ(α · gate))
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    qk_norm_whole: bool = False  # q/k RMSNorm over the whole projection, not per head (OLMoE)

    @classmethod
    def byte(cls, *, vocab_size: int, d_model: int, n_heads: int, n_layers: int, seq_len: int,
             num_experts: int, top_k: int, expert_hidden: int, dense_first_layer: bool = False,
             dense_hidden: int = 0) -> "ArchSpec":
        """The byte-level model (``model.arch: byte``) from its ray_moe keys: learned absolute
        positions of ``seq_len``, multi-head attention without biases or q/k norm, softmax top-k
        renormalised, every block an MoE block but (``dense_first_layer``) the first, a dense
        SwiGLU of ``dense_hidden`` (0: 4 * d_model)."""
        spec = cls(family=BYTE, vocab_size=vocab_size, hidden_size=d_model, num_layers=n_layers,
                   num_heads=n_heads, num_kv_heads=n_heads, head_dim=d_model // n_heads if n_heads else 0,
                   rotary_dim=0, rope_theta=0.0, rms_norm_eps=None, qk_norm=False, qkv_bias=False,
                   o_bias=False, tie_word_embeddings=False, max_position_embeddings=seq_len, init_std=0.02,
                   num_experts=num_experts, top_k=top_k, expert_hidden=expert_hidden,
                   dense_hidden=dense_hidden or 4 * d_model,
                   moe_layers=tuple(not (i == 0 and dense_first_layer) for i in range(n_layers)),
                   scoring="softmax", norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                   score_bias=False, shared_hidden=0, positions="learned", init="byte")
        spec.check()
        return spec

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ArchSpec":
        """Parse an HF config dict (as in ``config.json``). Raises :class:`ArchError`."""
        c = _Keys(hf)
        family = family_of(hf)
        H, heads = c.int("hidden_size"), c.int("num_attention_heads")
        kv = c.int("num_key_value_heads", heads)
        head_dim = c.int("head_dim", None) or 0
        if family == "deepseek_v3":  # transformers sets head_dim to the rope part; MLA's q/k heads are wider
            head_dim = c.int("qk_nope_head_dim") + c.int("qk_rope_head_dim")
        if not head_dim:
            if H % heads:
                raise ArchError(f"hidden_size={H} is not divisible by num_attention_heads={heads} "
                                "(and no head_dim is given)")
            head_dim = H // heads
        if heads % kv:
            raise ArchError(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv}")
        c.require("hidden_act", "silu", ("silu",))
        if c.num("attention_dropout", 0.0) != 0.0:
            raise ArchError(f"attention_dropout={hf['attention_dropout']} is not supported; supported: 0.0")
        theta, partial, yarn = _rope(c, family)
        if family == "minimax_m2":  # released configs give the rope part as rotary_dim (transformers reads it so)
            rope = c.get("rope_parameters", None) or {}
            rotary = c.int("rotary_dim", None)
            partial = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor",
                                                                   rotary / head_dim if rotary else 1.0)))
        rotary_dim = c.int("qk_rope_head_dim") if family == "deepseek_v3" else int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ArchError(f"partial_rotary_factor={partial} gives a rotary dimension of {rotary_dim} of "
                            f"head_dim={head_dim}; it must be even and in (0, head_dim]")
        L = c.int("num_hidden_layers")
        common = dict(
            family=family, vocab_size=c.int("vocab_size"), hidden_size=H, num_layers=L, num_heads=heads,
            num_kv_heads=kv, head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=theta,
            rms_norm_eps=c.num("rms_norm_eps", 1e-6 if family in ("qwen3_moe", "deepseek_v3", "minimax_m2") else 1e-5),
            tie_word_embeddings=c.bool("tie_word_embeddings", False),
            max_position_embeddings=c.int("max_position_embeddings", 32768),
            init_std=c.num("initializer_range", 0.02),
        )
        if family == "qwen3_moe":
            if c.bool("use_sliding_window", False):
                raise ArchError("use_sliding_window=true is not supported; supported: false")
            E = c.int("num_experts", None) or c.int("num_local_experts")
            step = c.int("decoder_sparse_step", 1)
            if step < 1:
                raise ArchError(f"decoder_sparse_step={step} must be >= 1")
            dense = set(c.get("mlp_only_layers", None) or [])
            bias = c.bool("attention_bias", False)
            spec = cls(**common, qk_norm=True, qkv_bias=bias, o_bias=bias,
                       num_experts=E, top_k=c.int("num_experts_per_tok"),
                       expert_hidden=c.int("moe_intermediate_size"), dense_hidden=c.int("intermediate_size"),
                       moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(L)),
                       scoring="softmax", norm_topk_prob=c.bool("norm_topk_prob", False), n_group=1,
                       topk_group=1, routed_scaling_factor=1.0, score_bias=False, shared_hidden=0)
        elif family == "mixtral":
            if c.get("sliding_window", None) is not None:
                raise ArchError(f"sliding_window={hf['sliding_window']} is not supported; supported: null (off)")
            if c.num("router_jitter_noise", 0.0) != 0.0:
                raise ArchError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported; supported: 0.0")
            I = c.int("intermediate_size")
            spec = cls(**common, qk_norm=False, qkv_bias=False, o_bias=False,
                       num_experts=c.int("num_local_experts"), top_k=c.int("num_experts_per_tok"),
                       expert_hidden=I, dense_hidden=I, moe_layers=(True,) * L, scoring="softmax",
                       norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                       score_bias=False, shared_hidden=0)
        elif family == "deepseek_v3":
            spec = cls(**common, **_deepseek_v3(c, heads, kv, yarn))
        elif family == "gpt_oss":
            spec = cls(**common, **_gpt_oss(c, L, yarn))
        elif family == "minimax_m2":
            c.require("scoring_func", "sigmoid", ("sigmoid",))
            c.require("use_routing_bias", True, (True,))
            c.require("use_qk_norm", True, (True,))
            c.require("qk_norm_type", "per_layer", ("per_layer",))
            if c.num("router_jitter_noise", 0.0) != 0.0:
                raise ArchError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported; supported: 0.0")
            I = c.int("intermediate_size")
            spec = cls(**common, qk_norm=True, qk_norm_whole=True, qkv_bias=False, o_bias=False,
                       num_experts=c.int("num_local_experts"), top_k=c.int("num_experts_per_tok"), expert_hidden=I,
                       dense_hidden=I, moe_layers=(True,) * L, scoring="sigmoid", norm_topk_prob=True, n_group=1,
                       topk_group=1, routed_scaling_factor=1.0, score_bias=True, shared_hidden=0)
        elif family == "olmoe":
            if c.get("clip_qkv", None) is not None:
                raise ArchError(f"clip_qkv={hf['clip_qkv']} is not supported; supported: null")
            bias = c.bool("attention_bias", False)
            I = c.int("intermediate_size")
            spec = cls(**common, qk_norm=True, qk_norm_whole=True, qkv_bias=bias, o_bias=bias,
                       num_experts=c.int("num_experts"), top_k=c.int("num_experts_per_tok"), expert_hidden=I,
                       dense_hidden=I, moe_layers=(True,) * L, scoring="softmax",
                       norm_topk_prob=c.bool("norm_topk_prob", False), n_group=1, topk_group=1,
                       routed_scaling_factor=1.0, score_bias=False, shared_hidden=0)
        else:  # glm4_moe
            I_moe = c.int("moe_intermediate_size")
            first_dense = c.int("first_k_dense_replace", 1)
            spec = cls(**common, qk_norm=c.bool("use_qk_norm", False), qkv_bias=c.bool("attention_bias", False),
                       o_bias=False, num_experts=c.int("n_routed_experts"), top_k=c.int("num_experts_per_tok"),
                       expert_hidden=I_moe, dense_hidden=c.int("intermediate_size"),
                       moe_layers=tuple(i >= first_dense for i in range(L)), scoring="sigmoid",
                       norm_topk_prob=c.bool("norm_topk_prob", True), n_group=c.int("n_group", 1),
                       topk_group=c.int("topk_group", 1),
                       routed_scaling_factor=c.num("routed_scaling_factor", 1.0), score_bias=True,
                       shared_hidden=I_moe * c.int("n_shared_experts", 1))
        spec.check()
        return spec

    def check(self) -> None:
        """Ranges that every family shares; raises :class:`ArchError` naming the HF key."""
        for key, v in (("vocab_size", self.vocab_size), ("hidden_size", self.hidden_size),
                       ("num_hidden_layers", self.num_layers), ("num_attention_heads", self.num_heads),
                       ("num_key_value_heads", self.num_kv_heads), ("head_dim", self.head_dim),
                       ("experts", self.num_experts), ("num_experts_per_tok", self.top_k),
                       ("expert intermediate size", self.expert_hidden)):
            if v < 1:
                raise ArchError(f"{key}={v} must be >= 1")
        if self.attention not in ATTENTIONS:
            raise ArchError(f"attention={self.attention!r} is not one of {', '.join(ATTENTIONS)}")
        if self.activation not in ACTIVATIONS:
            raise ArchError(f"activation={self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ArchError(f"layer_types has {len(self.sliding_layers)} entries; num_hidden_layers="
                            f"{self.num_layers}")
        if any(self.sliding_layers) and self.sliding_window < 1:
            raise ArchError(f"sliding_window={self.sliding_window} must be >= 1 where layer_types names "
                            "sliding_attention")
        if self.positions not in POSITIONS:
            raise ArchError(f"positions={self.positions!r} is not one of {', '.join(POSITIONS)}")
        if self.init not in INITS:
            raise ArchError(f"init={self.init!r} is not one of {', '.join(INITS)}")
        if self.positions == "learned" and self.max_position_embeddings < 1:
            raise ArchError(f"max_position_embeddings={self.max_position_embeddings} must be >= 1")
        if not any(self.moe_layers):
            raise ArchError("the config has no MoE layer (every layer is dense); ray_moe trains MoE models")
        if any(not m for m in self.moe_layers) and self.dense_hidden < 1:
            raise ArchError(f"intermediate_size={self.dense_hidden} must be >= 1 for the dense layers")
        if not self.top_k <= self.num_experts:
            raise ArchError(f"num_experts_per_tok={self.top_k} must be <= the number of experts {self.num_experts}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ArchError(f"n_group={self.n_group} must be >= 1 and divide n_routed_experts={self.num_experts}")
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ArchError(f"n_group={self.n_group} leaves {per_group} expert per group; group scores "
                            "sum each group's best two")
        if not 1 <= self.topk_group <= self.n_group:
            raise ArchError(f"topk_group={self.topk_group} must be between 1 and n_group={self.n_group}")
        if self.top_k > self.topk_group * per_group:
            raise ArchError(f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group="
                            f"{self.topk_group} groups ({self.topk_group * per_group})")

    # ------------------------------------------------------------------ sizes
    def param_counts(self) -> dict[str, int]:
        """Parameters by kind: ``replicated`` (attention, norms, embeddings, head, routers, dense
        and shared MLPs: on every rank), ``per_expert`` (one routed expert's w13 + w2) and
        ``experts`` (all routed experts of all layers); ``total``."""
        H = self.hidden_size
        attn = self.attention_params()
        n_moe = sum(self.moe_layers)
        n_dense = self.num_layers - n_moe
        per_expert = 3 * H * self.expert_hidden + (2 * self.expert_hidden + H) * self.expert_bias
        router = (H + self.router_bias) * self.num_experts
        replicated = (
            self.num_layers * (attn + 2 * H)  # attention + its two norms
            + n_dense * 3 * H * self.dense_hidden
            + n_moe * (router + 3 * H * self.shared_hidden)  # routers, shared experts
            + self.vocab_size * H * (1 if self.tie_word_embeddings else 2) + H  # embeddings, head, final norm
            + (self.max_position_embeddings * H if self.positions == "learned" else 0)
        )
        experts = n_moe * self.num_experts * per_expert
        return {"replicated": replicated, "per_expert": per_expert, "experts": experts,
                "total": replicated + experts}

    def fp8_expert_cache_bytes(self) -> int:
        """Bytes of one expert slot's FP8 weight copies: w13 [H, 2I] and w2 [I, H] in E4M3, each in
        its own layout and transposed (2 · 3·H·I bytes), and one float32 scale per 128×128 block
        of each (``kernels.fp8_expert_ffn.Fp8Weights``)."""
        H, I = self.hidden_size, self.expert_hidden
        hb, ib = -(-H // FP8_TILE), -(-I // FP8_TILE)
        return 2 * 3 * H * I + 4 * (hb * 2 * ib + ib * hb)

    def attention_params(self) -> int:
        """Parameters of one block's attention: q/k/v/o (GQA) or MLA's low-rank projections and
        their norms; biases, q/k norms and sinks where the spec has them."""
        H, D, heads = self.hidden_size, self.head_dim, self.num_heads
        if self.attention == "mla":
            qr, kvr, R, V = self.q_lora_rank, self.kv_lora_rank, self.rotary_dim, self.v_head_dim or D
            q = (H * qr + qr * self.qkv_bias + qr + qr * heads * D) if qr else H * heads * D
            kv = H * (kvr + R) + (kvr + R) * self.qkv_bias + kvr + kvr * heads * (D - R + V)
            return q + kv + heads * V * H + H * self.o_bias
        q, kv = heads * D, self.num_kv_heads * D
        attn = H * (q + 2 * kv) + q * H
        norms = (q + kv if self.qk_norm_whole else 2 * D) * self.qk_norm
        return attn + (q + 2 * kv) * self.qkv_bias + H * self.o_bias + norms + heads * self.attn_sinks

    def dense_linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) features of the dense linears of the blocks (model.dense_precision's scope):
        the attention projections, a shared expert's and a dense MLP's gate/up/down."""
        H, D, heads, kv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        if self.attention == "mla":
            qr, kvr, R, V = self.q_lora_rank, self.kv_lora_rank, self.rotary_dim, self.v_head_dim or D
            q = [(H, qr), (qr, heads * D)] if qr else [(H, heads * D)]
            attn = q + [(H, kvr + R), (kvr, heads * (D - R + V)), (heads * V, H)]
        else:
            attn = [(H, heads * D), (H, kv * D), (H, kv * D), (heads * D, H)]
        mlps = [n for n, used in ((self.shared_hidden, any(self.moe_layers)),
                                  (self.dense_hidden, not all(self.moe_layers))) if n and used]
        return attn + [shape for n in mlps for shape in ((H, n), (H, n), (n, H))]

    def fp8_dense_backward_bytes_per_token(self) -> float:
        """The FP8 dense linears' backward temporaries per token at the largest linear that runs in
        FP8 (torchao's tensorwise recipe; the input is saved in the model dtype as in bf16): the
        output gradient cast for dX and for dW and the input cast for dW, E4M3/E5M2, each with a
        column-major copy for the FP8 GEMM (2·(in + out) bytes), and the cast's own float32
        temporaries, which eager torchao makes (the scaled copy and its clamp: 8 bytes an element
        of the larger operand) and compiled blocks fuse away: an upper bound either way."""
        return float(max((2 * (i + o) + 8 * max(i, o) for i, o in self.dense_linear_shapes()
                          if i % FP8_DENSE_MULTIPLE == 0 and o % FP8_DENSE_MULTIPLE == 0), default=0))

    def memory_per_rank(self, world_size: int, clone_slots: int = 0, bytes_per_param: int = 16, *,
                        moments: str = "float32", zero_stage: int = 0, elem: int = 2,
                        bucket_size: int = 40_000_000, grad_reduce_dtype: str = "float32",
                        dp: int = 1, expert_precision: str = "bf16") -> dict[str, float]:
        """Training state of one rank of ``world_size`` = EP × ``dp`` (the rank mesh: experts split
        over an EP group of ``world_size / dp`` ranks, each EP group replicated ``dp`` times; the
        rest replicated over all ranks): its parameters (replicated + E/W + ``clone_slots`` experts per MoE layer; a
        clone slot holds its weight and gradient, no master or moments, as with bf16 weights and
        float32 masters; a float32 model's parameters are their own masters, ``elem`` 4 is
        approximate).

        ``state_bytes`` (the "Memory per rank at real size" table of docs/ARCHITECTURE.md): params × ``bytes_per_param`` (16 =
        bf16 weight + bf16 gradient + fp32 master + fp32 Adam moments; clone slots charged the
        same, unlike the rest, which follows the optimizer). Not counted: the clone gradients'
        exchange buffers (float32 sums keep each layer's received rows until after backward,
        ``worker/clone_grads.py``: about n_moe × clone_slots × per_expert × ``elem`` bytes). The rest follows what
        the optimizer holds (``elem``-byte weights: 2 for bf16): ``weights``, ``masters``
        (float32), ``moments`` (2 × 4 or, ``moments="bfloat16"``, 2 × 2 bytes), the gradients at
        the end of backward (``grads_backward``: bf16 for the experts; for the replicated
        parameters bf16 at ``zero_stage`` 0, the persistent float32 bucket buffers and the
        reduced chunks at 1, the reduced chunks and two buckets in flight at 2) and while they are
        reduced and applied (``grads_update``: float32 master gradients and the flat float32
        all-reduce buffer at W ≥ 2 and stage 0; on one rank the bf16 gradients, which the one-pass
        update reads as they are; with clone slots and float32 ``grad_reduce_dtype``, the experts'
        float32 master gradients, into which the clone sums go), and the totals ``backward_bytes`` (what
        activations come on top of) and ``update_bytes`` (activations freed). Stages 1 and 2
        divide the replicated masters and moments by W, and with ``dp`` > 1 the experts' by DP
        (ZeRO over the replicas: their gradients reduce-scattered through float32 buckets, every
        one kept at stage 1, two at stage 2, plus the reduced chunks); at stage 0 and ``dp`` > 1
        the replicas' sums take one bucket per MoE layer in ``grad_reduce_dtype`` until backward
        ends. ``expert_precision="fp8"`` (``moe.expert_precision``) adds ``fp8_weights``, each MoE
        layer's FP8 weight cache (``kernels.fp8_expert_ffn.Fp8WeightCache``: w13 and w2 of every slot
        in E4M3 in both orientations, one float32 scale per 128×128 block), kept between steps.
        Activations are separate (:meth:`activation_bytes_per_token`, :meth:`peak_bytes_per_rank`)."""
        if dp < 1 or world_size % dp:
            raise ArchError(f"DP {dp} does not divide {world_size} ranks")
        ep = world_size // dp
        if self.num_experts % ep:
            raise ArchError(f"{self.num_experts} experts do not divide over {ep} ranks (EP)")
        if moments not in ("float32", "bfloat16"):
            raise ArchError(f"moments={moments!r} is not allowed; choose float32 or bfloat16")
        if zero_stage not in (0, 1, 2):
            raise ArchError(f"zero_stage={zero_stage} is not allowed; choose 0, 1 or 2")
        _check_precision(expert_precision)
        c = self.param_counts()
        n_moe = sum(self.moe_layers)
        native = n_moe * (self.num_experts // ep) * c["per_expert"]
        experts = native + n_moe * clone_slots * c["per_expert"]  # clone slots: weights and gradients
        rep = c["replicated"]
        params = rep + experts
        W = world_size
        shard = W if zero_stage and W > 1 else 1
        eshard = dp if zero_stage and dp > 1 else 1  # ZeRO over the replicas for the experts
        moment_bytes = 8 if moments == "float32" else 4
        reduce_bytes = 4 if grad_reduce_dtype == "float32" else 2
        weights = params * elem
        masters = native * 4 / eshard + rep * 4 / shard  # (no master nor moments for a clone slot)
        moment_total = native * moment_bytes / eshard + rep * moment_bytes / shard
        # the experts' gradients the update reads: bf16 as backward left them, or, where clone sums
        # are added in float32, the native slots' float32 master gradients
        expert_update = native * 4 if clone_slots and grad_reduce_dtype == "float32" else experts * elem
        expert_backward = experts * elem
        if eshard > 1:  # buckets (float32) and the reduced chunks; the bf16 gradients freed into them
            expert_backward = (experts * 4 if zero_stage == 1 else min(experts, 2 * bucket_size) * 4) + experts * 4 / dp
            expert_update = expert_backward
        elif dp > 1:  # one bucket per MoE layer, summed over the replicas, until backward ends
            expert_backward += experts * reduce_bytes
        if shard > 1:
            buckets = rep * 4 if zero_stage == 1 else min(rep, 2 * bucket_size) * 4  # float32 buffers
            grads_backward = expert_backward + buckets + rep * 4 / W  # + the reduced chunks
            grads_update = grads_backward - expert_backward + expert_update
        else:
            grads_backward = expert_backward + rep * elem
            # W ≥ 2: the float32 master gradients + the flat all-reduce buffer (in grad_reduce_dtype); one rank: the bf16
            # gradients, read as they are by the one-pass update (CUDA's default, ``alone``)
            grads_update = expert_update + (rep * (4 + reduce_bytes) if W > 1 else rep * elem)
        slots = self.num_experts // ep + clone_slots
        fp8_weights = n_moe * slots * self.fp8_expert_cache_bytes() if expert_precision == "fp8" else 0
        fixed = weights + masters + moment_total + fp8_weights
        return {"params": params, "state_bytes": params * bytes_per_param,
                "replicated_bytes": rep * bytes_per_param, "weights": weights, "masters": masters,
                "moments": moment_total, "fp8_weights": fp8_weights,
                "grads_backward": grads_backward, "grads_update": grads_update,
                "backward_bytes": fixed + grads_backward, "update_bytes": fixed + grads_update}

    # The backward working set (a layer's gradients and temporaries, which the saved-tensor count
    # misses) as a fraction of the largest layer's saved bytes, per checkpointing mode: measured on
    # an H100 at Qwen3-30B-A3B's layer shape (2 layers, 8 x 1024 tokens, measured 2026-11-25:
    # 404,785 / 371,725 / 308,984 bytes per token measured, 261,120 / 290,304 / 138,752 counted).
    BACKWARD_WORKING_SET = MappingProxyType({"none": 1.10, "moe": 0.62, "full": 1.30})

    def activation_peak_bytes_per_token(self, checkpointing: str, world_size: int, elem: int = 2,
                                        expert_precision: str = "bf16", dense_precision: str = "bf16") -> float:
        """What the GPU holds per token at the peak of backward beside the training state: the
        saved tensors (:meth:`activation_bytes_per_token`) plus the backward working set
        (:data:`BACKWARD_WORKING_SET` × the largest bf16 layer's saved bytes; measured factors:
        gradients and temporaries, in the model dtype whatever the experts' precision) and, with FP8
        experts, their backward's own copies (:meth:`fp8_backward_bytes_per_token`); with FP8 dense
        linears (``dense_precision``), theirs (:meth:`fp8_dense_backward_bytes_per_token`): one
        linear's or one expert layer's at a time, so the larger counts."""
        if dense_precision not in DENSE_PRECISIONS:
            raise ArchError(f"dense_precision={dense_precision!r} is not allowed; choose {' or '.join(DENSE_PRECISIONS)}")
        saved = self.activation_bytes_per_token(checkpointing, world_size, elem, expert_precision)
        extra = max(self.fp8_backward_bytes_per_token(world_size) if expert_precision == "fp8" else 0.0,
                    self.fp8_dense_backward_bytes_per_token() if dense_precision == "fp8" else 0.0)
        return saved + self.BACKWARD_WORKING_SET[checkpointing] * self._largest_layer_bytes(world_size, elem) + extra

    def fp8_backward_bytes_per_token(self, world_size: int) -> float:
        """The FP8 experts' backward temporaries per token beside the bf16 path's (at dW13, their
        largest moment): x's rows dequantised (float32, then in the model dtype: 6·H a received row)
        and the two operands of dW13 quantised along the tokens (E4M3 a pair: H + 2·I, plus the
        scales)."""
        H, I, K = self.hidden_size, self.expert_hidden, self.top_k
        ranks = min(K, world_size) if world_size > 1 else 1
        return 6.0 * H * ranks + K * (H + 2 * I) * (1 + 4 / FP8_TILE)

    def loss_bytes(self, tokens: int, elem: int = 2, chunk: int = 0) -> dict[str, float]:
        """The LM loss's memory at ``tokens`` rows per rank (``model/loss.py``, chunked; ``chunk``
        0 = its automatic rule): ``forward`` at the end of the forward (the hidden-state gradient
        [N, H], the head's float32 weight gradient [V, H], and one chunk's logits in the compute
        dtype, in float32 and their gradient) and ``backward`` (both gradients kept, scaled into
        new tensors)."""
        V, H = self.vocab_size, self.hidden_size
        rows = chunk or _auto_chunk(tokens, V, H)
        dh, dw = tokens * H * elem, V * H * 4
        return {"chunk_rows": rows, "forward": dh + dw + rows * V * (elem + 4 + elem),
                "backward": 2 * dh + dw + V * H * elem}

    def peak_bytes_per_rank(self, world_size: int, tokens: int, checkpointing: str, *, clone_slots: int = 0,
                            moments: str = "float32", zero_stage: int = 0,
                            elem: int = 2, loss_chunk: int = 0, grad_reduce_dtype: str = "float32",
                            dp: int = 1, expert_precision: str = "bf16",
                            dense_precision: str = "bf16") -> dict[str, float]:
        """One rank's peak memory for a training step (what ``torch.cuda.max_memory_allocated``
        reports; allocator slack not counted): the state at the end of backward plus the largest
        of the end of forward (saved activations + the loss's forward) and the peak of backward
        (activations with the working set + the loss's kept gradients), or the update's state.
        ``dp``: the replicas of the rank mesh (EP = ``world_size / dp``); ``expert_precision``:
        ``moe.expert_precision`` (fp8: the weight cache, FP8 saved rows, the FP8 backward's copies);
        ``dense_precision``: ``model.dense_precision`` (fp8: the FP8 dense backward's copies)."""
        state = self.memory_per_rank(world_size, clone_slots, moments=moments, zero_stage=zero_stage, elem=elem,
                                     grad_reduce_dtype=grad_reduce_dtype, dp=dp, expert_precision=expert_precision)
        ep = world_size // dp  # the ranks a token's rows go to
        loss = self.loss_bytes(tokens, elem, loss_chunk)
        saved = tokens * self.activation_bytes_per_token(checkpointing, ep, elem, expert_precision)
        backward = tokens * self.activation_peak_bytes_per_token(checkpointing, ep, elem, expert_precision,
                                                                 dense_precision)
        acts = max(saved + loss["forward"], backward + loss["backward"])
        peak = max(state["backward_bytes"] + acts, state["update_bytes"])
        return {**state, "activations": acts, "loss_forward": loss["forward"], "peak": peak}

    def smallest_world_size(self, gpu_bytes: float, tokens: int, checkpointing: str = "full",
                            **kw: Any) -> int | None:
        """The smallest W (a divisor of the expert count) whose :meth:`peak_bytes_per_rank` fits
        ``gpu_bytes``; None if none does."""
        for w in (w for w in range(1, self.num_experts + 1) if self.num_experts % w == 0):
            if self.peak_bytes_per_rank(w, tokens, checkpointing, **kw)["peak"] <= gpu_bytes:
                return w
        return None

    def _largest_layer_bytes(self, world_size: int, elem: int) -> float:
        return max(self._layer_bytes(world_size, elem))

    def activation_bytes_per_token(self, checkpointing: str, world_size: int, elem: int = 2,
                                   expert_precision: str = "bf16") -> float:
        """An estimate of the activation bytes one token keeps for backward over the whole model
        (bf16: ``elem`` = 2), by counting what the layers save: attention (norm in float32, q/k/v
        after norm and RoPE, the attention output), the MoE FFN (norm, router scores, the token
        rows received by ~min(K, W) ranks, gate|up and SwiGLU output per chosen expert, the shared
        expert) and, for ``full``, one layer being recomputed. Not counted here: the backward
        working set (:meth:`activation_peak_bytes_per_token`), the logits (:meth:`loss_bytes`)
        and allocator slack. ``expert_precision="fp8"``: the received rows are kept as the FP8
        experts keep them, E4M3 and 1×128 scales (:func:`fp8_row_bytes`); gate|up stays in the
        model dtype (``kernels.fp8_expert_ffn``)."""
        _check_precision(expert_precision)
        attn, _, dense = self._layer_parts(world_size, elem)
        H = self.hidden_size
        layers = self._layer_bytes(world_size, elem, expert_precision)
        if checkpointing == "none":
            return float(sum(layers))
        if checkpointing == "moe":
            return float(sum(attn + elem * H + (0 if m else dense) for m in self.moe_layers) + max(layers))
        return float(self.num_layers * elem * H + max(layers))  # full: block inputs + one replay

    def _layer_parts(self, world_size: int, elem: int, expert_precision: str = "bf16") -> tuple[float, float, float]:
        """Saved bytes per token of (attention, MoE FFN, dense FFN) of one block."""
        H, q, kv, I, K = (self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                          self.expert_hidden, self.top_k)
        norm = (2 * 2 + elem) * H  # float32 copy + its normalised cast
        attn = norm + elem * (3 * q + 4 * kv) + elem * (q + kv) * 2 * self.qk_norm + elem * 2 * q
        if self.attention == "mla":  # q, the expanded keys and values, the output; the latents and their norm
            V = self.num_heads * (self.v_head_dim or self.head_dim)
            lat = self.kv_lora_rank + self.rotary_dim + self.q_lora_rank
            attn = norm + elem * (3 * q + 2 * q + 2 * V + 2 * V) + (4 + elem) * 2 * lat
        ranks = min(K, world_size) if world_size > 1 else 1
        row = fp8_row_bytes(H) if expert_precision == "fp8" else elem * H  # a received row as the experts keep it
        moe = norm + 12 * self.num_experts + row * ranks + K * 3 * elem * I + 4 * elem * self.shared_hidden
        dense = norm + 4 * elem * self.dense_hidden
        return attn, moe, dense

    def _layer_bytes(self, world_size: int, elem: int, expert_precision: str = "bf16") -> list[float]:
        attn, moe, dense = self._layer_parts(world_size, elem, expert_precision)
        return [attn + (moe if m else dense) for m in self.moe_layers]

    def active_params_per_token(self) -> int:
        """Parameters a token passes through (the 'A3B' of Qwen3-30B-A3B): replicated minus the
        unused embedding rows, plus top_k experts per MoE layer."""
        c = self.param_counts()
        n_moe = sum(self.moe_layers)
        return c["replicated"] - (self.vocab_size - 1) * self.hidden_size + n_moe * self.top_k * c["per_expert"]


@dataclass(frozen=True)
class ResolvedArch:
    """An architecture resolved once, on the driver, and sent to every worker: the spec the model
    is built from and the HF config in effect (None for the byte model), which
    ``model.init_from``'s weight map and ``ray-moe export`` read."""

    spec: ArchSpec
    hf_config: dict[str, Any] | None = None


def _check_precision(expert_precision: str) -> None:
    if expert_precision not in EXPERT_PRECISIONS:
        raise ArchError(f"expert_precision={expert_precision!r} is not allowed; choose {' or '.join(EXPERT_PRECISIONS)}")


def _auto_chunk(rows: int, vocab: int, hidden: int) -> int:
    """``ray_moe.model.loss.auto_chunk`` (this module imports no torch): rows per logits chunk."""
    per = -(-vocab // hidden)
    c = 1 << max(0, (-(-rows // per) - 1).bit_length())
    floor = 1 << max(0, ((64 * 2**20) // (4 * vocab)).bit_length() - 1)
    return max(1, min(max(c, floor), rows))


def family_of(hf: Mapping[str, Any]) -> str:
    """The family of an HF config from ``model_type`` (or ``architectures``)."""
    model_type = hf.get("model_type")
    if model_type is None:
        archs = hf.get("architectures") or []
        by_class = {v: k for k, v in ARCHITECTURES.items()}
        model_type = next((by_class[a] for a in archs if a in by_class), None)
        if model_type is None:
            raise ArchError(f"the HF config has no model_type and architectures={archs} names none of "
                            f"{', '.join(ARCHITECTURES.values())}")
    model_type = ALIASES.get(model_type, model_type)
    if model_type not in FAMILIES:
        raise ArchError(f"model_type={model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    return model_type


def _rope(c: "_Keys", family: str) -> tuple[float, float, Yarn | None]:
    """(rope_theta, partial_rotary_factor, YaRN or None) from ``rope_parameters`` (transformers 5)
    or the top-level ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` (older
    configs). YaRN is read for deepseek_v3 and gpt_oss (whose transformers code this follows;
    gpt-oss's default is YaRN x32), every other rope type is refused."""
    params = c.get("rope_parameters", None) or {}
    scaling = c.get("rope_scaling", None) or {}
    if family == "gpt_oss" and not params and not scaling:
        scaling = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                   "original_max_position_embeddings": 4096}
    yarn = None
    for where, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = d.get("rope_type", d.get("type", "default"))
        if kind == "yarn" and family in ("deepseek_v3", "gpt_oss"):
            yarn = _yarn(c, where, d)
        elif kind != "default":
            allowed = "default, yarn" if family in ("deepseek_v3", "gpt_oss") else "default"
            raise ArchError(f"{where}.rope_type={kind!r} is not supported for {family}; supported: {allowed}")
    default_theta = {"mixtral": 1e6, "gpt_oss": 150000.0, "minimax_m2": 5e6}.get(family, 10000.0)
    theta = float(params.get("rope_theta", c.get("rope_theta", default_theta)))
    partial = 1.0
    if family == "glm4_moe":  # the only family whose transformers code reads it (default 0.5)
        partial = float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5)))
    return theta, partial, yarn


def _yarn(c: "_Keys", where: str, d: Mapping[str, Any]) -> Yarn:
    """:class:`Yarn` of a ``rope_parameters`` / ``rope_scaling`` dict, as transformers reads it."""
    if "original_max_position_embeddings" not in d:
        raise ArchError(f"{where} (yarn) has no 'original_max_position_embeddings'")
    original = int(d["original_max_position_embeddings"])
    factor = d.get("factor")
    factor = float(factor) if factor is not None else c.int("max_position_embeddings") / original
    attention_factor = d.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = d.get("mscale"), d.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return Yarn(factor=factor, original_max_position_embeddings=original,
                beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
                truncate=bool(d.get("truncate", True)), attention_factor=float(attention_factor))


def _rope_dict(c: "_Keys") -> Mapping[str, Any]:
    return c.get("rope_parameters", None) or c.get("rope_scaling", None) or {}


def _deepseek_v3(c: "_Keys", heads: int, kv: int, yarn: Yarn | None) -> dict[str, Any]:
    """The deepseek_v3 fields of an :class:`ArchSpec` (GLM's MoE blocks + MLA)."""
    if kv != heads:
        raise ArchError(f"num_key_value_heads={kv} is not supported for deepseek_v3 (multi-head latent "
                        f"attention expands every head); supported: num_attention_heads={heads}")
    for key, allowed in (("topk_method", ("noaux_tc",)), ("scoring_func", ("sigmoid",))):
        c.require(key, allowed[0], allowed)
    head_dim = c.int("qk_nope_head_dim") + c.int("qk_rope_head_dim")
    scale = head_dim ** -0.5
    rope = _rope_dict(c)
    if yarn is not None and rope.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
        m = yarn_mscale(yarn.factor, rope["mscale_all_dim"])
        scale = scale * m * m
    I_moe = c.int("moe_intermediate_size")
    first_dense = c.int("first_k_dense_replace", 3)
    L = c.int("num_hidden_layers")
    return dict(qk_norm=False, qkv_bias=c.bool("attention_bias", False), o_bias=c.bool("attention_bias", False),
                num_experts=c.int("n_routed_experts"), top_k=c.int("num_experts_per_tok"),
                expert_hidden=I_moe, dense_hidden=c.int("intermediate_size"),
                moe_layers=tuple(i >= first_dense for i in range(L)), scoring="sigmoid",
                norm_topk_prob=c.bool("norm_topk_prob", True), n_group=c.int("n_group", 1) or 1,
                topk_group=c.int("topk_group", 1) or 1, routed_scaling_factor=c.num("routed_scaling_factor", 1.0),
                score_bias=True, shared_hidden=I_moe * c.int("n_shared_experts", 1),
                attention="mla", q_lora_rank=c.int("q_lora_rank", None) or 0, kv_lora_rank=c.int("kv_lora_rank"),
                v_head_dim=c.int("v_head_dim"), rope_interleave=c.bool("rope_interleave", True), yarn=yarn,
                attn_scale=scale)


def _gpt_oss(c: "_Keys", L: int, yarn: Yarn | None) -> dict[str, Any]:
    """The gpt_oss fields of an :class:`ArchSpec`."""
    types = c.get("layer_types", None) or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(L)]
    for t in types:
        if t not in ("sliding_attention", "full_attention"):
            raise ArchError(f"layer_types has {t!r}; supported: sliding_attention, full_attention")
    window = c.int("sliding_window", None) or 0
    bias = c.bool("attention_bias", True)
    return dict(qk_norm=False, qkv_bias=bias, o_bias=bias, num_experts=c.int("num_local_experts"),
                top_k=c.int("num_experts_per_tok"), expert_hidden=c.int("intermediate_size"),
                dense_hidden=c.int("intermediate_size"), moe_layers=(True,) * L, scoring="softmax",
                norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0, score_bias=False,
                shared_hidden=0, yarn=yarn, sliding_window=window,
                sliding_layers=tuple(t == "sliding_attention" for t in types), attn_sinks=True, router_bias=True,
                expert_bias=True, activation="clamped_swiglu", swiglu_alpha=c.num("swiglu_alpha", 1.702),
                swiglu_limit=c.num("swiglu_limit", 7.0))


class _Keys:
    """Typed reads of an HF config dict; errors name the key."""

    _MISSING = object()

    def __init__(self, hf: Mapping[str, Any]):
        self.hf = hf

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.hf:
            return self.hf[key]
        if default is self._MISSING:
            raise ArchError(f"the HF config has no {key!r}")
        return default

    def int(self, key: str, default: Any = _MISSING) -> Any:
        v = self.get(key, default)
        if v is None and default is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ArchError(f"{key}={v!r} must be an integer")
        return v

    def num(self, key: str, default: Any = _MISSING) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ArchError(f"{key}={v!r} must be a number")
        return float(v)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise ArchError(f"{key}={v!r} must be true or false")
        return v

    def require(self, key: str, default: Any, allowed: tuple) -> None:
        v = self.get(key, default)
        if v not in allowed:
            raise ArchError(f"{key}={v!r} is not supported; supported: {', '.join(map(str, allowed))}")


# ---------------------------------------------------------------------------------- presets
# HF config dicts by name (what ``model.hf_config: NAME`` loads). The real shapes are those of the
# published config.json files; the tiny ones train on CPU in minutes (vocab >= 256: the byte corpus).
_PRESETS = MappingProxyType({
    "qwen3-30b-a3b": MappingProxyType({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.001, "initializer_range": 0.02, "bos_token_id": 151643,
        "eos_token_id": 151645,
    }),
    "mixtral-8x7b": MappingProxyType({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None, "attention_dropout": 0.0,
        "router_aux_loss_coef": 0.02, "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": 1, "eos_token_id": 2,
    }),
    "glm-4.5-air": MappingProxyType({
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552,
        "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5, "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": True,
        "use_qk_norm": False, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "attention_dropout": 0.0, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "initializer_range": 0.02, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
    }),
    "deepseek-v3": MappingProxyType({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                              "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                              "type": "yarn"},
        "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 1,
    }),
    "kimi-k2": MappingProxyType({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
        "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0, "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                "type": "yarn"},
        "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 163584, "eos_token_id": 163585,
    }),
    "moonlight-16b-a3b": MappingProxyType({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
        "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 163584, "eos_token_id": 163585,
    }),
    "gpt-oss-20b": MappingProxyType({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "sliding_window": 128,  # layer_types: the published alternation (sliding first), transformers' default
        "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                               "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                               "truncate": False},
        "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0, "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu",
        "router_aux_loss_coef": 0.9, "tie_word_embeddings": False, "initializer_range": 0.02,
        "eos_token_id": 200002, "pad_token_id": 199999,
    }),
    "gpt-oss-120b": MappingProxyType({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
        "sliding_window": 128,  # layer_types: the published alternation (sliding first), transformers' default
        "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                               "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                               "truncate": False},
        "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0, "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu",
        "router_aux_loss_coef": 0.9, "tie_word_embeddings": False, "initializer_range": 0.02,
        "eos_token_id": 200002, "pad_token_id": 199999,
    }),
    "olmoe-1b-7b": MappingProxyType({
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
        "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None, "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False, "initializer_range": 0.02, "pad_token_id": 1, "eos_token_id": 50279,
    }),
    "minimax-m2": MappingProxyType({
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064,
        "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
        "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "num_local_experts": 256,
        "num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "hidden_act": "silu", "max_position_embeddings": 196608, "rms_norm_eps": 1e-6,
        "rope_theta": 5000000, "router_jitter_noise": 0.0, "attention_dropout": 0.0, "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 200034, "eos_token_id": 200020,
    }),
    "qwen3_moe-tiny": MappingProxyType({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256,
        "hidden_size": 96, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0],
        "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "tie_word_embeddings": False, "initializer_range": 0.02,
    }),
    "mixtral-tiny": MappingProxyType({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 256,
        "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "sliding_window": None, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "initializer_range": 0.02,
    }),
    "glm4_moe-tiny": MappingProxyType({
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 256,
        "hidden_size": 96, "intermediate_size": 256, "moe_intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5, "rope_theta": 10000.0, "attention_bias": True, "use_qk_norm": False,
        "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "initializer_range": 0.02,
    }),
    "deepseek_v3-tiny": MappingProxyType({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 256,
        "hidden_size": 96, "intermediate_size": 256, "moe_intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 12,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "qk_nope_head_dim": 16, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "initializer_range": 0.02,
    }),
    "gpt_oss-tiny": MappingProxyType({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 96,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 24, "num_local_experts": 12, "num_experts_per_tok": 2, "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 128, "truncate": False},
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "attention_bias": True,
        "attention_dropout": 0.0, "hidden_act": "silu", "tie_word_embeddings": False, "initializer_range": 0.02,
    }),
})
PRESETS = tuple(_PRESETS)


def preset(name: str) -> dict[str, Any]:
    """A fresh copy of preset ``name``'s HF config dict."""
    if name not in _PRESETS:
        raise ArchError(f"no preset {name!r}; presets: {', '.join(PRESETS)}")
    return json.loads(json.dumps(dict(_PRESETS[name])))


def load_hf_config(source: str) -> dict[str, Any]:
    """The HF config dict of ``source``: a preset name, a ``config.json`` file, or a directory
    holding one (a Hugging Face model directory)."""
    if source in _PRESETS:
        return preset(source)
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ArchError(f"{source!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                        "file or a directory holding one")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArchError(f"{str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ArchError(f"{str(path)!r} must hold a JSON object")
    return raw


def resolve(source: str, overrides: Mapping[str, Any]) -> tuple[ArchSpec, dict[str, Any]]:
    """(spec, the HF config in effect) for ``source`` (preset, file or directory; '' = none) with
    ``overrides`` (HF keys) on top."""
    hf = load_hf_config(source) if source else {}
    hf.update(overrides)
    return ArchSpec.from_hf(hf), hf


def main(argv: list[str] | None = None) -> int:
    """``python -m ray_moe.arch SOURCE [--world-sizes 8,16] [--tokens 16384] [--gpu-gib 80] [--expert-precision fp8] [--dense-precision fp8]``:
    parameters, then per world size the training state per rank (16 B/param unsharded; ZeRO
    stages 1 and 2 of the replicated parameters with float32 / bf16 moments), the activations at
    the peak of backward, the loss's logits and the peak per rank (full recompute) with both
    moment dtypes; then the smallest world size that fits the GPU, for an HF config (preset,
    config.json or directory)."""
    p = usage.ArgumentParser(prog="python -m ray_moe.arch", description=main.__doc__)
    p.add_argument("source", help=f"a preset ({', '.join(PRESETS)}), a config.json or a model directory")
    p.add_argument("--world-sizes", default="4,8,16", help="comma-separated ranks (GPUs), EP over all of them")
    p.add_argument("--ep", type=int, default=0,
                   help="the EP degree of a rank mesh (e.g. 8: one node of 8 GPUs); rows are then EP x DP for --dp")
    p.add_argument("--dp", default="1,2,4,8", help="with --ep: comma-separated DP degrees (replicas of the EP group)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank per step")
    p.add_argument("--clone-slots", type=int, default=0)
    p.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory for the fit (GiB)")
    p.add_argument("--headroom", type=float, default=0.9,
                   help="fraction of --gpu-gib the peak may use (allocator slack, CUDA context, NCCL)")
    p.add_argument("--expert-precision", choices=EXPERT_PRECISIONS, default="bf16",
                   help="moe.expert_precision: fp8 counts the FP8 weight cache, the FP8 saved rows and "
                        "the FP8 backward's copies")
    p.add_argument("--dense-precision", choices=DENSE_PRECISIONS, default="bf16",
                   help="model.dense_precision: fp8 counts the FP8 dense linears' backward copies")
    args = p.parse_args(argv)
    fp8 = {"expert_precision": args.expert_precision}
    peak_fp8 = {**fp8, "dense_precision": args.dense_precision}  # the dense linears change the peak only
    try:
        spec = ArchSpec.from_hf(load_hf_config(args.source))
    except ArchError as exc:
        print(f"python -m ray_moe.arch: error: {exc}", file=sys.stderr)
        return 2
    c = spec.param_counts()
    gib = 2**30
    budget = args.gpu_gib * gib * args.headroom
    variants = {"stage 0, fp32 moments": {}, "stage 1, fp32": {"zero_stage": 1},
                "stage 1, bf16": {"zero_stage": 1, "moments": "bfloat16"},
                "stage 2, fp32": {"zero_stage": 2}, "stage 2, bf16": {"zero_stage": 2, "moments": "bfloat16"}}
    print(f"{args.source}: {c['total'] / 1e9:.2f}B parameters ({c['replicated'] / 1e9:.2f}B replicated, "
          f"{c['experts'] / 1e9:.2f}B in {spec.num_experts} experts x {sum(spec.moe_layers)} layers), "
          f"{spec.active_params_per_token() / 1e9:.2f}B active per token; {args.tokens} tokens per rank, bf16"
          + (", FP8 experts (the weight cache in the state)" if args.expert_precision == "fp8" else "")
          + (", FP8 dense linears" if args.dense_precision == "fp8" else ""))
    print("| GPUs | params/rank | state/rank at the end of backward (GiB): " + " / ".join(variants)
          + " | activations at the peak of backward (GiB): none / moe / full | loss (GiB) "
          "| peak/rank with full recompute (GiB): " + " / ".join(variants) + " |")
    print("| --- | --- | --- | --- | --- | --- |")
    if args.ep:
        if args.ep < 1 or spec.num_experts % args.ep:
            print(f"python -m ray_moe.arch: error: --ep {args.ep} does not divide the {spec.num_experts} experts",
                  file=sys.stderr)
            return 2
        meshes = [(args.ep * d, d) for d in (int(x) for x in args.dp.split(","))]
    else:
        meshes = [(w, 1) for w in (int(x) for x in args.world_sizes.split(",")) if spec.num_experts % w == 0]
    for w, dp in meshes:
        m = spec.memory_per_rank(w, args.clone_slots, dp=dp)
        states = " / ".join(f"{spec.memory_per_rank(w, args.clone_slots, dp=dp, **kw, **fp8)['backward_bytes'] / gib:.1f}"
                            for kw in variants.values())
        acts = " / ".join(f"{spec.activation_peak_bytes_per_token(mode, w // dp, **peak_fp8) * args.tokens / gib:.1f}"
                          for mode in ("none", "moe", "full"))
        peaks = [spec.peak_bytes_per_rank(w, args.tokens, "full", clone_slots=args.clone_slots, dp=dp, **kw, **peak_fp8)["peak"]
                 for kw in variants.values()]
        label = f"{w} (EP {w // dp} x DP {dp})" if args.ep else f"{w}"
        print(f"| {label} | {m['params'] / 1e9:.2f}B | {states} | {acts} | {spec.loss_bytes(args.tokens)['forward'] / gib:.1f} | "
              + " / ".join(f"{x / gib:.1f}{'' if x <= budget else '*'}" for x in peaks) + " |")
    print(f"(* does not fit {args.gpu_gib:g} GiB x {args.headroom:.0%})")
    if args.ep:
        return 0
    for label, kw in variants.items():
        w = spec.smallest_world_size(budget, args.tokens, "full", clone_slots=args.clone_slots, **kw, **peak_fp8)
        print(f"smallest world size on {args.gpu_gib:g} GiB GPUs ({args.headroom:.0%} usable), full recompute, "
              f"{label}: {w if w else 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
