"""torchtitan's model of an HF family, for ``ray-moe bench train``: its Qwen3 (``qwen3_moe``),
DeepSeek-V3 (``deepseek_v3``) and gpt-oss (``gpt_oss``) models built from the HF config that
ray_moe builds its own model from, with as many parameters (:func:`model_args` says where that
cannot hold); how its blocks run one step's forward; its own per-block compile and activation
checkpointing, as its ``parallelize`` functions apply them on one GPU.

torchtitan (0.2.2, ``scripts/make-titan-bundle.sh``) is imported inside the functions only: this
module imports without it (:func:`import_error` says why it does not).

Mapped exactly (the arguments of its model args from the HF keys): hidden, heads, head dims, MLA's
ranks and head dims, dense and expert widths, experts, top-k, expert groups, shared experts, the
first dense layers, routing (softmax / sigmoid, renormalised top-k, the routed scaling factor,
DeepSeek-V3's choice bias as a zero buffer), vocab, the norms' epsilon in the blocks, rope theta,
YaRN (DeepSeek-V3: also at sequences no longer than the original context, as transformers, by
giving torchtitan a rope table one row longer than that; its softmax scale's ``mscale_all_dim``
correction), gpt-oss's biases, sinks, 128-token windows on the even layers and its clamped SwiGLU.

Not matched (none of these changes the parameter count except where said):
  - qwen3_moe: torchtitan's Qwen3 makes every layer an MoE layer (``mlp_only_layers``,
    ``decoder_sparse_step``) and has no attention biases (``attention_bias``): both change the
    count; such configs are built anyway, with a note, and no count check.
  - deepseek_v3: torchtitan's final norm keeps RMSNorm's default epsilon; its rope rotates
    (even, odd) pairs always (``rope_interleave: false`` rotates halves); YaRN's cos/sin
    ``attention_factor`` is not applied (1 for DeepSeek-V3's published config).
  - gpt_oss: its sliding layers are the even ones (another ``layer_types`` gets a note); its YaRN
    never truncates the correction range (``truncate: true`` gets a note); SwiGLU's α is 1.702
    (torchtitan's constant; another ``swiglu_alpha`` gets a note). torchtitan's own gpt-oss
    configs add a load-balancing bias to the routing scores; ray_moe's gpt-oss has none, so
    neither does this one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ray_moe.arch import family_of

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss")  # the HF families torchtitan has a model of
_MODULES = MappingProxyType({"qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss"})
_MODELS = MappingProxyType({"qwen3_moe": "Qwen3Model", "deepseek_v3": "DeepSeekV3Model", "gpt_oss": "GptOssModel"})


def import_error(family: str = "qwen3_moe") -> str | None:
    """Why torchtitan's model of ``family`` does not import (None: it does)."""
    if family not in FAMILIES:
        return f"torchtitan has no model of {family} here (families: {', '.join(FAMILIES)})"
    try:
        __import__(f"torchtitan.models.{_MODULES[family]}.model.model")
    except Exception as exc:  # not installed, or an incompatible torch
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
    return None


@dataclass(frozen=True)
class Mapped:
    """torchtitan's model args of an HF config, what of the config they do not follow
    (``notes``), and whether the parameter count is the HF model's (``exact_count``)."""

    args: Any
    notes: tuple[str, ...]
    exact_count: bool


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return dict(rope) if rope.get("rope_type", rope.get("type")) == "yarn" else {}


def model_args(hf: Mapping[str, Any], seq_len: int, grouped_mm: bool = True) -> Mapped:
    """torchtitan's model args for the HF config ``hf`` (its ``num_hidden_layers`` layers) at
    ``seq_len`` tokens per sequence; ``grouped_mm``: its experts through ``torch._grouped_mm``
    (Hopper; else its per-expert loop). Raises ValueError for a family it has no model of."""
    family = family_of(hf)
    if family not in FAMILIES:
        raise ValueError(f"torchtitan has no model of {family} here (families: {', '.join(FAMILIES)})")
    return {"qwen3_moe": _qwen3, "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss}[family](hf, seq_len, grouped_mm)


def _qwen3(hf: Mapping[str, Any], seq_len: int, grouped_mm: bool) -> Mapped:
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    notes = []
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        notes.append("every layer MoE here; the HF config has dense layers")
    if hf.get("attention_bias"):
        notes.append("no attention biases here; the HF config has them")
    args = Qwen3ModelArgs(
        vocab_size=hf["vocab_size"], max_seq_len=seq_len, head_dim=hf["head_dim"], dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
        qk_norm=True, hidden_dim=hf["intermediate_size"], rope_theta=hf["rope_theta"], norm_eps=hf["rms_norm_eps"],
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        moe_enabled=True, moe_inter_dim=hf["moe_intermediate_size"],
        moe_args=MoEArgs(num_experts=hf["num_experts"], num_shared_experts=0, top_k=hf["num_experts_per_tok"],
                         score_func="softmax", route_norm=bool(hf.get("norm_topk_prob", True)), route_scale=1.0,
                         score_before_experts=False, use_grouped_mm=grouped_mm),
    )
    return Mapped(args, tuple(notes), exact_count=not notes)


def _deepseek_v3(hf: Mapping[str, Any], seq_len: int, grouped_mm: bool) -> Mapped:
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    yarn, notes = _rope(hf), []
    if not hf.get("rope_interleave", True):
        notes.append("rope on (even, odd) pairs here; the HF config rotates halves")
    groups = int(hf.get("n_group") or 1)
    rope_theta = float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    # torchtitan applies YaRN only where its rope table is longer than the original context;
    # transformers always does: one row more than that makes the two agree at any seq_len.
    original = int(yarn.get("original_max_position_embeddings", seq_len)) if yarn else seq_len
    args = DeepSeekV3ModelArgs(
        max_seq_len=max(seq_len, original + 1) if yarn else seq_len, vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"], inter_dim=hf["intermediate_size"], moe_inter_dim=hf["moe_intermediate_size"],
        n_layers=hf["num_hidden_layers"], n_dense_layers=int(hf.get("first_k_dense_replace", 3)),
        n_heads=hf["num_attention_heads"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        moe_args=MoEArgs(num_experts=hf["n_routed_experts"], num_shared_experts=int(hf.get("n_shared_experts", 1)),
                         score_func="sigmoid", route_norm=bool(hf.get("norm_topk_prob", True)),
                         route_scale=float(hf.get("routed_scaling_factor", 1.0)), gate_bias=False,
                         score_before_experts=False, top_k=hf["num_experts_per_tok"],
                         num_expert_groups=groups if groups > 1 else None,
                         num_limited_groups=int(hf.get("topk_group") or 1) if groups > 1 else None,
                         use_grouped_mm=grouped_mm, load_balance_coeff=1e-3),
        q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], attn_type="sdpa", attn_mask_type="causal",
        original_seq_len=original, rope_theta=rope_theta, rope_factor=float(yarn.get("factor", 1.0)),
        beta_fast=yarn.get("beta_fast") or 32, beta_slow=yarn.get("beta_slow") or 1,
        mscale=float(yarn.get("mscale_all_dim") or 0.0),  # 0: no softmax-scale correction, as transformers
    )
    args.moe_impl = "standard"  # what its update_from_config sets from the job config
    return Mapped(args, tuple(notes), exact_count=True)


def _gpt_oss(hf: Mapping[str, Any], seq_len: int, grouped_mm: bool) -> Mapped:
    from torchtitan.models.gpt_oss.model.args import GptOssModelArgs
    from torchtitan.models.moe import MoEArgs

    L, yarn, notes = hf["num_hidden_layers"], _rope(hf), []
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    if list(types) != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]:
        notes.append("sliding windows on the even layers here; the HF config's layer_types differ")
    if yarn.get("truncate", False):
        notes.append("YaRN's correction range not truncated here; the HF config truncates it")
    if float(hf.get("swiglu_alpha", 1.702)) != 1.702:
        notes.append(f"SwiGLU alpha 1.702 here; the HF config has {hf['swiglu_alpha']}")
    theta = float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 150000.0)))
    args = GptOssModelArgs(
        max_seq_len=seq_len, vocab_size=hf["vocab_size"], dim=hf["hidden_size"], moe_inter_dim=hf["intermediate_size"],
        n_layers=L, norm_eps=float(hf.get("rms_norm_eps", 1e-5)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        head_dim=hf["head_dim"], n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
        sliding_window_size=int(hf.get("sliding_window") or seq_len), attn_mask_type="causal",
        original_seq_len=int(yarn.get("original_max_position_embeddings", 4096)), rope_theta=theta,
        rope_factor=float(yarn.get("factor", 1.0)), ntk_alpha=float(yarn.get("beta_slow") or 1.0),
        ntk_beta=float(yarn.get("beta_fast") or 32.0),
        moe_args=MoEArgs(num_experts=hf["num_local_experts"], num_shared_experts=0, score_func="softmax",
                         route_norm=True, route_scale=1.0, gate_bias=True, score_before_experts=False,
                         top_k=hf["num_experts_per_tok"], use_grouped_mm=grouped_mm, load_balance_coeff=None),
    )
    return Mapped(args, tuple(notes), exact_count=True)


@dataclass
class TitanModel:
    """torchtitan's model of ``family`` and how a step runs it block by block (what its
    ``forward`` does, with the final norm and without the output projection)."""

    model: nn.Module
    family: str
    notes: tuple[str, ...]
    exact_count: bool

    def rope(self) -> torch.Tensor:
        """The rope table the blocks take (DeepSeek-V3: complex ``freqs_cis``)."""
        return self.model.freqs_cis if self.family == "deepseek_v3" else self.model.rope_cache

    def masks(self, tokens: torch.Tensor) -> Any:
        """gpt-oss: its flex block masks (``basic_mask``, ``sliding_window_mask``) for ``tokens``
        [B, L], built each step as its trainer does; the SDPA families: None (causal)."""
        if self.family != "gpt_oss":
            return None
        return self.model.get_attention_masks(tokens, tokenizer=None)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding, every block, final norm: [B, L] int64 → [B, L, H] in the parameters' dtype."""
        h, rope, masks = self.model.tok_embeddings(tokens), self.rope(), self.masks(tokens)
        for layer in self.model.layers.values():
            h = layer(h, rope, masks)
        return self.model.norm(h)

    def attention_half(self, layer: nn.Module, x: torch.Tensor, masks: Any) -> torch.Tensor:
        """``x + attention(attention_norm(x))`` of one block (its attention alone): [B, L, H]."""
        if self.family == "gpt_oss":
            masks = masks["sliding_window_mask" if layer.use_sliding_attention else "basic_mask"]
        return x + layer.attention(layer.attention_norm(x), self.rope(), masks)

    def params(self) -> int:
        """Its parameter count (buffers, the rope tables and expert counters, not counted)."""
        return sum(p.numel() for p in self.model.parameters())


def build(hf: Mapping[str, Any], seq_len: int, device: torch.device | str, dtype: torch.dtype,
          init: bool = True) -> TitanModel:
    """torchtitan's model of ``hf`` on ``device``, parameters in ``dtype`` (its buffers, the rope
    tables and the expert counters, stay float32), initialised by its own ``init_weights``;
    ``init=False``: on the meta device, to count parameters. Experts through grouped GEMMs on CUDA,
    its per-expert loop elsewhere."""
    device = torch.device("meta") if not init else torch.device(device)
    mapped = model_args(hf, seq_len, grouped_mm=device.type == "cuda")
    family = family_of(hf)
    module = __import__(f"torchtitan.models.{_MODULES[family]}.model.model", fromlist=[_MODELS[family]])
    with torch.device("meta"):
        model = getattr(module, _MODELS[family])(mapped.args)
    if init:
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    for param in model.parameters():  # gpt-oss builds its blocks in bf16
        param.data = param.data.to(dtype)
    return TitanModel(model, family, mapped.notes, mapped.exact_count)


def apply_compile(tt: TitanModel) -> Callable[[], None]:
    """torchtitan's own per-block compile (``compile.enable``, components ``model``, inductor), as
    its Qwen3 and DeepSeek-V3 ``parallelize`` apply it: llama4's ``apply_compile`` compiles each
    MoE block's attention, norms, router and token reorderer (``fullgraph=True``; the grouped
    experts through its compiled ``_run_experts_grouped_mm``) and a dense block whole. That sets a
    module global of torchtitan's and a dynamo flag; the returned function puts both back. gpt-oss:
    nothing (its ``parallelize`` compiles no block; its flex attention is compiled always)."""
    if tt.family == "gpt_oss":
        return lambda: None
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama4.infra.parallelize import apply_compile as titan_apply_compile
    from torchtitan.models.moe import moe as moe_module

    saved = moe_module._run_experts_grouped_mm, torch._dynamo.config.capture_scalar_outputs
    titan_apply_compile(tt.model, Compile(enable=True, components=["model", "loss"], backend="inductor"),
                        ep_enabled=False)

    def undo() -> None:
        moe_module._run_experts_grouped_mm, torch._dynamo.config.capture_scalar_outputs = saved

    return undo


def apply_ac(tt: TitanModel, mode: str, compiled: bool) -> None:
    """torchtitan's own activation checkpointing (none | selective | full) with its family's saved
    ops, applied as its ``parallelize`` does, before the compile: ``full`` recomputes each block
    (as ``model.activation_checkpointing=full`` does for ray_moe); ``selective`` is its default."""
    if mode == "none":
        return
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac as titan_apply_ac

    family = __import__(f"torchtitan.models.{_MODULES[tt.family]}.infra.parallelize", fromlist=["_op_sac_save_list"])
    titan_apply_ac(tt.model, ActivationCheckpoint(mode=mode), model_compile_enabled=compiled,
                   op_sac_save_list=family._op_sac_save_list)


@contextlib.contextmanager
def cpu_fallbacks() -> Iterator[None]:
    """What torchtitan runs on CUDA only, stood in for on the CPU while the block is open (the CPU
    tests; nothing of it is a timing): its router's per-expert counts (``torch.histc`` of int64
    expert ids, which the CPU lacks: counted as float32 and given back as int64) and flex
    attention (gpt-oss; the CPU has no flex backward: :func:`dense_flex`). Both put back on exit."""
    from torchtitan.models.attention import FlexAttentionWrapper

    histc, flex = torch.histc, FlexAttentionWrapper.__dict__["_compiled_flex_attn"]

    def int_histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
        return histc(x, bins, min, max) if x.is_floating_point() else histc(x.float(), bins, min, max).to(x.dtype)

    torch.histc, FlexAttentionWrapper._compiled_flex_attn = int_histc, dense_flex
    try:
        yield
    finally:
        torch.histc, FlexAttentionWrapper._compiled_flex_attn = histc, flex


def dense_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: Any, scale: float | None = None,
               return_lse: bool = False, enable_gqa: bool = False, **_: Any) -> Any:
    """``flex_attention(q, k, v, block_mask=...)`` evaluated densely (its mask_mod on every (query,
    key) pair), differentiable on the CPU: q [B, Hq, L, D], k and v [B, Hkv, S, D] (``enable_gqa``:
    Hq a multiple of Hkv) → out [B, Hq, L, D] in q's dtype and (``return_lse``) the float32
    log-sum-exp of the scaled, masked scores [B, Hq, L]."""
    from torch.nn.attention.flex_attention import create_mask

    B, Hq, L, D = q.shape
    if enable_gqa:
        k, v = (t.repeat_interleave(Hq // t.shape[1], dim=1) for t in (k, v))
    keep = create_mask(block_mask.mask_mod, B, Hq, L, k.shape[2], device=q.device)
    scores = (q @ k.transpose(-2, -1)).float() * (D ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = scores.logsumexp(-1)
    out = (scores - lse.unsqueeze(-1)).exp().to(v.dtype) @ v
    return (out, lse) if return_lse else out


def softmax_scale(tt: TitanModel) -> float:
    """The first block's attention softmax scale (MLA: with YaRN's correction)."""
    attention = next(iter(tt.model.layers.values())).attention
    return float(attention.softmax_scale) if hasattr(attention, "softmax_scale") else 1 / math.sqrt(attention.head_dim)
