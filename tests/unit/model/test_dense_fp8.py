"""``model.dense_precision: fp8`` (model/dense_fp8.py) on the CPU: the key's validation (one line,
exit 2), which linears are selected (the blocks' attention projections, shared experts and dense
MLPs whose dimensions are multiples of 16; never the LM head), a GPU without FP8 tensor cores
refused, and, where torchao imports, the conversion itself: the selected modules become torchao's
Float8Linear with the same parameters, the rest untouched, and the model trains with losses
within FP8's error of the bf16 model's from the same seed."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn

from ray_moe.cli import main
from ray_moe.comm.local import LocalTransport
from ray_moe.config import Config, ConfigError
from ray_moe.model import dense_fp8
from tests.support import build, engine


def _config(preset: str, *over: str) -> Config:
    return Config().with_overrides([f"model.hf_config={preset}", "model.seq_len=16", "parallel.world_size=1",
                                    "parallel.device=cpu", "train.batch_size=4", "model.compile=none",
                                    "train.lr=3e-3", "train.warmup_steps=1", "data.max_bytes=200000", *over])


def _expected(cfg: Config) -> list[str]:
    """The linears the conversion must select, named from the spec (not from the filter)."""
    spec = cfg.resolve_arch().spec
    attn = (["q_a_proj", "q_b_proj", "kv_b_proj", "o_proj"] if spec.attention == "mla"
            else ["q_proj", "k_proj", "v_proj", "o_proj"])
    names = []
    for i, moe in enumerate(spec.moe_layers):
        names += [f"layers.{i}.self_attn.{p}" for p in attn]
        mlp = f"layers.{i}.mlp.shared_experts" if moe else f"layers.{i}.mlp"
        if not moe or spec.shared_hidden:
            names += [f"{mlp}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


def test_the_key_is_checked_in_one_line(tmp_path, capsys, monkeypatch):
    assert Config().model.dense_precision == "bf16"
    with pytest.raises(ConfigError, match=r"model.dense_precision='fp16' is not allowed; choose one of bf16, fp8"):
        Config().with_overrides(["model.dense_precision=fp16"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match="torchao is not installed"):
        Config().with_overrides(["model.dense_precision=fp8"])
    Config().with_overrides(["model.dense_precision=bf16"])  # no torchao needed
    (tmp_path / "c.yaml").write_text(f"model: {{dense_precision: fp8}}\ntrain: {{run_dir: {tmp_path / 'run'}}}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.dense_precision=fp8" in err[0] and "torchao is not installed" in err[0], err
    assert not (tmp_path / "run").exists()


def test_tokens_per_rank_must_suit_the_fp8_weight_gradient(tmp_path, capsys):
    """On the GPU torch._scaled_mm needs the weight gradient's inner dimension, the rank's tokens
    (train.batch_size / W x model.seq_len), a multiple of 16 (the CPU's emulation has no such
    rule): refused in one line before anything runs, and a world size that breaks it is not one
    the config can train on."""
    pytest.importorskip("torchao")
    over = ["model.dense_precision=fp8", "model.seq_len=20", "train.batch_size=4"]
    with pytest.raises(ConfigError, match=r"model.dense_precision=fp8 needs each rank's tokens per step, "
                                          r"train.batch_size / parallel.world_size x model.seq_len = 2 x 20 = 40, "
                                          r"to be a multiple of 16"):
        Config().with_overrides([*over, "parallel.world_size=2"])
    cfg = Config().with_overrides([*over, "parallel.world_size=1"])  # 80 tokens
    assert cfg.world_size_error(1) is None and "= 40, to be a multiple of 16" in cfg.world_size_error(2)
    Config().with_overrides(["model.seq_len=20", "train.batch_size=4", "parallel.world_size=2"])  # bf16: any count
    (tmp_path / "c.yaml").write_text("model: {dense_precision: fp8, seq_len: 20}\n"
                                     f"train: {{batch_size: 4, run_dir: {tmp_path / 'run'}}}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a multiple of 16" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("preset", ["glm4_moe-tiny", "deepseek_v3-tiny", "qwen3_moe-tiny"])
def test_the_blocks_dense_linears_are_selected(preset):
    """glm4_moe: a dense first layer and shared experts; deepseek_v3: MLA, whose kv_a_proj_with_mqa
    (kv_lora_rank + rope dims = 40 columns) is no multiple of 16 and stays; qwen3_moe: attention only."""
    cfg = _config(preset)
    model = build(cfg, LocalTransport())
    names = dense_fp8.fp8_dense_names(model)
    assert names == _expected(cfg)
    assert "lm_head" not in names and all(n.startswith("layers.") for n in names)
    if preset == "deepseek_v3-tiny":
        kv_a = model.layers[0].self_attn.kv_a_proj_with_mqa
        assert kv_a.weight.shape[0] % 16 and not dense_fp8.fp8_dense_filter(kv_a, "layers.0.self_attn.kv_a_proj_with_mqa")
    assert not dense_fp8.fp8_dense_filter(nn.Linear(32, 32), "lm_head")
    assert not dense_fp8.fp8_dense_filter(nn.Embedding(32, 32), "layers.0.x")


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    assert dense_fp8.device_error("cpu") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    error = dense_fp8.device_error("cuda")
    assert error.startswith("model.dense_precision=fp8 needs a GPU with FP8 tensor cores") and "sm_80" in error
    with pytest.raises(ConfigError, match="sm_80"):
        dense_fp8.convert_dense_to_fp8(nn.Sequential(), "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert dense_fp8.device_error("cuda") is None


def test_conversion_keeps_the_parameters_and_trains():
    float8_linear = pytest.importorskip("torchao.float8.float8_linear")
    bf16_cfg = _config("glm4_moe-tiny")
    fp8_cfg = bf16_cfg.with_overrides(["model.dense_precision=fp8"])
    bf16, fp8 = engine(bf16_cfg), engine(fp8_cfg)
    selected = set(_expected(fp8_cfg))
    assert set(fp8.model.fp8_dense) == selected and bf16.model.fp8_dense == ()
    for name, module in fp8.model.named_modules():
        if name in selected:
            assert isinstance(module, float8_linear.Float8Linear), name
        else:
            assert not isinstance(module, float8_linear.Float8Linear), name
    assert type(fp8.model.lm_head) is nn.Linear
    ref = {k: v.clone() for k, v in bf16.model.state_dict().items()}
    assert fp8.model.state_dict().keys() == ref.keys()
    assert all(torch.equal(v, ref[k]) for k, v in fp8.model.state_dict().items())
    losses = {name: [e.train_step()["loss"] for _ in range(4)] for name, e in (("bf16", bf16), ("fp8", fp8))}
    assert all(math.isfinite(v) for v in losses["bf16"] + losses["fp8"])
    # one batch, one set of weights: the first losses differ by FP8's rounding of the dense GEMMs alone
    assert losses["fp8"][0] != losses["bf16"][0] and abs(losses["fp8"][0] / losses["bf16"][0] - 1) < 0.01
    assert losses["fp8"][-1] < losses["fp8"][0]
    q = "layers.0.self_attn.q_proj.weight"  # a converted weight is the optimizer's as before
    assert not torch.equal(fp8.model.state_dict()[q], ref[q])


@pytest.mark.parametrize("preset", ["glm4_moe-tiny", "deepseek_v3-tiny", "deepseek-v3", "qwen3-30b-a3b"])
def test_memory_model_counts_the_fp8_dense_backward(preset):
    """The memory model's dense linears are the model's (built tiny ones compared module by module),
    and FP8 dense linears add their backward copies at the peak, not to the saved activations."""
    spec = _config(preset).resolve_arch().spec
    if preset.endswith("tiny"):
        model = build(_config(preset), LocalTransport())
        built = {(m.in_features, m.out_features) for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and n.startswith("layers.")}
        assert built == set(spec.dense_linear_shapes())
    fp8_shapes = [(i, o) for i, o in spec.dense_linear_shapes() if i % 16 == 0 and o % 16 == 0]
    assert spec.fp8_dense_backward_bytes_per_token() == max(2 * (i + o) + 8 * max(i, o) for i, o in fp8_shapes)
    bf16 = spec.peak_bytes_per_rank(1, 1024, "none")
    fp8 = spec.peak_bytes_per_rank(1, 1024, "none", dense_precision="fp8")
    assert fp8["peak"] > bf16["peak"] and fp8["activations"] - bf16["activations"] == pytest.approx(
        1024 * spec.fp8_dense_backward_bytes_per_token())
    # one linear's or one expert layer's copies at a time: the larger of the two counts
    both = spec.activation_peak_bytes_per_token("none", 1, expert_precision="fp8", dense_precision="fp8")
    experts = spec.activation_peak_bytes_per_token("none", 1, expert_precision="fp8")
    assert both == experts + max(0.0, spec.fp8_dense_backward_bytes_per_token() - spec.fp8_backward_bytes_per_token(1))
    with pytest.raises(ValueError, match="dense_precision='fp16' is not allowed"):
        spec.activation_peak_bytes_per_token("none", 1, dense_precision="fp16")


def test_compiled_blocks_trace_the_fp8_linears_whole():
    """model.compile=blocks compiles each block's regions with fullgraph=True: torchao's
    Float8Linear must trace whole (aot_eager: the autograd graphs without code generation) and
    give the eager model's logits."""
    pytest.importorskip("torchao.float8")
    model = build(_config("glm4_moe-tiny", "model.dense_precision=fp8"), LocalTransport())
    ids = torch.randint(0, model.spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    eager, _ = model(ids)
    model.compile_blocks("aot_eager")
    compiled, _ = model(ids)
    compiled.sum().backward()
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-5)
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
