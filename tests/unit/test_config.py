"""Config: every validation rule names its dotted key and the bad value; unknown keys get a
suggestion; YAML loading, ``key=value`` overrides, round trips and the shipped job files."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import yaml

from ray_moe.config import Config, ConfigError

REPO = Path(__file__).resolve().parents[2]


def build(overrides: dict[str, object]) -> Config:
    """Config.from_dict from flat ``{"section.key": value}`` pairs."""
    raw: dict[str, dict] = {}
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        raw.setdefault(section, {})[key] = value
    return Config.from_dict(raw)


def reject(overrides: dict[str, object], *fragments: str) -> str:
    """The ConfigError for ``overrides``; every fragment must appear in its message."""
    with pytest.raises(ConfigError) as info:
        build(overrides)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    return msg


# ------------------------------------------------------------------------------- defaults
def test_defaults_validate():
    cfg = Config()
    cfg.validate()
    assert Config.from_dict(None) == cfg
    assert Config.from_dict({}) == cfg
    assert Config.from_dict({"model": None}) == cfg  # an empty section in YAML is allowed


def test_dtype_table_gives_torch_dtypes_and_element_sizes():
    import torch

    from ray_moe.config import DTYPES, element_size, torch_dtype

    assert set(DTYPES) == {"float32", "bfloat16"}
    assert torch_dtype("bfloat16") is torch.bfloat16 and element_size("bfloat16") == 2
    assert element_size("float32") == 4


# ------------------------------------------------------------------------ validate(): ranges
# (dotted key, bad value, what the message must say is allowed)
POSITIVE = [
    ("model.n_layers", 0),
    ("model.d_model", 0),
    ("model.d_model", -64),
    ("model.n_heads", 0),
    ("model.seq_len", 0),
    ("model.vocab_size", 0),
    ("moe.num_experts", 0),
    ("moe.expert_hidden", 0),
    ("parallel.world_size", 0),
    ("parallel.world_size", -2),
    ("parallel.startup_timeout_s", 0),
    ("parallel.collective_timeout_s", -1.5),
    ("train.batch_size", 0),
    ("train.eval_batches", 0),
    ("train.log_interval", 0),
    ("train.step_timeout_s", 0),
    ("train.health_check_interval_s", 0),
    ("balance.interval", 0),
    ("parallel.nvshmem_spin_limit", 0),
]


@pytest.mark.parametrize("key,value", POSITIVE, ids=[f"{k}={v}" for k, v in POSITIVE])
def test_must_be_positive(key, value):
    extra = {"moe.top_k": 0} if key == "moe.num_experts" else {}
    reject({key: value, **extra}, f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}", "> 0")


NON_NEGATIVE = [
    ("model.dense_hidden", -1),
    ("data.max_bytes", -1),
    ("train.steps", -1),
    ("train.weight_decay", -0.1),
    ("train.grad_clip", -1.0),
    ("train.warmup_steps", -1),
    ("train.eval_interval", -1),
    ("train.checkpoint_interval", -5),
    ("train.max_failures", -1),
    ("moe.aux_loss_coef", -0.01),
    ("balance.clone_slots", -1),
]


@pytest.mark.parametrize("key,value", NON_NEGATIVE, ids=[f"{k}={v}" for k, v in NON_NEGATIVE])
def test_must_be_non_negative(key, value):
    reject({key: value}, f"{key}={value}", ">= 0")


@pytest.mark.parametrize("key,value", [
    ("train.steps", 0), ("train.warmup_steps", 0), ("train.eval_interval", 0),
    ("train.checkpoint_interval", 0), ("train.max_failures", 0), ("balance.clone_slots", 0),
    ("model.dense_hidden", 0), ("data.max_bytes", 0), ("train.weight_decay", 0.0),
    ("train.grad_clip", 0.0), ("moe.aux_loss_coef", 0.0),
])
def test_zero_allowed_where_documented(key, value):
    assert build({key: value}).get(key) == value


@pytest.mark.parametrize("key,value", [("train.lr", 0.0), ("train.lr", -1e-3), ("parallel.cpu_per_worker", 0.0),
                                       ("parallel.cpu_per_worker", -1.0)])
def test_strictly_positive_floats(key, value):
    reject({key: value}, f"{key}={value}", "> 0")


@pytest.mark.parametrize("key,value", [
    ("data.val_fraction", -0.1), ("data.val_fraction", 1.0), ("data.val_fraction", 1.5),
    ("balance.ema", -0.5), ("balance.ema", 1.0),
])
def test_unit_interval(key, value):
    reject({key: value}, f"{key}={value}", "[0, 1)")


def test_unit_interval_lower_bound_allowed():
    cfg = build({"data.val_fraction": 0.0, "balance.ema": 0.0})
    assert cfg.data.val_fraction == 0.0 and cfg.balance.ema == 0.0


# NaN compares False against every bound, so a `value <= 0` / `value < 0` check lets it through.
NAN_CASES = [
    ("parallel.startup_timeout_s", False),
    ("parallel.collective_timeout_s", False),
    ("data.val_fraction", False),
    ("balance.ema", False),
    ("train.step_timeout_s", False),
    ("train.lr", True),
    ("parallel.cpu_per_worker", True),
    ("train.weight_decay", True),
    ("train.grad_clip", True),
    ("moe.aux_loss_coef", True),
]


@pytest.mark.parametrize("key", [k for k, _ in NAN_CASES])
def test_nan_rejected(key):
    reject({key: math.nan}, f"{key}=nan")


# --------------------------------------------------------------------- validate(): relations
def test_num_experts_divisible_by_world_size():
    msg = reject({"moe.num_experts": 30, "parallel.world_size": 4})
    assert "moe.num_experts=30 is not divisible by parallel.world_size=4" in msg


def test_num_experts_divisible_ok():
    cfg = build({"moe.num_experts": 12, "parallel.world_size": 3, "train.batch_size": 6})
    assert cfg.moe.num_experts % cfg.parallel.world_size == 0


def test_batch_size_divisible_by_world_size():
    reject({"train.batch_size": 10, "parallel.world_size": 4, "moe.num_experts": 8},
           "train.batch_size=10 is not divisible by parallel.world_size=4")
    assert build({"train.batch_size": 12, "parallel.world_size": 4}).train.batch_size == 12


def test_d_model_divisible_by_heads():
    reject({"model.d_model": 65, "model.n_heads": 4},
           "model.d_model=65 is not divisible by model.n_heads=4")


@pytest.mark.parametrize("top_k", [0, -1, 9])
def test_top_k_range(top_k):
    reject({"moe.top_k": top_k, "moe.num_experts": 8},
           f"moe.top_k={top_k}", "between 1 and moe.num_experts=8")


@pytest.mark.parametrize("top_k", [1, 8])
def test_top_k_bounds_inclusive(top_k):
    assert build({"moe.top_k": top_k, "moe.num_experts": 8}).moe.top_k == top_k


@pytest.mark.parametrize("transport", ["nccl", "nvshmem"])
def test_gpu_transport_on_cpu_device(transport):
    reject({"parallel.transport": transport, "parallel.device": "cpu"},
           f"parallel.transport={transport}", "parallel.device=cpu", "gloo")


@pytest.mark.parametrize("transport", ["nccl", "nvshmem", "auto"])
def test_gpu_transport_on_cuda_or_auto_device_ok(transport):
    for device in ("cuda", "auto"):
        build({"parallel.transport": transport, "parallel.device": device})


def test_transport_device_rule_is_one_function_for_the_configured_and_the_resolved_device():
    """The config (device as configured) and the group (device that ``auto`` resolved to) ask the
    same rule; ``auto`` fits every transport until it is resolved."""
    from ray_moe.config import transport_device_error

    assert transport_device_error("gloo", "auto") is None and transport_device_error("nvshmem", "auto") is None
    assert transport_device_error("auto", "cpu") is None and transport_device_error("auto", "cuda") is None
    msg = transport_device_error("nccl", "cpu", "parallel.device=auto and the cluster has no GPUs")
    assert msg == ("parallel.transport=nccl needs GPUs but parallel.device=auto and the cluster has no GPUs; "
                   "use transport gloo or auto")
    reject({"parallel.transport": "gloo", "parallel.device": "cuda"},
           "parallel.transport=gloo cannot move CUDA tensors but parallel.device=cuda")


def test_world_size_rule_answers_for_any_world_size_without_changing_the_config():
    """The group owns the world size: the rule that checks parallel.world_size also checks the
    group's, and nothing in the config changes."""
    cfg = build({"moe.num_experts": 8, "train.batch_size": 12, "parallel.world_size": 4})
    before = cfg.to_dict()
    assert cfg.world_size_error(4) is None and cfg.world_size_error(2) is None
    assert cfg.world_size_error(8, "the group's world_size") == (
        "train.batch_size=12 is not divisible by the group's world_size=8")
    assert cfg.world_size_error(3).startswith("moe.num_experts=8 is not divisible by parallel.world_size=3; set parallel.expert_parallel")
    cfg.validate()
    assert cfg.to_dict() == before  # validation checks; it never rewrites (byte arch)


def test_run_dir_must_not_be_empty():
    reject({"train.run_dir": ""}, "train.run_dir=''")


def test_balance_enabled_needs_clone_slots():
    reject({"balance.enabled": True, "balance.clone_slots": 0},
           "balance.enabled=true", "balance.clone_slots")
    assert build({"balance.enabled": True, "balance.clone_slots": 1}).balance.enabled


# ------------------------------------------------------------------------ validate(): choices
CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "moe.expert_impl": ("auto", "loop", "grouped_mm", "triton"),
    "parallel.transport": ("auto", "nvshmem", "nccl", "gloo"),
    "parallel.device": ("auto", "cpu", "cuda"),
    "parallel.placement_strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    "train.nonfinite": ("skip", "stop"),
}


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_choice_rejected_lists_allowed(key):
    bad = "float16" if key == "model.dtype" else "bogus"
    reject({key: bad}, f"{key}='{bad}'", *CHOICES[key])


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in sorted(CHOICES.items()) for v in vs])
def test_choice_accepted(key, value):
    extra = {"parallel.device": "cuda"} if value in ("nccl", "nvshmem") else {}
    assert build({key: value, **extra}).get(key) == value


def test_choice_is_case_sensitive():
    reject({"parallel.placement_strategy": "strict_spread"}, "parallel.placement_strategy='strict_spread'")


# --------------------------------------------------------------------------- _coerce: types
# (key, bad value, what the message says the type must be)
TYPE_ERRORS = [
    ("model.n_layers", 2.5, "must be an integer"),
    ("model.n_layers", "2", "must be an integer"),
    ("parallel.world_size", True, "must be an integer"),  # bool is not an int here
    ("moe.num_experts", None, "must be an integer"),
    ("train.lr", "fast", "must be a number"),
    ("train.lr", True, "must be a number"),
    ("parallel.cpu_per_worker", [1], "must be a number"),
    ("balance.enabled", "yes please", "must be true or false"),
    ("balance.enabled", 1, "must be true or false"),
    ("model.dense_first_layer", 0, "must be true or false"),
    ("parallel.overlap_param_gather", "yes", "must be true or false"),
    ("moe.expert_precision", "fp16", "is not allowed; choose one of bf16, fp8"),
    ("model.dtype", 32, "must be a string"),
    ("train.run_dir", ["a"], "must be a string"),
    ("data.paths", 3, "must be a list of strings"),
    ("data.paths", ["a", 3], "must be a list of strings"),
    ("data.paths", {"a": 1}, "must be a list of strings"),
]


@pytest.mark.parametrize("key,value,what", TYPE_ERRORS, ids=[f"{k}={v!r}" for k, v, _ in TYPE_ERRORS])
def test_type_errors_name_key_and_value(key, value, what):
    reject({key: value}, f"{key}={value!r}", what)


def test_coercions():
    cfg = build({"train.lr": 1, "parallel.cpu_per_worker": 2, "data.paths": "corpus/*.txt"})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert isinstance(cfg.parallel.cpu_per_worker, float)
    assert cfg.data.paths == ["corpus/*.txt"]  # one path becomes a one-item list
    assert build({"data.paths": ("a", "b")}).data.paths == ["a", "b"]


def test_section_must_be_mapping():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"model": 3})
    assert "model" in str(info.value) and "mapping" in str(info.value) and "3" in str(info.value)
    with pytest.raises(ConfigError, match="train must be a mapping"):
        Config.from_dict({"train": ["steps", 3]})


# ---------------------------------------------------------------------------- unknown keys
def test_unknown_section_suggests_closest():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"modle": {"d_model": 32}})
    msg = str(info.value)
    assert "unknown config key 'modle'" in msg and "did you mean 'model'?" in msg


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"moe": {"num_expert": 8}})
    msg = str(info.value)
    assert "'moe.num_expert'" in msg and "did you mean 'moe.num_experts'?" in msg
    assert "moe.top_k" in msg  # the valid keys of the section are listed


@pytest.mark.parametrize("key", ["moe.pipeline_chunks", "moe.early_experts", "moe.delay_wgrad", "moe.expert_grid",
                                 "moe.two_batch_overlap", "parallel.nvshmem_one_sm_wait"])
def test_dropped_experiment_keys_are_unknown(key):
    """Keys of experiments that never became a default are gone: a config naming one fails loudly."""
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        Config().with_overrides([f"{key}=1"])


@pytest.mark.parametrize("override,typo,suggestion", [
    ("parallel.wold_size=2", "parallel.wold_size", "parallel.world_size"),
    ("train.learning_rat=0.1", "train.learning_rat", None),
    ("paralel.world_size=2", "paralel", "parallel"),
    ("balance.clone_slot=2", "balance.clone_slot", "balance.clone_slots"),
])
def test_unknown_key_in_override(override, typo, suggestion):
    with pytest.raises(ConfigError) as info:
        Config().with_overrides([override])
    msg = str(info.value)
    assert f"unknown config key {typo!r}" in msg
    if suggestion:
        assert f"did you mean {suggestion!r}?" in msg


def test_unknown_key_without_close_match_has_no_suggestion():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"train": {"zzzzzz": 1}})
    msg = str(info.value)
    assert "'train.zzzzzz'" in msg and "did you mean" not in msg


def test_unknown_key_via_set():
    cfg = Config()
    with pytest.raises(ConfigError, match="did you mean 'model.d_model'"):
        cfg.set("model.d_modl", 32)
    with pytest.raises(ConfigError, match="unknown config key 'moe.num_experts.x'"):
        cfg.set("moe.num_experts.x", 3)


# --------------------------------------------------------------------------------- YAML files
def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_loads(tmp_path):
    path = write(tmp_path, """
model:
  d_model: 32
  n_heads: 2
moe:
  num_experts: 4
  top_k: 1
parallel:
  world_size: 2
  placement_strategy: STRICT_SPREAD
train:
  lr: 0.01
data:
  paths: [a.txt, b/]
balance:
""")
    cfg = Config.from_yaml(path)
    assert cfg.model.d_model == 32 and cfg.model.n_heads == 2
    assert cfg.moe.num_experts == 4 and cfg.moe.top_k == 1
    assert cfg.parallel.placement_strategy == "STRICT_SPREAD"
    assert cfg.train.lr == 0.01 and cfg.data.paths == ["a.txt", "b/"]
    assert cfg.balance == Config().balance
    assert cfg.model.n_layers == Config().model.n_layers  # untouched keys keep their default


def test_yaml_empty_file_is_defaults(tmp_path):
    assert Config.from_yaml(write(tmp_path, "")) == Config()
    assert Config.from_yaml(write(tmp_path, "# only a comment\n", "c.yaml")) == Config()


def test_yaml_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(missing)
    assert str(missing) in str(info.value) and "does not exist" in str(info.value)


def test_yaml_invalid(tmp_path):
    path = write(tmp_path, "model: {d_model: 32\nmoe: [\n")
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    assert str(path) in str(info.value) and "not valid YAML" in str(info.value)


@pytest.mark.parametrize("text", ["- model\n- moe\n", "just a string\n", "42\n"])
def test_yaml_not_a_mapping(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    assert str(path) in str(info.value) and "mapping" in str(info.value)


def test_yaml_errors_name_keys(tmp_path):
    with pytest.raises(ConfigError, match="moe.num_experts=30 is not divisible by parallel.world_size=4"):
        Config.from_yaml(write(tmp_path, "moe: {num_experts: 30}\nparallel: {world_size: 4}\n"))
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        Config.from_yaml(write(tmp_path, "train: {step: 3}\n", "b.yaml"))


def test_yaml_with_overrides(tmp_path):
    path = write(tmp_path, "parallel: {world_size: 2}\nmoe: {num_experts: 8}\n")
    cfg = Config.from_yaml(path, ["parallel.world_size=4", "train.steps=7"])
    assert cfg.parallel.world_size == 4 and cfg.train.steps == 7


# -------------------------------------------------------------------------------- overrides
def test_overrides_typed_parsing():
    cfg = Config().with_overrides([
        "parallel.world_size=4",
        "train.lr=0.01",
        "parallel.cpu_per_worker=2",
        "balance.enabled=true",
        "balance.clone_slots=1",
        "model.dtype=bfloat16",
        "data.paths=[a.txt, b.txt]",
        "train.run_dir=runs/exp1",
        "parallel.placement_strategy=STRICT_SPREAD",
    ])
    assert cfg.parallel.world_size == 4 and type(cfg.parallel.world_size) is int
    assert cfg.train.lr == 0.01 and type(cfg.train.lr) is float
    assert cfg.parallel.cpu_per_worker == 2.0 and type(cfg.parallel.cpu_per_worker) is float
    assert cfg.balance.enabled is True
    assert cfg.model.dtype == "bfloat16"
    assert cfg.data.paths == ["a.txt", "b.txt"]
    assert cfg.train.run_dir == "runs/exp1"
    assert cfg.parallel.placement_strategy == "STRICT_SPREAD"


def test_override_whitespace_and_equals_in_value():
    cfg = Config().with_overrides([" train.steps = 5", "train.run_dir=runs/a=b"])
    assert cfg.train.steps == 5
    assert cfg.train.run_dir == "runs/a=b"  # only the first '=' splits


def test_override_float_decimal_exponent():
    assert Config().with_overrides(["train.lr=3.0e-4"]).train.lr == pytest.approx(3e-4)


def test_override_float_plain_exponent():
    assert Config().with_overrides(["train.lr=1e-3"]).train.lr == pytest.approx(1e-3)


def test_override_type_error_names_key_and_value():
    with pytest.raises(ConfigError, match=r"parallel.world_size='four' must be an integer"):
        Config().with_overrides(["parallel.world_size=four"])
    with pytest.raises(ConfigError, match=r"balance.enabled='maybe' must be true or false"):
        Config().with_overrides(["balance.enabled=maybe"])


def test_override_validation_error_names_key():
    with pytest.raises(ConfigError, match="moe.num_experts=30 is not divisible by parallel.world_size=4"):
        Config().with_overrides(["moe.num_experts=30", "parallel.world_size=4"])


def test_overrides_validated_together_and_copy():
    base = Config()
    # 6 experts on 3 ranks: neither override alone is valid with the defaults (8 experts, W=2).
    cfg = base.with_overrides(["moe.num_experts=6", "parallel.world_size=3", "train.batch_size=6"])
    assert (cfg.moe.num_experts, cfg.parallel.world_size) == (6, 3)
    assert base == Config()  # the original is not changed


def test_override_empty_value_is_empty_string():
    with pytest.raises(ConfigError, match="train.run_dir=''"):
        Config().with_overrides(["train.run_dir="])


@pytest.mark.parametrize("bad", ["parallel.world_size", "train.steps 3", ""])
def test_malformed_override(bad):
    with pytest.raises(ConfigError) as info:
        Config().with_overrides([bad])
    assert repr(bad) in str(info.value) and "section.key=value" in str(info.value)


def test_override_without_key():
    with pytest.raises(ConfigError, match="unknown config key"):
        Config().with_overrides(["=4"])


def test_override_with_invalid_yaml_value():
    with pytest.raises(ConfigError) as info:
        Config().with_overrides(["data.paths=[a"])
    assert "data.paths" in str(info.value)


# ------------------------------------------------------------------------------- round trip
def test_round_trip_dict_and_yaml():
    cfg = Config().with_overrides([
        "moe.num_experts=12", "parallel.world_size=3", "train.batch_size=6", "train.lr=0.02", "data.paths=[x, y]",
        "balance.enabled=true", "balance.clone_slots=2", "model.dtype=bfloat16",
    ])
    d = cfg.to_dict()
    assert set(d) == {"model", "moe", "parallel", "data", "train", "balance"}
    assert Config.from_dict(d) == cfg
    assert Config.from_plain(d) == cfg
    assert Config.from_dict(yaml.safe_load(yaml.safe_dump(d, sort_keys=False))) == cfg
    copy = cfg.copy()
    assert copy == cfg and copy is not cfg
    copy.data.paths.append("z")
    assert cfg.data.paths == ["x", "y"]  # deep copy


def test_round_trip_through_file(tmp_path):
    cfg = Config().with_overrides(["train.steps=3", "parallel.startup_timeout_s=5"])
    path = write(tmp_path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    assert Config.from_yaml(path) == cfg


def test_set_and_get():
    cfg = Config()
    cfg.set("train.steps", 9)
    assert cfg.get("train.steps") == 9
    with pytest.raises(ConfigError, match="train.steps='9' must be an integer"):
        cfg.set("train.steps", "9")


# ------------------------------------------------------------------------------ job files
# Job configs under jobs/; runtime_env*.yaml there are Ray runtime environments, not configs.
JOB_FILES = sorted(
    p for p in ((REPO / "jobs").glob("**/*.y*ml") if (REPO / "jobs").is_dir() else [])
    if not p.name.startswith("runtime_env")
)


@pytest.mark.parametrize("path", JOB_FILES, ids=[str(p.relative_to(REPO)) for p in JOB_FILES])
def test_job_files_load(path):
    cfg = Config.from_yaml(path)
    cfg.validate()
    assert Config.from_dict(cfg.to_dict()) == cfg


# ------------------------------------------------------------- precision, optimizer, loss
@pytest.mark.parametrize("key,value,fragment", [
    ("train.beta1", 1.0, "[0, 1)"), ("train.beta2", -0.1, "[0, 1)"), ("train.eps", 0.0, "> 0"),
    ("train.eps", math.nan, "> 0"), ("train.loss_chunk", -1, ">= 0"),
    ("train.optimizer_impl", "adam", "auto, onepass, fused, foreach, for_loop"),
    ("train.loss_impl", "full", "auto, chunked, fused, liger"),
    ("train.optimizer_state_dtype", "float16", "float32, bfloat16"),
    ("parallel.zero_stage", 3, "0, 1, 2"), ("parallel.grad_bucket_size", 0, "> 0"),
    ("parallel.grad_reduce_dtype", "float16", "float32, bfloat16"),
    ("parallel.overlap_param_gather", "yes", "must be true or false"),
])
def test_precision_keys_rejected(key, value, fragment):
    reject({key: value}, f"{key}=", fragment)


def test_precision_keys_accepted():
    cfg = build({"train.beta1": 0.0, "train.beta2": 0.999, "train.eps": 1e-6, "train.loss_chunk": 0,
                 "train.optimizer_impl": "for_loop", "train.loss_impl": "liger", "train.master_weights": False})
    assert (cfg.train.beta2, cfg.train.optimizer_impl, cfg.train.master_weights) == (0.999, "for_loop", False)


def test_zero_stages_need_masters():
    reject({"parallel.zero_stage": 2, "train.master_weights": False, "parallel.world_size": 1},
           "parallel.zero_stage=2", "master_weights=true")
    assert build({"parallel.zero_stage": 1}).parallel.zero_stage == 1


def test_overlap_param_gather_and_the_reduction_dtype():
    assert Config().parallel.overlap_param_gather is True and Config().parallel.grad_reduce_dtype == "float32"
    cfg = build({"parallel.overlap_param_gather": False, "parallel.zero_stage": 1,
                 "parallel.grad_reduce_dtype": "bfloat16"})
    assert not cfg.parallel.overlap_param_gather and cfg.parallel.grad_reduce_dtype == "bfloat16"


def test_bf16_moments_accepted_with_masters_only():
    assert build({"train.optimizer_state_dtype": "bfloat16"}).train.optimizer_state_dtype == "bfloat16"
    reject({"train.optimizer_state_dtype": "bfloat16", "train.master_weights": False},
           "train.optimizer_state_dtype=bfloat16", "master_weights=true")


def test_data_datasets_take_paths_and_weights():
    cfg = Config().with_overrides(["data.datasets=[{path: /d/a, weight: 3}, d/b]", "data.tokenizer=tok"])
    assert cfg.data.mixture() == [("/d/a", 3.0), (os.path.abspath("d/b"), 1.0)]  # workers open the same paths
    assert cfg.data.tokenizer == os.path.abspath("tok")
    assert cfg.copy().data.datasets == cfg.data.datasets
    for bad, message in [("data.datasets=[{path: /d/a, wieght: 1}]", r"unknown key\(s\) \['wieght'\]"),
                         ("data.datasets=[{path: /d/a, weight: 0}]", "weight=0 must be a number > 0"),
                         ("data.datasets=[{weight: 1}]", "needs a path"),
                         ("data.tokenizer=/tok", "needs data.datasets")]:
        with pytest.raises(ConfigError, match=message):
            Config().with_overrides([bad])
    with pytest.raises(ConfigError, match="data.paths and data.datasets are exclusive"):
        cfg.with_overrides(["data.paths=[x.txt]"])


def test_progress_off_is_taken_on_the_command_line_and_in_a_file(tmp_path):
    """YAML reads ``off`` as false: train.progress=off is the documented value, not a boolean."""
    assert Config().with_overrides(["train.progress=off"]).train.progress == "off"
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  progress: off\n")
    assert Config.from_yaml(path).train.progress == "off"
    with pytest.raises(ConfigError, match="train.progress='true' is not allowed; choose one of auto, bar, lines, off"):
        Config().with_overrides(["train.progress=on"])


def test_model_compile_takes_auto_none_or_blocks():
    assert Config().model.compile == "auto"
    assert Config().model.compile_on("cuda") == "blocks" and Config().model.compile_on("cpu") == "none"
    assert Config().model.compile_on("meta") == "none"
    blocks = Config().with_overrides(["model.compile=blocks"]).model
    assert blocks.compile == "blocks" and blocks.compile_on("cpu") == "blocks"
    assert Config().with_overrides(["model.compile=none"]).model.compile_on("cuda") == "none"
    reject({"model.compile": True}, "model.compile='true' is not allowed; choose one of auto, none, blocks")
    reject({"model.compile": "full"}, "model.compile='full'")


def test_config_directory_is_named_as_a_directory(tmp_path):
    (tmp_path / "tiny.yaml").write_text("train: {steps: 1}\n")
    with pytest.raises(ConfigError, match="is a directory; give a YAML file \\(it holds tiny.yaml\\)"):
        Config.from_yaml(tmp_path)


@pytest.mark.parametrize("overrides, named", [
    (["moe.expert_hidden=96"], "width 96"),
    (["model.hf_config=gpt_oss-tiny"], "biases"),
    (["model.d_model=130", "model.n_heads=2"], "hidden size 130"),
])
def test_fp8_experts_refuse_what_they_cannot_run(overrides, named):
    """moe.expert_precision=fp8 runs SwiGLU experts without biases, I a multiple of 128: anything
    else (or a hidden size the FP8 rows' scales cannot align to) is one line before any worker
    starts, naming the width, the biases, the activation or the hidden size."""
    with pytest.raises(ConfigError, match=named):  # with_overrides validates
        Config.from_dict({"moe": {"expert_precision": "fp8", "expert_hidden": 128}}).with_overrides(overrides).validate()
    Config.from_dict({"moe": {"expert_precision": "fp8", "expert_hidden": 128}}).validate()  # the plain case runs
