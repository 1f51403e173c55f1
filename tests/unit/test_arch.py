"""HF architectures in the config: presets and config.json files resolve to the ray_moe keys they
set; an unsupported architecture or option is refused with the key and what is supported;
explicit ray_moe keys that disagree with the HF config are named; parameter counts match a built
model."""

from __future__ import annotations

import json

import pytest

from ray_moe.arch import PRESETS, ArchError, ArchSpec, preset
from ray_moe.config import Config, ConfigError


def hf_cfg(name: str = "qwen3_moe-tiny", **extra) -> Config:
    return Config.from_dict({"model": {"hf_config": name, **extra}, "parallel": {"world_size": 1}})


def refuse(raw: dict, *fragments: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(raw)
    for frag in fragments:
        assert frag in str(info.value), f"{frag!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("name", PRESETS)
def test_presets_resolve_and_round_trip(name):
    cfg = Config.from_dict({"model": {"hf_config": name}, "parallel": {"world_size": 1}})
    spec = ArchSpec.from_hf(preset(name))
    resolved = cfg.resolve_arch()
    assert resolved.spec == spec and resolved.hf_config == preset(name)
    # validate() rewrites no key: the sizes live in the resolved spec, and the saved config states none
    assert cfg.model == Config.from_dict({"model": {"hf_config": name}}).model
    assert (cfg.model.arch, cfg.model.d_model, cfg.moe.num_experts) == ("byte", 64, 8)
    assert "d_model" not in cfg.to_dict()["model"] and "top_k" not in cfg.to_dict()["moe"]
    assert cfg.validate() == resolved
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_published_sizes():
    """The presets' parameter counts are the published ones (30.5B/3.3B, 46.7B/12.9B, 106B/12B)."""
    q = ArchSpec.from_hf(preset("qwen3-30b-a3b")).param_counts()["total"]
    m = ArchSpec.from_hf(preset("mixtral-8x7b")).param_counts()["total"]
    g = ArchSpec.from_hf(preset("glm-4.5-air")).param_counts()["total"]
    assert 30.4e9 < q < 30.6e9 and 46.6e9 < m < 46.8e9 and 106e9 < g < 107e9


def test_config_json_file_and_directory(tmp_path):
    hf = preset("mixtral-tiny")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    by_dir = Config.from_dict({"model": {"hf_config": str(tmp_path)}, "parallel": {"world_size": 1}})
    by_file = by_dir.with_overrides([f"model.hf_config={tmp_path / 'config.json'}"])
    assert by_dir.resolve_arch() == by_file.resolve_arch()
    assert by_dir.resolve_arch().spec.family == "mixtral" and by_dir.resolve_arch().spec.num_experts == 8
    # the HF keys can be changed from the config (the whole HF config inline works too)
    two = by_dir.with_overrides(["model.hf.num_local_experts=4"])
    assert two.resolve_arch().spec.num_experts == 4
    inline = Config.from_dict({"model": {"hf": hf}, "parallel": {"world_size": 1}})
    assert inline.resolve_arch().spec == by_dir.resolve_arch().spec
    # a key the HF config sets may be given with the HF config's value, and survives a round trip
    same = Config.from_dict({"model": {"hf": hf, "d_model": hf["hidden_size"]}, "parallel": {"world_size": 1}})
    assert Config.from_dict(same.to_dict()) == same


@pytest.mark.parametrize("hf,fragments", [
    ({"model_type": "llama"}, ["model_type='llama'", "qwen3_moe, mixtral, glm4_moe"]),
    ({"model_type": None, "architectures": ["LlamaForCausalLM"]},
     ["LlamaForCausalLM", "Qwen3MoeForCausalLM, MixtralForCausalLM, Glm4MoeForCausalLM"]),
    ({"sliding_window": 4096}, ["sliding_window=4096", "supported: null"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope_scaling.rope_type='yarn'", "supported: default"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "supported: silu"]),
    ({"router_jitter_noise": 0.1}, ["router_jitter_noise=0.1", "supported: 0.0"]),
    ({"num_local_experts": "8"}, ["num_local_experts='8' must be an integer"]),
])
def test_unsupported_hf_configs_name_the_key(hf, fragments):
    refuse({"model": {"hf_config": "mixtral-tiny", "hf": hf}, "parallel": {"world_size": 1}},
           "model.hf_config='mixtral-tiny'", *fragments)


def test_unsupported_options_of_the_other_families():
    refuse({"model": {"hf_config": "qwen3_moe-tiny", "hf": {"use_sliding_window": True}}},
           "use_sliding_window=true is not supported; supported: false")
    refuse({"model": {"hf_config": "glm4_moe-tiny", "hf": {"n_group": 3}}}, "n_group=3", "n_routed_experts=8")
    refuse({"model": {"hf_config": "glm4_moe-tiny", "hf": {"rope_parameters": {"rope_type": "dynamic"}}}},
           "rope_parameters.rope_type='dynamic'")


def test_sources_and_conflicts_are_named(tmp_path):
    refuse({"model": {"hf_config": "qwen3-30b"}}, "'qwen3-30b' is neither a preset", "qwen3-30b-a3b")
    (tmp_path / "config.json").write_text("{not json")
    refuse({"model": {"hf_config": str(tmp_path)}}, "is not valid JSON")
    refuse({"model": {"arch": "glm4_moe"}}, "model.arch=glm4_moe needs model.hf_config")
    refuse({"model": {"arch": "mixtral", "hf_config": "qwen3_moe-tiny"}}, "model.arch=mixtral", "qwen3_moe config")
    refuse({"model": {"hf_config": "qwen3_moe-tiny", "d_model": 64}, "parallel": {"world_size": 1}},
           "model.d_model=64", "hidden_size = 96", "model.hf.KEY=VALUE")
    with pytest.raises(ConfigError, match="moe.top_k=4 but model.arch=qwen3_moe"):
        hf_cfg().with_overrides(["moe.top_k=4"])
    with pytest.raises(ConfigError, match="model.activation_checkpointing='some'"):
        hf_cfg().with_overrides(["model.activation_checkpointing=some"])
    refuse({"model": {"hf_config": "qwen3_moe-tiny"}, "moe": {"bias_update_rate": -1}}, "moe.bias_update_rate=-1")
    # the ray_moe world-size checks see the HF config's experts
    refuse({"model": {"hf_config": "mixtral-tiny"}, "parallel": {"world_size": 3}}, "moe.num_experts=8", "world_size=3")


@pytest.mark.parametrize("name", ["qwen3_moe-tiny", "mixtral-tiny", "glm4_moe-tiny"])
def test_param_counts_match_a_built_model(name):
    from ray_moe.comm.local import LocalTransport
    from tests.support import build

    cfg = hf_cfg(name)
    model = build(cfg, LocalTransport())
    counts = ArchSpec.from_hf(preset(name)).param_counts()
    assert sum(p.numel() for p in model.parameters()) == counts["total"]


def test_memory_plan_of_the_readme():
    """docs/ARCHITECTURE.md's real-size table comes from these numbers (16 B per parameter)."""
    q = ArchSpec.from_hf(preset("qwen3-30b-a3b"))
    assert round(q.memory_per_rank(8)["state_bytes"] / 2**30, 1) == 77.0
    assert round(q.memory_per_rank(16)["state_bytes"] / 2**30, 1) == 50.0
    m = ArchSpec.from_hf(preset("mixtral-8x7b"))
    assert round(m.memory_per_rank(8)["state_bytes"] / 2**30, 1) == 107.9
    assert q.activation_bytes_per_token("full", 8) < q.activation_bytes_per_token("moe", 8) \
        < q.activation_bytes_per_token("none", 8)


def test_state_per_rank_by_zero_stage_and_moment_dtype():
    """The parts add up by hand: bf16 weight 2 B, bf16 gradient 2 B, float32 master 4 B, moments
    8 B (bf16: 4 B); stages 1 and 2 divide the replicated master and moments by W and hold float32
    bucket gradients (stage 1: all; stage 2: two buckets) plus the reduced chunks."""
    q = ArchSpec.from_hf(preset("qwen3-30b-a3b"))
    W, c = 8, q.param_counts()
    rep, exp = c["replicated"], sum(q.moe_layers) * q.num_experts // W * c["per_expert"]
    base = q.memory_per_rank(W)
    assert base["backward_bytes"] == base["state_bytes"] == 16 * (rep + exp)
    bf16 = q.memory_per_rank(W, moments="bfloat16")
    assert base["backward_bytes"] - bf16["backward_bytes"] == 4 * (rep + exp)
    one = q.memory_per_rank(W, zero_stage=1)
    assert one["backward_bytes"] == pytest.approx(exp * 16 + rep * (2 + 4 + 4 / W + 12 / W))
    two = q.memory_per_rank(W, zero_stage=2, bucket_size=1000)
    assert two["backward_bytes"] == pytest.approx(exp * 16 + rep * (2 + 4 / W + 12 / W) + 2 * 1000 * 4)
    assert q.memory_per_rank(1, zero_stage=2)["backward_bytes"] == q.memory_per_rank(1)["backward_bytes"]
    with pytest.raises(ArchError, match="zero_stage=3"):
        q.memory_per_rank(W, zero_stage=3)


@pytest.mark.parametrize("rows,vocab,hidden", [(16384, 151936, 2048), (8192, 32000, 4096), (100, 256, 96)])
def test_loss_chunk_rule_is_the_loss_modules(rows, vocab, hidden):
    from ray_moe.arch import _auto_chunk
    from ray_moe.model.loss import auto_chunk

    assert _auto_chunk(rows, vocab, hidden) == auto_chunk(rows, vocab, hidden)


def test_peak_and_smallest_world_size_of_the_readme():
    """Qwen3-30B-A3B on 8 x 80 GB with full recompute: not as before, but with ZeRO (stage 2, or
    stage 1 with bf16 moments); GLM-4.5-Air needs stage 2 and W=32 with bf16 moments."""
    q = ArchSpec.from_hf(preset("qwen3-30b-a3b"))
    budget = 0.9 * 80 * 2**30
    assert q.peak_bytes_per_rank(8, 16384, "full")["peak"] > budget
    assert q.peak_bytes_per_rank(8, 16384, "full", zero_stage=1, moments="bfloat16")["peak"] < budget
    assert q.smallest_world_size(budget, 16384) == 16
    assert q.smallest_world_size(budget, 16384, zero_stage=2) == 8
    g = ArchSpec.from_hf(preset("glm-4.5-air"))
    assert g.smallest_world_size(budget, 16384) is None
    assert g.smallest_world_size(budget, 16384, zero_stage=2, moments="bfloat16") == 32
    # the backward working set and the loss come on top of the saved activations
    assert q.activation_peak_bytes_per_token("full", 8) > q.activation_bytes_per_token("full", 8)
    assert q.loss_bytes(16384)["forward"] > q.vocab_size * q.hidden_size * 4


def test_arch_cli_prints_the_stages_and_the_fit(capsys):
    from ray_moe.arch import main

    assert main(["qwen3-30b-a3b", "--world-sizes", "8,16"]) == 0
    out = capsys.readouterr().out
    assert "stage 2, bf16" in out and "smallest world size on 80 GiB GPUs" in out and "| 8 | 5.16B |" in out


def test_checkpoint_compatibility_names_the_architecture(tmp_path):
    from ray_moe.checkpoint import check_compatible

    byte = Config.from_dict({"parallel": {"world_size": 1}})
    old = byte.to_dict()
    del old["model"]["arch"]  # a checkpoint written before model.arch existed: the byte model
    check_compatible({"config": old}, byte, tmp_path, byte.resolve_arch())
    with pytest.raises(ConfigError, match="model.arch=qwen3_moe but checkpoint"):
        check_compatible({"config": old}, hf_cfg(), tmp_path, hf_cfg().resolve_arch())
    # an HF run's checkpoint: compared by its HF config (meta hf_config), whatever its config says
    hf = hf_cfg()
    meta = {"config": hf.to_dict(), "hf_config": hf.resolve_arch().hf_config}
    check_compatible(meta, hf, tmp_path, hf.resolve_arch())
    wider = hf.with_overrides(["model.hf.moe_intermediate_size=64"])
    with pytest.raises(ConfigError, match="moe.expert_hidden=64 but checkpoint .* has 128"):
        check_compatible(meta, wider, tmp_path, wider.resolve_arch())


def test_clone_slots_add_weights_and_gradients_but_no_optimizer_state():
    """A clone slot holds its bf16 weight and gradient (4 bytes a parameter at the end of backward),
    no float32 master or moments; at the update, with float32 clone sums, the experts' gradients
    are the native slots' float32 master gradients, with bf16 ones the bf16 gradients of every slot."""
    q = ArchSpec.from_hf(preset("qwen3-30b-a3b"))
    per_slot = sum(q.moe_layers) * q.param_counts()["per_expert"]
    native = per_slot * q.num_experts // 8
    base, cloned = q.memory_per_rank(8, zero_stage=2), q.memory_per_rank(8, 2, zero_stage=2)
    assert cloned["masters"] == base["masters"] and cloned["moments"] == base["moments"]
    assert cloned["backward_bytes"] - base["backward_bytes"] == pytest.approx(2 * per_slot * (2 + 2))
    assert cloned["grads_update"] - base["grads_update"] == pytest.approx(native * 4 - native * 2)
    rounded = q.memory_per_rank(8, 2, zero_stage=2, grad_reduce_dtype="bfloat16")
    assert rounded["grads_update"] - base["grads_update"] == pytest.approx(2 * per_slot * 2)
