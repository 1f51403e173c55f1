"""Byte-model checkpoints of the old module layout (``tok_emb``, ``blocks.i.attn.qkv`` fused,
``blocks.i.ffn``, ``pos_emb``, ``norm_f``, a dense first layer's fused ``w13``) still load: the
keys are recognised, renamed and split on load, at another world size too, with the optimizer
state; the loaded model's logits equal those of the old model's computation on the old tensors
(an oracle written from the old ``MoETransformer``'s forward) in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ray_moe import checkpoint
from ray_moe.comm.local import LocalTransport
from ray_moe.model.experts import reference_moe
from tests.support import build, engine, small_config
from tests.unit.test_checkpoint import ShapeOnlyTransport


def _config(tmp_path, world_size=1, seed=0):
    return small_config(tmp_path, world_size=world_size, **{
        "model.n_layers": 3, "model.dense_first_layer": True, "model.dense_hidden": 40,
        "moe.num_experts": 4, "train.seed": seed})


def _old_name(name: str) -> list[tuple[str, int]] | str:
    """The old layout's name of a new parameter name: (old fused name, part index) or a plain name."""
    top = {"embed_tokens.weight": "tok_emb.weight", "embed_positions": "pos_emb", "norm.weight": "norm_f.weight"}
    if name in top:
        return top[name]
    if not name.startswith("layers."):
        return name
    _, i, rest = name.split(".", 2)
    fused = {"self_attn.q_proj.weight": ("attn.qkv.weight", 0), "self_attn.k_proj.weight": ("attn.qkv.weight", 1),
             "self_attn.v_proj.weight": ("attn.qkv.weight", 2), "mlp.gate_proj.weight": ("ffn.w13.weight", 0),
             "mlp.up_proj.weight": ("ffn.w13.weight", 1)}
    plain = {"input_layernorm.weight": "norm1.weight", "post_attention_layernorm.weight": "norm2.weight",
             "self_attn.o_proj.weight": "attn.proj.weight", "mlp.down_proj.weight": "ffn.w2.weight"}
    if rest in fused:
        old, part = fused[rest]
        return [(f"blocks.{i}.{old}", part)]
    if rest in plain:
        return f"blocks.{i}.{plain[rest]}"
    assert rest.startswith("mlp.routed."), name
    return f"blocks.{i}.ffn.{rest[len('mlp.routed.'):]}"


def to_old_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors renamed the way the old byte model named them (fused tensors joined)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in tensors.items():
        prefix, suffix, name = "", "", key
        if key.startswith("optim."):
            prefix = "optim."
            name, _, state = key[len(prefix):].rpartition(".")
            suffix = "." + state
        elif key.startswith("rng."):
            out[key] = t
            continue
        old = _old_name(name)
        if isinstance(old, str):
            out[prefix + old + suffix] = t
        else:
            (fused, i), = old
            parts.setdefault(prefix + fused + suffix, {})[i] = t
    for key, by_part in parts.items():
        out[key] = torch.cat([by_part[i] for i in sorted(by_part)], dim=0)
    return out


def old_byte_logits(T: dict[str, torch.Tensor], ids: torch.Tensor, n_layers: int, n_heads: int,
                    top_k: int, dense_first: bool) -> torch.Tensor:
    """The old ``MoETransformer`` forward, from a checkpoint of the old layout (fp32): token +
    position embeddings, pre-norm blocks (torch RMSNorm with its default eps, fused q|k|v,
    causal SDPA, MoE or dense SwiGLU FFN), final norm, LM head."""
    B, L = ids.shape
    x = T["tok_emb.weight"][ids] + T["pos_emb"][:L]
    H = x.shape[-1]
    E = len({k.split(".")[4] for k in T if k.startswith("blocks.1.ffn.experts.")})
    for i in range(n_layers):
        b = f"blocks.{i}."
        h = F.rms_norm(x, (H,), T[b + "norm1.weight"])
        q, k, v = (h @ T[b + "attn.qkv.weight"].t()).view(B, L, 3, n_heads, H // n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(B, L, H) @ T[b + "attn.proj.weight"].t()
        h = F.rms_norm(x, (H,), T[b + "norm2.weight"]).reshape(B * L, H)
        if i == 0 and dense_first:
            gate, up = (h @ T[b + "ffn.w13.weight"].t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ T[b + "ffn.w2.weight"].t()
        else:
            w13 = torch.stack([T[f"{b}ffn.experts.{e}.w13"] for e in range(E)])
            w2 = torch.stack([T[f"{b}ffn.experts.{e}.w2"] for e in range(E)])
            y, _, _ = reference_moe(h, T[b + "ffn.router"], w13, w2, top_k)
        x = x + y.view(B, L, H)
    return F.rms_norm(x, (H,), T["norm_f.weight"]) @ T["lm_head.weight"].t()


def _ids(vocab=256, B=2, L=16):
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(3))


def test_an_old_checkpoint_of_two_ranks_loads_into_one_rank_with_the_old_logits(tmp_path):
    cfg2 = _config(tmp_path, world_size=2)
    ranks = [build(cfg2, ShapeOnlyTransport(r, 2)) for r in range(2)]
    state = {}
    for r, m in enumerate(ranks):
        opt = {p: {"exp_avg": torch.full_like(p, i + 0.5), "exp_avg_sq": torch.full_like(p, i + 0.25)}
               for i, p in enumerate(m.parameters())}
        state.update(checkpoint.shard_state(m.named_parameters(), opt, r, torch.device("cpu")))
    old = to_old_layout(state)
    assert "tok_emb.weight" in old and "blocks.0.attn.qkv.weight" in old and "blocks.0.ffn.w13.weight" in old
    assert "blocks.1.ffn.experts.3.w13" in old and "optim.blocks.0.attn.qkv.weight.exp_avg" in old
    assert not any(k.startswith(("layers.", "embed_")) for k in old)
    # through the files: written the old way, read back, loaded at W=1 into a model of another seed
    staging = checkpoint.new_staging_dir(tmp_path / "run", 4)
    files = [checkpoint.write_shard(staging, 0, old)]
    path = checkpoint.commit(staging, {"step": 4, "opt_steps": 4, "config": cfg2.to_dict()}, files)
    tensors = checkpoint.load_tensors(path, checkpoint.read_meta(path))

    cfg1 = _config(tmp_path, world_size=1, seed=9)
    one = build(cfg1, LocalTransport())
    opt_state: dict = {}
    checkpoint.load_shard_state(one.named_parameters(), opt_state, tensors, opt_steps=4, rank=0,
                                device=torch.device("cpu"))
    ids = _ids()
    want = old_byte_logits(tensors, ids, 3, cfg1.model.n_heads, cfg1.moe.top_k, dense_first=True)
    with torch.no_grad():
        got, _ = one(ids)
    assert (got - want).abs().max() <= 1e-6, (got - want).abs().max()
    # the fused optimizer state was split with its tensor: k_proj is the middle third of qkv
    k = one.layers[0].self_attn.k_proj.weight
    H = k.shape[0]
    assert torch.equal(opt_state[k]["exp_avg"], tensors["optim.blocks.0.attn.qkv.weight.exp_avg"][H:2 * H])
    # the new model's tensors are the original ones, renamed
    src = build(cfg2.with_overrides(["parallel.world_size=1"]), LocalTransport())
    for (name, p), q in zip(one.named_parameters(), src.parameters()):
        assert torch.equal(p, q), name


def test_an_old_checkpoint_resumes_in_an_engine(tmp_path):
    """The engine's load path (optimizer masters, state, placements) takes an old checkpoint."""
    cfg = _config(tmp_path)
    e = engine(cfg)
    e.train_step()
    saved = e.shard_state()
    ids = _ids()
    e.model.eval()
    with torch.no_grad():
        want, _ = e.model(ids)
    other = engine(cfg)  # the weights of step 0 (the data of the same seed)
    with torch.no_grad():
        before, _ = other.model.eval()(ids)
    assert not torch.equal(before, want)
    other.load_state(to_old_layout(saved), step=1, opt_steps=1)
    other.model.eval()
    with torch.no_grad():
        got, _ = other.model(ids)
    assert torch.equal(got, want)
    for _ in range(2):  # the optimizer state came back too: the next steps are the same
        assert other.train_step()["loss"] == e.train_step()["loss"]


def test_a_current_checkpoint_is_left_as_it_is():
    t = {"embed_tokens.weight": torch.zeros(2), "layers.0.mlp.routed.experts.1.w13": torch.ones(1)}
    assert checkpoint.migrate_keys(t) == t and not checkpoint.is_old_byte_layout(t)
