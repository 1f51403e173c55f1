"""Configs that would train something other than what they say: model.init_from over a byte
model's YAML names the conflicting size; a model.hf key no HF config of the family has (a typo)
is refused with the allowed keys; the saved config.yaml names the family trained."""

from __future__ import annotations

import pytest
import yaml

import ray_moe.driver.trainer as trainer_mod
from ray_moe.config import Config, ConfigError
from tests.unit.driver.stand_in import StandInGroup


def test_init_from_over_a_byte_models_yaml_names_the_size_it_contradicts(tiny_hf):
    with pytest.raises(ConfigError, match=r"model.d_model=96 but model.arch=qwen3_moe takes it from the HF config "
                                          r"\(hidden_size = 32\)"):
        Config.from_yaml("jobs/tiny.yaml", [f"model.init_from={tiny_hf('qwen3_moe')}"])
    with pytest.raises(ConfigError, match="model.n_layers=4 but"):
        Config().with_overrides(["model.n_layers=4", f"model.init_from={tiny_hf('qwen3_moe')}"])
    agreeing = Config().with_overrides([f"model.init_from={tiny_hf('qwen3_moe')}", "model.seq_len=16"])
    assert agreeing.resolve_arch().spec.num_layers == 3  # the byte model's defaults are not a conflict


@pytest.mark.parametrize("key, close", [("num_hiden_layers", "num_hidden_layers"), ("moe_intermediate", None)])
def test_an_unknown_hf_key_is_refused_with_the_allowed_ones(tiny_hf, key, close):
    with pytest.raises(ConfigError) as info:
        Config().with_overrides([f"model.init_from={tiny_hf('qwen3_moe')}", f"model.hf.{key}=4"])
    line = str(info.value)
    assert line.startswith(f"model.hf.{key} is not a key of a qwen3_moe HF config")
    assert "allowed: " in line and "num_hidden_layers" in line and "moe_intermediate_size" in line
    assert (f"did you mean model.hf.{close}?" in line) == (close is not None)


def test_known_hf_keys_pass(tiny_hf):
    cfg = Config().with_overrides([f"model.init_from={tiny_hf('qwen3_moe')}", "model.hf.num_hidden_layers=2",
                                   "model.hf.head_dim=16", "model.hf.rope_theta=10000.0"])
    assert cfg.resolve_arch().spec.num_layers == 2


def test_saved_config_yaml_names_the_family_trained(tiny_hf, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_mod, "WorkerGroup", lambda config, world_size=None, arch=None: StandInGroup(1))
    monkeypatch.setattr(trainer_mod, "connect", lambda *a, **k: None)
    cfg = Config.from_dict({"model": {"init_from": tiny_hf("qwen3_moe"), "seq_len": 16},
                            "parallel": {"world_size": 1, "device": "cpu"}, "data": {"max_bytes": 100_000},
                            "train": {"batch_size": 2, "run_dir": str(tmp_path / "run"), "resume": False}})
    assert cfg.model.arch == "byte"  # as given: the family comes from init_from's config.json
    with trainer_mod.Trainer(cfg, progress=False) as t:
        saved = yaml.safe_load((t.run_dir / "config.yaml").read_text())
    assert saved["model"]["arch"] == "qwen3_moe" and saved["model"]["init_from"] == tiny_hf("qwen3_moe")
    assert Config.from_dict(saved).resolve_arch().spec.family == "qwen3_moe"
