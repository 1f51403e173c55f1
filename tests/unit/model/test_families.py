"""DeepSeek-V3 (multi-head latent attention, YaRN) and gpt-oss (sinks, sliding windows, biases,
the clamped SwiGLU) against transformers at W=1, beyond what test_hf_models.py covers for every
family: full recompute, greedy decoding with the KV cache, the features each comparison would
miss if they were off, the published quantized formats read on load, and the presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ray_moe.arch import ArchError, ArchSpec, preset
from ray_moe.comm.local import LocalTransport
from tests.hf_parity import model_parity, parity_config, reference, save_tiny_model
from tests.support import build
from tests.unit.model.test_hf_models import TOL, batch, local_worker

NEW = ("deepseek_v3", "gpt_oss")


@pytest.mark.parametrize("family", NEW)
def test_full_recompute_equal_to_transformers(tiny_hf, family):
    """Sequences of 12 (gpt-oss's window is 5): every gradient within 1e-5 with clones, the
    blocks recomputed in backward."""
    cfg = parity_config(tiny_hf(family), world_size=1, batch=4, seq_len=12, checkpointing="full")
    ids = batch()
    res = model_parity(local_worker(), cfg, cfg.resolve_arch(), ids, reference(cfg, cfg.resolve_arch(), ids))
    for placement in ("native", "clones"):
        bad = {k: v for k, v in res[placement].items() if not v <= TOL}
        assert not bad, f"{family} {placement}: {bad}"
    if family == "gpt_oss":
        assert {"expert.0.b13", "expert.7.b2", "layers.0.self_attn.sinks", "layers.1.self_attn.sinks",
                "layers.0.mlp.routed.router_bias"} <= set(res["native"])


def test_moonlight_style_mla_equal_to_transformers(tmp_path):
    """MLA without a q rank (one q_proj: Moonlight) and with the rope dims not interleaved, default
    RoPE: logits and gradients within 1e-5."""
    save_tiny_model("deepseek_v3", tmp_path, seed=5, q_lora_rank=None, rope_interleave=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    cfg = parity_config(tmp_path, world_size=1, batch=4, seq_len=12)
    assert cfg.resolve_arch().spec.yarn is None and cfg.resolve_arch().spec.q_lora_rank == 0
    ids = batch()
    res = model_parity(local_worker(), cfg, cfg.resolve_arch(), ids, reference(cfg, cfg.resolve_arch(), ids),
                       with_clones=False)
    assert "layers.1.self_attn.q_proj.weight" in res["native"]
    bad = {k: v for k, v in res["native"].items() if not v <= TOL}
    assert not bad, bad


@pytest.mark.parametrize("family, change", [
    ("gpt_oss", "model.hf.swiglu_limit=7.0"),  # the clamp binds in the tiny model
    ("gpt_oss", "model.hf.sliding_window=64"),  # the window cuts the test sequences
    ("gpt_oss", "model.hf.layer_types=[full_attention,full_attention]"),
    ("deepseek_v3", "model.hf.rope_parameters={rope_type: yarn, rope_theta: 10000.0, factor: 4.0, mscale: 1.0, "
                    "mscale_all_dim: 0.0, original_max_position_embeddings: 32}"),  # the softmax-scale correction
    ("deepseek_v3", "model.hf.rope_interleave=false"),
])
def test_each_feature_is_seen_by_the_comparison(tiny_hf, family, change):
    """The comparison can fail: ray_moe's model with one feature changed differs from
    transformers' beyond the tolerance."""
    cfg = parity_config(tiny_hf(family), world_size=1, batch=4, seq_len=12)
    ids = batch()
    expected = reference(cfg, cfg.resolve_arch(), ids)
    changed = cfg.with_overrides([change])
    res = model_parity(local_worker(), changed, changed.resolve_arch(), ids, expected, with_clones=False)
    assert res["native"]["logits"] > 1e-4, change


@pytest.mark.parametrize("family", NEW)
def test_greedy_generate_with_the_cache_equals_transformers(tiny_hf, tmp_path, family):
    """Greedy decoding through the KV cache (MLA's cache holds the latent and the rope key;
    gpt-oss's window and sinks apply to the cached keys) gives transformers' tokens, past the
    sliding window."""
    from transformers import AutoModelForCausalLM

    from tests.unit.model.test_hf_models import _engine

    path = tiny_hf(family)
    engine = _engine(tmp_path, path, **{"model.seq_len": 32})
    prompt = [5, 17, 200, 3, 99, 42, 7]
    ours = engine.generate(prompt, 14, temperature=0.0, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------ quantized weights
# References written from the formats' descriptions, independent of the loader's code.
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX: FP4 E2M1 magnitudes of codes 0..7; bit 3 is the sign


def fp8_block_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's format: per block×block tile s = amax / 448, q = float8(w / s), stored
    ``weight`` = q, ``weight_scale_inv`` = s. Returns (q, s, q·s as float32)."""
    out_dim, in_dim = w.shape
    nb_o, nb_i = -(-out_dim // block), -(-in_dim // block)
    scale = torch.zeros(nb_o, nb_i)
    q = torch.zeros(out_dim, in_dim, dtype=torch.float8_e4m3fn)
    deq = torch.zeros(out_dim, in_dim)
    for i in range(nb_o):
        for j in range(nb_i):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = tile.abs().max().clamp(min=1e-12) / E4M3_MAX
            qt = (tile / s).to(torch.float8_e4m3fn)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt
            deq[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt.float() * s
    return q, scale, deq


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OCP MXFP4 of w [..., rows, n] (n a multiple of 32), blocks of 32 along the last dim: the
    shared scale 2^X with X = floor(log2(amax)) - 2 (E2M1's largest exponent), stored as the E8M0
    byte X + 127; each value the nearest E2M1 of v / 2^X (clamped to ±6); two codes a byte, the
    first in the low nibble. Returns (blocks uint8 [..., rows, n/32, 16], scales uint8
    [..., rows, n/32], the represented values float32 [..., rows, n])."""
    *prefix, rows, n = w.shape
    v = w.reshape(*prefix, rows, n // 32, 32)
    amax = v.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100)
    X = torch.floor(torch.log2(amax)) - 2
    scaled = (v / torch.exp2(X)).clamp(-6, 6)
    mags = torch.tensor(E2M1)
    code = (scaled.abs().unsqueeze(-1) - mags).abs().argmin(-1)  # nearest magnitude
    code = code + 8 * (scaled < 0)
    values = torch.where(code >= 8, -1.0, 1.0) * mags[code % 8] * torch.exp2(X)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (X.squeeze(-1) + 127).to(torch.uint8), values.reshape(*prefix, rows, n)


def _rewrite(path: Path, out: Path, convert) -> dict[str, torch.Tensor]:
    """Copy the HF directory ``path`` to ``out`` with its tensors passed through
    ``convert(name, tensor) -> {name: tensor}``; returns the tensors written."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        written.update(convert(name, t))
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    return written


def test_fp8_block_scaled_weights_load_dequantized(tmp_path):
    """DeepSeek-V3's published FP8 linear weights (here in 16×16 blocks, read from
    ``quantization_config.weight_block_size``; the release uses 128×128) load as q · scale."""
    src = tmp_path / "src"
    cfg = save_tiny_model("deepseek_v3", src, seed=2)
    expected: dict[str, torch.Tensor] = {}

    def convert(name, t):
        quantize = t.dim() == 2 and "embed" not in name and "lm_head" not in name and "mlp.gate." not in name
        if not quantize and not name.endswith(("gate_up_proj", "down_proj")):
            return {name: t}
        if t.dim() == 3:  # fused experts as transformers 5 saves them: per expert, as published
            e_out = {}
            for e in range(t.shape[0]):
                leaf = name.rsplit(".", 1)[1]
                parts = ({"gate_proj": t[e].chunk(2)[0], "up_proj": t[e].chunk(2)[1]} if leaf == "gate_up_proj"
                         else {"down_proj": t[e]})
                for proj, w in parts.items():
                    n = name.replace(f"experts.{leaf}", f"experts.{e}.{proj}.weight")
                    q, s, expected[n] = fp8_block_quantize(w, 16)
                    e_out.update({n: q, n + "_scale_inv": s})
            return e_out
        q, s, expected[name] = fp8_block_quantize(t, 16)
        return {name: q, name + "_scale_inv": s}

    dst = tmp_path / "fp8"
    written = _rewrite(src, dst, convert)
    assert any(t.dtype == torch.float8_e4m3fn for t in written.values())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                                  "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg))
    model = build(parity_config(dst, world_size=1, batch=2, seq_len=8), LocalTransport())
    params = dict(model.named_parameters())
    q_b = "model.layers.1.self_attn.q_b_proj.weight"
    assert torch.equal(params["layers.1.self_attn.q_b_proj.weight"], expected[q_b])
    layer = model.moe_layers()[0]
    g, u, d = (expected[f"model.layers.1.mlp.experts.3.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    assert torch.equal(layer.w13[3], torch.cat([g.t(), u.t()], dim=1)) and torch.equal(layer.w2[3], d.t())
    assert q_b + "_scale_inv" in model.source_tensors
    assert (expected[q_b] - load_plain(src, q_b)).abs().max() > 0  # the quantization did round


def load_plain(path: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))[name]


def test_mxfp4_expert_weights_load_dequantized(tmp_path):
    """gpt-oss's published MXFP4 experts (``*_blocks`` / ``*_scales``, stored [E, out, in/32, 16]
    as the release does) load as the values they encode, in ray_moe's split gate|up layout; the
    export after it writes them dequantized and fused."""
    src = tmp_path / "src"
    cfg = save_tiny_model("gpt_oss", src, seed=2, intermediate_size=32)
    expected: dict[str, torch.Tensor] = {}

    def convert(name, t):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return {name: t}
        blocks, scales, values = mxfp4_quantize(t.transpose(1, 2))  # [E, out, in]: blocks run along in
        expected[name] = values.transpose(1, 2)  # the parameter's [E, in, out]
        return {name + "_blocks": blocks, name + "_scales": scales}

    dst = tmp_path / "mxfp4"
    _rewrite(src, dst, convert)
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(cfg))
    model = build(parity_config(dst, world_size=1, batch=2, seq_len=8), LocalTransport())
    layer = model.moe_layers()[1]
    gate_up = expected["model.layers.1.mlp.experts.gate_up_proj"][5]  # [H, 2I], interleaved
    assert torch.equal(layer.w13[5], torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
    assert torch.equal(layer.w2[5], expected["model.layers.1.mlp.experts.down_proj"][5])
    plain = load_plain(src, "model.layers.1.mlp.experts.down_proj")[5]
    assert 0 < (layer.w2[5] - plain).abs().max() < plain.abs().max()  # rounded, not garbage
    assert {"model.layers.1.mlp.experts.down_proj_blocks[5]", "model.layers.1.mlp.experts.down_proj_scales[5]"
            } <= set(model.source_tensors)  # each expert's rows of the packed tensors, not the whole


# ------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("name, total, active", [
    ("deepseek-v3", 671.0e9, 37e9), ("kimi-k2", 1026e9, 32e9), ("moonlight-16b-a3b", 16.0e9, 2.6e9),
    ("gpt-oss-20b", 20.9e9, 3.6e9), ("gpt-oss-120b", 116.8e9, 5.1e9), ("olmoe-1b-7b", 6.9e9, 1.18e9),
    ("minimax-m2", 229e9, 10e9),
])
def test_presets_count_the_published_parameters(name, total, active):
    """Totals as the model cards give them (DeepSeek-V3: 671B without its 14B prediction module;
    gpt-oss: 20.9B / 116.8B, 3.6B / 5.1B active; OLMoE: 6.9B, its card's 1.3B active less the
    0.1B embedding table ray_moe leaves out), within 1%, and active ones within 5%."""
    spec = ArchSpec.from_hf(preset(name))
    assert abs(spec.param_counts()["total"] / total - 1) < 0.01
    assert abs(spec.active_params_per_token() / active - 1) < 0.05


def test_kimi_k2_model_type_is_deepseek_v3():
    cfg = preset("kimi-k2")
    cfg["model_type"] = "kimi_k2"  # what its config.json says
    assert ArchSpec.from_hf(cfg) == ArchSpec.from_hf(preset("kimi-k2"))


def test_bench_expert_cut_keeps_the_groups_valid():
    """``ray-moe bench train --experts``: DeepSeek-V3 at 16 experts keeps 8 groups of 2 and top-4
    groups (top-8 of 8 eligible); gpt-oss has no groups."""
    from ray_moe.bench.train import expert_cut

    cut = expert_cut("deepseek-v3", 16)
    assert cut == {"n_routed_experts": 16, "n_group": 8, "topk_group": 4}
    spec = ArchSpec.from_hf({**preset("deepseek-v3"), **cut, "num_hidden_layers": 4})
    assert spec.num_experts == 16 and spec.top_k == 8
    assert expert_cut("gpt-oss-20b", 8) == {"num_local_experts": 8} and expert_cut("gpt-oss-20b", 0) == {}
    assert ArchSpec.from_hf({**preset("gpt-oss-20b"), "num_hidden_layers": 4}).sliding_layers == (True, False) * 2


def test_refused_configs_name_the_key():
    for other in ("ernie4_5_moe", "qwen2_moe"):
        with pytest.raises(ArchError, match=f"model_type='{other}' is not supported"):
            ArchSpec.from_hf({"model_type": other})
    with pytest.raises(ArchError, match="clip_qkv=8.0 is not supported; supported: null"):
        ArchSpec.from_hf({**preset("olmoe-1b-7b"), "clip_qkv": 8.0})
    cfg = preset("qwen3_moe-tiny")
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(ArchError, match="rope_scaling.rope_type='yarn' is not supported for qwen3_moe"):
        ArchSpec.from_hf(cfg)
    with pytest.raises(ArchError, match="qk_norm_type='per_head' is not supported; supported: per_layer"):
        ArchSpec.from_hf({**preset("minimax-m2"), "qk_norm_type": "per_head"})
    assert ArchSpec.from_hf(preset("minimax-m2")).rotary_dim == 64  # its released rotary_dim, of 128
    cfg = preset("deepseek_v3-tiny")
    cfg["num_key_value_heads"] = 2
    with pytest.raises(ArchError, match="num_key_value_heads=2 is not supported for deepseek_v3"):
        ArchSpec.from_hf(cfg)


def test_expert_bias_clone_gradients_reach_their_owners_during_backward(tiny_hf):
    """gpt-oss's expert biases are expert parameters like w13 and w2: with clones of a rank's own
    experts (W=1), the gradient hooks of :class:`~ray_moe.worker.clone_grads.CloneGradReduction`
    move every clone slot's w13, w2, b13 and b2 gradient onto its owner during backward, as the
    after-backward reduction does, and zero the clone slots."""
    from ray_moe.placement.clones import push_clone_weights, reduce_clone_grads
    from ray_moe.placement.placement import Placement
    from tests.hf_parity import clone_placement
    from ray_moe.worker.clone_grads import CloneGradReduction

    cfg = parity_config(tiny_hf("gpt_oss"), world_size=1, batch=4, seq_len=12, clone_slots=2)
    ids = batch()[:, :-1]
    grads = []
    for hooks in (False, True):
        model = build(cfg, LocalTransport())
        for layer in model.moe_layers():
            layer.set_placement(Placement.from_dict(clone_placement(8, 1, 2).to_dict()))
            push_clone_weights(layer, layer.placement)
        reduction = CloneGradReduction(model.moe_layers(), None, rounded=True) if hooks else None
        if reduction:
            reduction.begin()
        model(ids)[0].square().mean().backward()
        if reduction:
            reduction.launch_rest()
            reduction.add_received(lambda p: p.grad)
            reduction.close()
        else:
            for layer in model.moe_layers():
                reduce_clone_grads(layer, layer.placement)
        grads.append([p.grad.clone() for layer in model.moe_layers() for p in layer.expert_params()])
    assert len(grads[0]) == 2 * 4
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-8) and a[8:].abs().sum() == 0 and a[:8].abs().sum() > 0


def test_grouped_mm_experts_with_biases_and_the_clamp_equal_the_loop():
    """gpt-oss's experts on torch._grouped_mm (a GPU candidate of ``expert_impl: auto``) equal the
    loop reference on the CPU, output and every gradient; padding pairs (slot -1) stay out. The
    Triton path with biases and the clamp: tests/unit/kernels/test_kernels.py (interpreter)."""
    from ray_moe.model.experts import ExpertActivation, expert_ffn
    from ray_moe.validation.errors import rel_err

    g = torch.Generator().manual_seed(0)
    R, K, S, H, I = 20, 2, 4, 16, 8
    slot = torch.randint(-1, S, (R, K), generator=g)
    leaves = [torch.randn(R, H, generator=g), torch.rand(R, K, generator=g) * (slot >= 0),
              torch.randn(S, H, 2 * I, generator=g), torch.randn(S, I, H, generator=g) / 3,
              torch.randn(S, 2 * I, generator=g), torch.randn(S, H, generator=g)]
    act = ExpertActivation("clamped_swiglu", 1.702, 1.0)
    runs = {}
    for impl in ("loop", "grouped_mm"):
        xs = [t.clone().requires_grad_() for t in leaves]
        y = expert_ffn(xs[0], slot, xs[1], xs[2], xs[3], impl=impl, act=act, b13=xs[4], b2=xs[5])
        runs[impl] = [y] + list(torch.autograd.grad(y.square().sum(), xs))
    errs = [rel_err(a, b) for a, b in zip(runs["grouped_mm"], runs["loop"])]
    assert max(errs) <= 1e-5, errs
    plain = expert_ffn(leaves[0], slot, leaves[1], leaves[2], leaves[3], impl="loop")
    assert rel_err(plain, runs["loop"][0]) > 1e-2  # the biases and the clamp change the output
