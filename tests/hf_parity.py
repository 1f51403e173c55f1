"""A model of an HF family on a live group against Hugging Face transformers' own implementation.

The driver builds a tiny random model with transformers (``from_config``, no download), saves it
(:func:`save_tiny_model`), and computes the reference once (:func:`reference`): logits and the
gradients of the mean next-token cross-entropy for the routers, every routed expert and the shared
expert of one MoE layer, a dense layer, one layer's attention and the embedding, converted to
ray_moe's layouts. Every rank then (:func:`model_parity`) loads the directory through
``model.init_from`` (its own tensors only), runs its slice of the batch forward and backward over
the group's transport, reduces gradients as the engine does (clones onto owners, replicated ones
averaged, experts divided by W), and reports relative errors of its logits and of the gradients
it holds: first at the native placement, then with clones of other ranks' experts. In bf16 the
errors are held to transformers' own bf16 model's (:func:`bf16_bounds`).

transformers is needed on the driver only (the test extra); the ranks run ray_moe alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from ray_moe.arch import ArchSpec, ResolvedArch
from ray_moe.comm.base import BufferSpec
from ray_moe.config import Config, element_size
from ray_moe.model.build import build_model
from ray_moe.model.decoder import MoEBlock
from ray_moe.model.hf import TensorSource, expert_tensors, replicated_tensor
from ray_moe.model.loss import lm_loss
from ray_moe.placement.clones import push_clone_weights, reduce_clone_grads
from ray_moe.placement.placement import Placement, Replica, expert_shard
from ray_moe.validation.errors import rel_err

# Tiny configs of each family: 2-3 layers, hidden 32, 8 experts, vocab >= 256 (byte corpora).
TINY = MappingProxyType({
    "qwen3_moe": MappingProxyType(dict(model_type="qwen3_moe", vocab_size=272, hidden_size=32, intermediate_size=48,
                      moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0],
                      max_position_embeddings=128, rope_theta=10000.0)),
    "mixtral": MappingProxyType(dict(model_type="mixtral", vocab_size=272, hidden_size=32, intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=128, rope_theta=1e6,
                    sliding_window=None)),
    "glm4_moe": MappingProxyType(dict(model_type="glm4_moe", vocab_size=272, hidden_size=32, intermediate_size=48,
                     moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
                     n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
                     partial_rotary_factor=0.5, max_position_embeddings=128, num_nextn_predict_layers=0)),
    # MLA with q and kv ranks, interleaved rope, YaRN with its softmax-scale correction
    "deepseek_v3": MappingProxyType(dict(model_type="deepseek_v3", vocab_size=272, hidden_size=32,
                        intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        max_position_embeddings=128, rope_interleave=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                                             mscale_all_dim=1.0, original_max_position_embeddings=32,
                                             beta_fast=32, beta_slow=1))),
    # sinks, a window shorter than the test sequences on layer 0, YaRN, biases, a clamp that binds
    "gpt_oss": MappingProxyType(dict(model_type="gpt_oss", vocab_size=272, hidden_size=32, intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
                    max_position_embeddings=128, attention_bias=True,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, original_max_position_embeddings=32, truncate=False))),
    # q/k norms over the whole projection, softmax top-k not renormalised
    "olmoe": MappingProxyType(dict(model_type="olmoe", vocab_size=272, hidden_size=32, intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=128)),
    # whole-projection q/k norms, partial RoPE, sigmoid routing with the balancing bias
    "minimax_m2": MappingProxyType(dict(model_type="minimax_m2", vocab_size=272, hidden_size=32, intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_local_experts=8, num_experts_per_tok=3, max_position_embeddings=128, eos_token_id=None,
                       bos_token_id=None, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                               partial_rotary_factor=0.5))),
})


def tiny_config(family: str, **overrides: Any) -> Any:
    """transformers' config of ``family``'s tiny model (:data:`TINY` + ``overrides``), validated
    by transformers as it builds it (e.g. ``layer_types`` must name every layer)."""
    from transformers import AutoConfig

    kw = {**TINY[family], **overrides}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def save_tiny_model(family: str, path: str | Path, seed: int = 0, **overrides: Any) -> dict[str, Any]:
    """Build a random transformers model of ``family`` (:data:`TINY` + ``overrides``), save it to
    ``path`` (safetensors, ``save_pretrained``) and return its config.json as a dict.

    Weights are drawn with a larger spread than transformers' default (std 0.02 makes a tiny model
    nearly linear and its routing nearly uniform); a sigmoid router gets a random balancing bias."""
    import json

    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **overrides)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(str(path))
    return json.loads((Path(path) / "config.json").read_text())


def probe_names(spec: ArchSpec) -> dict[str, Any]:
    """What the comparison covers: replicated ray_moe parameter names, and the MoE layer whose
    experts (all of them) are compared."""
    moe = next(i for i, m in enumerate(spec.moe_layers) if m)
    names = ["embed_tokens.weight", f"layers.{moe}.mlp.routed.router"]
    for layer in sorted({moe, spec.num_layers - 1}):  # gpt-oss: a sliding and a full layer
        names += [f"layers.{layer}.self_attn.{p}" for p in _attention_probes(spec)]
    if spec.router_bias:
        names.append(f"layers.{moe}.mlp.routed.router_bias")
    if spec.shared_hidden:
        names += [f"layers.{moe}.mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    dense = next((i for i, m in enumerate(spec.moe_layers) if not m), None)
    if dense is not None:
        names += [f"layers.{dense}.mlp.{p}.weight" for p in ("gate_proj", "down_proj")]
    return {"replicated": names, "moe_layer": moe}


def _attention_probes(spec: ArchSpec) -> list[str]:
    """The attention parameters compared, under ``self_attn.``."""
    if spec.attention == "mla":
        q = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"] if spec.q_lora_rank else ["q_proj.weight"]
        return q + ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    names = [f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += ["q_norm.weight"] * spec.qk_norm + ["q_proj.bias"] * spec.qkv_bias + ["o_proj.bias"] * spec.o_bias
    return names + ["sinks"] * spec.attn_sinks


EXPERT_PARTS = ("w13", "w2", "b13", "b2")  # the expert tensors compared (biases where the spec has them)


def parity_config(path: str | Path, world_size: int, batch: int, seq_len: int, dtype: str = "float32",
                  device: str = "cpu", clone_slots: int = 1, expert_impl: str = "auto",
                  checkpointing: str = "none", expert_parallel: int = 0) -> Config:
    """The ray_moe config that loads ``path`` for the comparison (``expert_parallel``: the EP
    degree of a rank mesh, 0 for the whole world)."""
    return Config.from_dict({
        "model": {"init_from": str(path), "seq_len": seq_len, "dtype": dtype,
                  "activation_checkpointing": checkpointing},
        "moe": {"aux_loss_coef": 0.0, "expert_impl": expert_impl, "bias_update_rate": 0.0},
        "parallel": {"world_size": world_size, "device": device, "expert_parallel": expert_parallel},
        "train": {"batch_size": batch},
        "balance": {"clone_slots": clone_slots},
    })


def reference(config: Config, arch: ResolvedArch, ids: torch.Tensor, dtype: torch.dtype = torch.float32,
              device: str = "cpu", attn_implementation: str = "eager") -> dict[str, torch.Tensor]:
    """transformers' logits [B, L, V] (float32) and loss gradients in ray_moe layouts (CPU float32)
    for the model directory ``config.model.init_from`` (of architecture ``arch``:
    ``config.resolve_arch()``) on ``ids`` [B, L + 1] (inputs ids[:, :-1],
    targets ids[:, 1:]). Keys: ``logits``, the :func:`probe_names` replicated names, and
    ``expert.{e}.w13`` / ``expert.{e}.w2`` for every expert of the probed MoE layer."""
    from transformers import AutoModelForCausalLM

    spec = arch.spec
    model = AutoModelForCausalLM.from_pretrained(config.model.init_from, dtype=dtype,
                                                 attn_implementation=attn_implementation).to(device)
    model.train()
    x, y = ids[:, :-1].to(device), ids[:, 1:].to(device)
    logits = model(input_ids=x).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    grads = DictSource({n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None})
    probes = probe_names(spec)
    out = {"logits": logits.detach().cpu()}
    for name in probes["replicated"]:
        out[name] = replicated_tensor(spec, grads, name).clone()
    for e in range(spec.num_experts):
        for part, t in zip(EXPERT_PARTS, expert_tensors(spec, grads, probes["moe_layer"], e)):
            out[f"expert.{e}.{part}"] = t.clone()
    return out


def clone_placement(num_experts: int, world_size: int, clone_slots: int) -> Placement:
    """Native placement plus, on every rank, clones of the next rank's first experts in its clone
    slots (its own at W=1), with per-source shares of 1/4, 1/2 or 3/4 for the clone."""
    n = num_experts // world_size
    replicas = [[Replica(e // n, e % n)] for e in range(num_experts)]
    for r in range(world_size):
        for c in range(min(clone_slots, n)):
            replicas[((r + 1) % world_size) * n + c].append(Replica(r, n + c))
    R = max(len(reps) for reps in replicas)
    shares = torch.zeros(world_size, num_experts, R, dtype=torch.float64)
    for e, reps in enumerate(replicas):
        for s in range(world_size):
            if len(reps) == 1:
                shares[s, e, 0] = 1.0
            else:
                clone = ((s + e) % 3 + 1) / 4
                shares[s, e, 0] = 1.0 - clone
                shares[s, e, 1] = clone
    p = Placement(num_experts, world_size, clone_slots, replicas, shares, version=1)
    p.validate()
    return p


def model_parity(worker: Any, config: Config, arch: ResolvedArch, ids: torch.Tensor,
                 expected: dict[str, torch.Tensor], with_clones: bool = True) -> dict[str, dict[str, float]]:
    """Run on every rank (``group.execute(model_parity, config, arch, ids, expected)``, ``arch``
    resolved on the driver: ``config.resolve_arch()``; at W=1 any object
    with ``rank_info``, ``transport`` and ``device``): ray_moe's model loaded from
    ``config.model.init_from`` vs :func:`reference`. Returns {"native": errors, "clones": errors}
    (relative errors by name for this rank's logits and gradients; also ``source_tensors``, the
    HF tensor names this rank opened, under ``"opened"``). On a rank mesh (the worker's
    ``mesh`` and ``groups``) the experts split over the EP group (the transport's peers) and the
    DP replicas sum their expert gradients as the engine does."""
    rank, W = worker.rank_info.rank, worker.rank_info.world_size
    groups = getattr(worker, "groups", None)
    ep_group, dp_group = (groups.ep, groups.dp) if groups is not None else (None, None)
    dp = W // worker.transport.world_size
    device = torch.device(worker.device)
    B, L = ids.shape[0], ids.shape[1] - 1
    if B % W:
        raise ValueError(f"batch {B} does not split over {W} ranks")
    spec = arch.spec
    worker.transport.reserve(BufferSpec(max_tokens=B // W * L, hidden=spec.hidden_size,
                                        elem_bytes=element_size(config.model.dtype), max_top_k=spec.top_k))
    model = build_model(config, arch, worker.transport, device)
    mine = slice(rank * B // W, (rank + 1) * B // W)
    x, y = ids[mine, :-1].to(device), ids[mine, 1:].to(device)
    probes = probe_names(spec)
    params = dict(model.named_parameters())
    results: dict[str, Any] = {"opened": list(model.source_tensors)}
    placements = [None] + ([clone_placement(spec.num_experts, worker.transport.world_size, config.balance.clone_slots)]
                           if with_clones and config.balance.clone_slots else [])
    for placement in placements:
        if placement is not None:
            for layer in model.moe_layers():
                layer.set_placement(Placement.from_dict(placement.to_dict()))
                push_clone_weights(layer, layer.placement, ep_group)
        model.zero_grad(set_to_none=False)
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        h, _ = model.hidden_states(x)
        logits = model.lm_head(h).float()
        lm_loss(h.reshape(-1, h.shape[-1]), model.lm_head.weight, y.reshape(-1)).backward()
        _reduce_like_engine(model, W, ep_group, dp_group if dp > 1 else None)
        errs = {"logits": rel_err(logits, expected["logits"][mine])}
        for name in probes["replicated"]:
            errs[name] = rel_err(params[name].grad, expected[name])
        layer = _moe_layer(model, probes["moe_layer"])
        for slot, e in enumerate(layer.native_experts):
            for part, p in zip(EXPERT_PARTS, layer.expert_params()):
                errs[f"expert.{e}.{part}"] = rel_err(p.grad[slot], expected[f"expert.{e}.{part}"])
        results["native" if placement is None else "clones"] = errs
    return results


def _moe_layer(model: torch.nn.Module, index: int):
    mlp = model.layers[index].mlp
    assert isinstance(mlp, MoEBlock)
    return mlp.routed


def _reduce_like_engine(model: torch.nn.Module, world_size: int, ep_group: Any = None, dp_group: Any = None) -> None:
    """The engine's gradient semantics: expert gradients (already summed over every token of the
    EP group) summed over the DP replicas (``dp_group``, every slot), clone gradients onto their
    owners (on ``ep_group``); replicated gradients averaged over ranks; expert gradients divided by W."""
    for layer in model.moe_layers():
        if dp_group is not None:
            for p in layer.expert_params():  # w13, w2 and the biases where the experts have them
                dist.all_reduce(p.grad, group=dp_group)
        reduce_clone_grads(layer, layer.placement, group=ep_group)
    if world_size == 1:
        return
    for p in model.parameters():
        if expert_shard(p) is None:
            dist.all_reduce(p.grad)
        p.grad.div_(world_size)


class DictSource(TensorSource):
    """Tensors already in memory (e.g. a transformers model's parameters or their gradients)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        super().__init__()
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def _get(self, name: str, row: int | None) -> torch.Tensor:
        t = self.tensors[name]
        return t if row is None else t[row]


def bf16_bounds(hf_err: dict[str, float]) -> dict[str, float]:
    """The bound of each logged error: twice transformers' own bf16 error (2e-2 at least); for an
    expert's gradient, twice transformers' worst expert of that tensor. In bf16 a few tokens sit
    near a top-k tie and change expert in either model; an expert that gains or loses one token
    moves by ~1/its tokens, and which expert that is differs between the two models (on the CPU in
    bf16 at this size, 2026-12-07: transformers' worst expert 0.18-0.25, ours 0.11-0.22, rarely
    the same expert)."""
    worst: dict[str, float] = {}
    for k, v in hf_err.items():
        if k.startswith("expert."):
            kind = k.rsplit(".", 1)[1]
            worst[kind] = max(worst.get(kind, 0.0), v)
    return {k: max(2 * (worst[k.rsplit(".", 1)[1]] if k.startswith("expert.") else v), 2e-2)
            for k, v in hf_err.items()}
