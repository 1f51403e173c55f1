"""Typed configuration: dataclasses per section, YAML loading, ``key=value`` overrides, validation.

Every validation error is a :class:`ConfigError` whose message names the dotted key, the bad
value and what is allowed, e.g. ``moe.num_experts=30 is not divisible by parallel.world_size=4``.
Unknown keys are rejected with the closest valid key suggested.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, get_args, get_origin, get_type_hints

import torch
import yaml

from ray_moe import arch
from ray_moe.mesh import AUTO, mesh_error

# The one table of model dtypes: config name → torch dtype (element sizes come from the dtype).
DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16})
# Where step metrics go besides run_dir/metrics.jsonl and Ray's metrics (always on).
LOGGERS = ("tensorboard", "wandb")


def torch_dtype(name: str) -> torch.dtype:
    """``model.dtype`` name → torch dtype (``float32`` | ``bfloat16``)."""
    return DTYPES[name]


def element_size(name: str) -> int:
    """Bytes per element of the ``model.dtype`` named ``name``."""
    return DTYPES[name].itemsize


# What model.init_from must name (config.py and the driver's preflight say it the same way).
HF_MODEL_DIR = "a Hugging Face model directory (config.json and model.safetensors or model.safetensors.index.json)"


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


# Keys that an HF architecture takes from its config.json: (ray_moe key, what it is in HF terms).
# They are not rewritten: the resolved ArchSpec holds the sizes (field names: SPEC_FIELDS).
HF_DERIVED = MappingProxyType({
    "model.vocab_size": "vocab_size", "model.n_layers": "num_hidden_layers", "model.d_model": "hidden_size",
    "model.n_heads": "num_attention_heads", "moe.num_experts": "the number of routed experts",
    "moe.top_k": "num_experts_per_tok", "moe.expert_hidden": "the expert intermediate size",
})
SPEC_FIELDS = MappingProxyType({
    "model.vocab_size": "vocab_size", "model.n_layers": "num_layers", "model.d_model": "hidden_size",
    "model.n_heads": "num_heads", "moe.num_experts": "num_experts", "moe.top_k": "top_k",
    "moe.expert_hidden": "expert_hidden",
})
ARCHS = ("byte",) + arch.FAMILIES
CHECKPOINTING = ("none", "moe", "full")
COMPILE = ("auto", "none", "blocks")


@dataclass
class ModelConfig:
    vocab_size: int = 256  # tokens the model embeds: 256 bytes; with data.datasets at least the tokenizer's
    n_layers: int = 2  # transformer blocks
    d_model: int = 64  # hidden size H
    n_heads: int = 4  # attention heads (divide d_model)
    seq_len: int = 64  # context length in tokens (bytes on the byte corpus)
    dense_first_layer: bool = False  # a dense SwiGLU FFN in the first block instead of experts
    dense_hidden: int = 0  # hidden size of a dense first layer; 0 means 4 * d_model
    dtype: str = "float32"  # float32 | bfloat16
    arch: str = "byte"  # byte or an HF family (arch.FAMILIES: qwen3_moe, mixtral, glm4_moe, deepseek_v3, gpt_oss, olmoe, minimax_m2); optional with an HF config: it must agree
    hf_config: str = ""  # HF config: a preset name, a config.json, or a model directory
    hf: dict = field(default_factory=dict)  # HF config keys on top of hf_config's (or the whole config)
    init_from: str = ""  # HF model directory whose weights the model starts from
    activation_checkpointing: str = "none"  # none | moe | full (recompute per block in backward)
    # auto | none | blocks: blocks torch.compiles each block's dense parts (attention, norms, dense
    # MLP, shared experts), the MoE layers eager (torchtitan's compile.enable, per block, for
    # components "model"); auto is blocks on CUDA and none on the CPU (:meth:`compile_on`)
    compile: str = "auto"
    # bf16 | fp8: fp8 trains the blocks' dense linears (attention projections, shared experts,
    # dense MLPs) through torchao's float8 training (tensorwise scales; needs torchao and, on CUDA,
    # an sm_89+ GPU; the CPU emulates it); the LM head, embeddings and routers keep model.dtype
    # (model/dense_fp8.py). bf16: every dense linear in model.dtype
    dense_precision: str = "bf16"

    def compile_on(self, device_type: str) -> str:
        """``model.compile`` on a device of ``device_type`` ("cuda" | "cpu"): ``auto`` compiles the
        blocks on CUDA, where they won every step measured (0.724x torchtitan compiled's step
        against 0.917x eager, measured 2026-11-27), and not on the CPU, where compiling
        costs more than the short runs it serves."""
        if self.compile == "auto":
            return "blocks" if device_type == "cuda" else "none"
        return self.compile

    def check(self) -> None:
        _positive("model.n_layers", self.n_layers)
        _positive("model.d_model", self.d_model)
        _positive("model.n_heads", self.n_heads)
        _positive("model.seq_len", self.seq_len)
        _positive("model.vocab_size", self.vocab_size)
        _choice("model.arch", self.arch, ARCHS)
        if self.arch == "byte" and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}"
            )
        _choice("model.dtype", self.dtype, tuple(DTYPES))
        _choice("model.activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)
        _choice("model.compile", self.compile, COMPILE)
        _choice("model.dense_precision", self.dense_precision, ("bf16", "fp8"))  # model.dense_fp8.DENSE_PRECISIONS
        if self.dense_precision == "fp8" and importlib.util.find_spec("torchao") is None:
            raise ConfigError("model.dense_precision=fp8 trains the dense linears through torchao's float8 "
                              "training, but torchao is not installed (pip install torchao); use "
                              "model.dense_precision=bf16")
        if self.dense_hidden < 0:
            raise ConfigError(f"model.dense_hidden={self.dense_hidden} must be >= 0 (0 means 4*d_model)")
        if self.uses_hf() and self.dense_first_layer:
            raise ConfigError("model.dense_first_layer is for model.arch=byte; an HF architecture takes "
                              "its dense layers from the HF config")

    def uses_hf(self) -> bool:
        """True when the architecture comes from an HF config (not the byte-level model)."""
        return bool(self.hf_config or self.hf or self.init_from) or self.arch != "byte"

    def resolve_hf(self) -> tuple[arch.ArchSpec, dict]:
        """(spec, HF config in effect) from ``hf_config`` (else ``init_from``'s config.json) with
        ``hf`` on top; raises ConfigError naming the key."""
        source = self.hf_config or self.init_from
        if not source and not self.hf:
            raise ConfigError(
                f"model.arch={self.arch} needs model.hf_config (a preset: {', '.join(arch.PRESETS)}; a "
                "config.json; or a model directory), model.init_from or an inline model.hf"
            )
        if not self.hf_config and self.init_from and not Path(self.init_from).expanduser().exists():
            raise ConfigError(f"model.init_from={self.init_from!r} does not exist; expected {HF_MODEL_DIR}")
        where = (f"model.hf_config={source!r}" if self.hf_config else f"model.init_from={source!r}") if source \
            else "model.hf"
        try:
            spec, hf = arch.resolve(source, self.hf)
        except arch.ArchError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if self.arch != "byte" and spec.family != self.arch:
            raise ConfigError(f"model.arch={self.arch} but {where} is a {spec.family} config")
        _check_hf_keys(self.hf, arch.load_hf_config(source) if source else {}, spec.family)
        return spec, hf


@dataclass
class MoEConfig:
    num_experts: int = 8  # E, routed experts per MoE layer (divisible by world_size)
    top_k: int = 2  # K, experts per token, 1 <= K <= E
    expert_hidden: int = 128  # I, SwiGLU hidden size of each expert
    aux_loss_coef: float = 0.0  # Switch load-balancing loss weight (computed per rank; 0: off)
    expert_impl: str = "auto"  # auto | loop | grouped_mm | triton
    bias_update_rate: float = 0.001  # aux-loss-free balancing (sigmoid routers): bias step per update
    expert_precision: str = "bf16"  # bf16 | fp8 (experimental, slower than bf16 so far): the routed experts' GEMMs in block-scaled FP8

    def check(self) -> None:
        _positive("moe.num_experts", self.num_experts)
        _positive("moe.expert_hidden", self.expert_hidden)
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"moe.top_k={self.top_k} must be between 1 and moe.num_experts={self.num_experts}"
            )
        if not self.aux_loss_coef >= 0:
            raise ConfigError(f"moe.aux_loss_coef={self.aux_loss_coef} must be >= 0")
        _choice("moe.expert_impl", self.expert_impl, ("auto", "loop", "grouped_mm", "triton"))
        if not self.bias_update_rate >= 0:
            raise ConfigError(f"moe.bias_update_rate={self.bias_update_rate} must be >= 0")
        _choice("moe.expert_precision", self.expert_precision, ("bf16", "fp8"))  # experts.EXPERT_PRECISIONS


@dataclass
class ParallelConfig:
    world_size: int = 2  # ranks: one actor per GPU or CPU slot
    # EP degree: world = EP x DP, EP groups of consecutive ranks (ray_moe.mesh). 0 (auto): the
    # ranks of one node when a GPU world spans several nodes (every exchange inside a node), else
    # the whole world; N: N ranks per EP group (the world: whole-world EP on any number of nodes)
    expert_parallel: int = AUTO
    transport: str = "auto"  # auto | nvshmem | nccl | gloo
    device: str = "auto"  # auto | cpu | cuda
    cpu_per_worker: float = 1.0  # CPUs per actor (fractions allowed)
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    startup_timeout_s: float = 60.0  # placement and start-up must finish within this
    collective_timeout_s: float = 120.0  # torch.distributed timeout: a hung peer becomes an error
    force_remote_path: bool = False  # NVSHMEM: every peer through the inter-node put path (tests on one host)
    comm_programs: int = 0  # NVSHMEM: SMs the exchange kernels run on (0: all)
    workers_per_gpu: int = 1  # ranks sharing one GPU (tests of multi-rank paths on one GPU; gloo process group)
    # ZeRO for the replicated parameters (experts are sharded by expert parallelism anyway):
    # 0 = whole on every rank; 1 = float32 masters and moments sharded over the ranks (Megatron's
    # distributed optimizer), gradients reduce-scattered in buckets while backward runs, from
    # persistent float32 bucket buffers; 2 = also the gradients (a bucket's buffer is freed once reduced)
    zero_stage: int = 0
    grad_bucket_size: int = 40_000_000  # elements per gradient bucket (zero_stage 1, 2)
    # the replicated gradients' reduction: float32 (torchtitan's FSDP default) or bfloat16
    # (Megatron's default: half the bytes of the reduce-scatter and of the bucket buffers), and the
    # hot-expert clones' gradient sums on their owners (bfloat16: rounded into the experts' bf16
    # gradients, which the one-pass update reads with no float32 copy)
    grad_reduce_dtype: str = "float32"
    # where zero_stage is 1 or 2 and train.overlap_update runs (CUDA): the sharded update and its
    # all-gathers on the update's side stream beside the next forward, each block waiting for its
    # own parameters (Megatron's --overlap-param-gather); false: on the main stream after backward
    overlap_param_gather: bool = True
    nvshmem_spin_limit: int = 1 << 25  # NVSHMEM: polls of a flag before a device-side wait gives up
    fast_launch: bool = True  # NVSHMEM: repeated exchange launches skip Triton's argument binding

    def check(self) -> None:
        _positive("parallel.world_size", self.world_size)
        _positive("parallel.expert_parallel", self.expert_parallel, allow_zero=True)
        _positive("parallel.grad_bucket_size", self.grad_bucket_size)
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2):
            raise ConfigError(f"parallel.zero_stage={self.zero_stage!r} is not allowed; choose one of 0, 1, 2")
        _choice("parallel.transport", self.transport, ("auto", "nvshmem", "nccl", "gloo"))
        _choice("parallel.grad_reduce_dtype", self.grad_reduce_dtype, tuple(DTYPES))
        if not isinstance(self.overlap_param_gather, bool):
            raise ConfigError(f"parallel.overlap_param_gather={self.overlap_param_gather!r} must be true or false")
        _choice("parallel.device", self.device, ("auto", "cpu", "cuda"))
        _choice(
            "parallel.placement_strategy",
            self.placement_strategy,
            ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
        )
        if not self.cpu_per_worker > 0:
            raise ConfigError(f"parallel.cpu_per_worker={self.cpu_per_worker} must be > 0")
        _positive("parallel.comm_programs", self.comm_programs, allow_zero=True)
        _positive("parallel.workers_per_gpu", self.workers_per_gpu)
        _positive("parallel.nvshmem_spin_limit", self.nvshmem_spin_limit)
        error = transport_device_error(self.transport, self.device)
        if error:
            raise ConfigError(error)
        _positive("parallel.startup_timeout_s", self.startup_timeout_s)
        _positive("parallel.collective_timeout_s", self.collective_timeout_s)


def transport_device_error(transport: str, device: str, why: str = "") -> str | None:
    """Why ``parallel.transport`` cannot move tensors of ``device`` (cpu | cuda; auto fits any
    transport), or None: the one owner of this rule, checked when the config is validated (the
    device as configured) and when a group starts (the device ``parallel.device=auto`` resolved
    to; ``why`` says how, default ``parallel.device=DEVICE``)."""
    why = why or f"parallel.device={device}"
    if transport in ("nvshmem", "nccl") and device == "cpu":
        return f"parallel.transport={transport} needs GPUs but {why}; use transport gloo or auto"
    if transport == "gloo" and device == "cuda":
        return f"parallel.transport=gloo cannot move CUDA tensors but {why}; use transport nccl, nvshmem or auto"
    return None


@dataclass
class DataConfig:
    paths: list = field(default_factory=list)  # files, directories or globs; [] = stdlib sources
    val_fraction: float = 0.05  # tail of the byte corpus kept for validation
    max_bytes: int = 0  # 0 = whole corpus
    # Prepared token datasets (ray-moe prepare) [{path, weight}]; [] = the byte corpus above.
    datasets: list[dict] = field(default_factory=list)
    tokenizer: str = ""  # the run's tokenizer directory; the datasets must have been prepared with it

    def check(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes={self.max_bytes} must be >= 0 (0 = whole corpus)")
        for i, entry in enumerate(self.datasets):
            unknown = sorted(set(entry) - {"path", "weight"})
            if unknown:
                raise ConfigError(f"data.datasets[{i}] has unknown key(s) {unknown}; allowed: path, weight")
            if not isinstance(entry.get("path"), str) or not entry["path"]:
                raise ConfigError(f"data.datasets[{i}]={entry!r} needs a path (a directory from ray-moe prepare)")
            weight = entry.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise ConfigError(f"data.datasets[{i}].weight={weight!r} must be a number > 0")
        if self.datasets and self.paths:
            raise ConfigError("data.paths and data.datasets are exclusive: data.paths is the byte corpus, "
                              "data.datasets are prepared token datasets; set one")
        if self.tokenizer and not self.datasets:
            raise ConfigError(f"data.tokenizer={self.tokenizer!r} needs data.datasets (prepared with it); "
                              "the byte corpus has no tokenizer")

    def mixture(self) -> list[tuple[str, float]]:
        """(path, weight) of each prepared dataset, weights as given (unnormalised)."""
        return [(d["path"], float(d.get("weight", 1.0))) for d in self.datasets]


@dataclass
class TrainConfig:
    steps: int = 100  # steps to train
    batch_size: int = 8  # sequences per step over all ranks (split evenly; W-independent)
    lr: float = 3e-3  # AdamW peak learning rate: linear warm-up, then cosine to 10 %
    weight_decay: float = 0.0  # AdamW weight decay (none on 1-D tensors and embeddings)
    warmup_steps: int = 10  # steps of linear learning-rate warm-up
    grad_clip: float = 1.0  # global gradient-norm clipping (0: off)
    seed: int = 0  # initialisation and data seed
    eval_interval: int = 0  # 0 = only at the end
    eval_batches: int = 4  # fixed validation batches per evaluation
    checkpoint_interval: int = 0  # 0 = only at the end (when run_dir is set)
    run_dir: str = "runs/latest"  # metrics, plots and checkpoints; relative to storage_path when that is set
    storage_path: str = ""  # base of a relative run_dir (shared storage on a multi-node cluster)
    resume: str = "auto"  # auto (when run_dir has a valid checkpoint) | true (must) | false (fresh run)
    overwrite: bool = False  # a fresh run moves an earlier run's results to run_dir/archive/
    log_interval: int = 10  # steps between progress lines when the output is not a terminal
    log_every_s: float = 30.0  # ... or seconds, whichever comes first
    progress: str = "auto"  # auto (a bar on a terminal, lines otherwise) | bar | lines | off
    loggers: list = field(default_factory=list)  # besides metrics.jsonl: tensorboard, wandb
    max_failures: int = 3  # dead or hung workers recovered from (errors no restart fixes are not retried)
    step_timeout_s: float = 300.0  # a step running longer is a hung worker
    health_check_interval_s: float = 10.0  # seconds between the driver's worker pings
    nonfinite: str = "skip"  # skip | stop
    plots: bool = True  # write PNG plots at the end
    # precision, optimizer and loss (worker/optim.py, model/loss.py)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    master_weights: bool = True  # fp32 masters + fp32 AdamW state; false: update compute-dtype params
    optimizer_impl: str = "auto"  # auto (onepass on CUDA, foreach elsewhere) | onepass | fused | foreach | for_loop
    optimizer_state_dtype: str = "float32"  # AdamW moments: float32 | bfloat16 (DeepSeek-V3; needs master_weights)
    overlap_update: bool = True  # CUDA: the update on a side stream beside the next forward, block by block
    loss_impl: str = "auto"  # auto (fused on CUDA, else liger there, else chunked) | chunked | fused | liger
    loss_chunk: int = 0  # rows per chunk of the chunked and fused LM loss; 0 = automatic (per impl)

    def check(self) -> None:
        _positive("train.steps", self.steps, allow_zero=True)
        _positive("train.batch_size", self.batch_size)
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"train.lr={self.lr} must be a finite number > 0")
        for key in ("weight_decay", "grad_clip"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be a finite number >= 0")
        for key in ("warmup_steps", "eval_interval", "checkpoint_interval", "max_failures"):
            _positive(f"train.{key}", getattr(self, key), allow_zero=True)
        _positive("train.eval_batches", self.eval_batches)
        _positive("train.log_interval", self.log_interval)
        _positive("train.step_timeout_s", self.step_timeout_s)
        _positive("train.health_check_interval_s", self.health_check_interval_s)
        _choice("train.nonfinite", self.nonfinite, ("skip", "stop"))
        if not self.run_dir:
            raise ConfigError("train.run_dir='' must name a directory")
        _choice("train.resume", self.resume, ("auto", "true", "false"))
        _positive("train.log_every_s", self.log_every_s)
        _choice("train.progress", self.progress, ("auto", "bar", "lines", "off"))
        for logger in self.loggers:
            _choice("train.loggers", logger, LOGGERS)
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be in [0, 1)")
        if not 0 < self.eps < math.inf:
            raise ConfigError(f"train.eps={self.eps} must be > 0")
        _choice("train.optimizer_impl", self.optimizer_impl, ("auto", "onepass", "fused", "foreach", "for_loop"))
        _choice("train.optimizer_state_dtype", self.optimizer_state_dtype, ("float32", "bfloat16"))
        if self.optimizer_state_dtype == "bfloat16" and not self.master_weights:
            raise ConfigError("train.optimizer_state_dtype=bfloat16 needs train.master_weights=true "
                              "(the moments are updated in float32 beside float32 masters)")
        if not isinstance(self.overlap_update, bool):
            raise ConfigError(f"train.overlap_update={self.overlap_update!r} must be true or false")
        _choice("train.loss_impl", self.loss_impl, ("auto", "chunked", "fused", "liger"))
        _positive("train.loss_chunk", self.loss_chunk, allow_zero=True)


@dataclass
class BalanceConfig:
    enabled: bool = False  # re-clone hot experts every interval steps
    interval: int = 50  # steps between re-cloning plans
    clone_slots: int = 0  # expert slots per rank for clones of hot experts
    ema: float = 0.5  # per interval; 0.9 never recovers from a shifting hot set (bench balance)
    max_cross_node_clones: int = -1  # -1 = no limit

    def check(self) -> None:
        _positive("balance.interval", self.interval)
        _positive("balance.clone_slots", self.clone_slots, allow_zero=True)
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"balance.ema={self.ema} must be in [0, 1)")
        if self.enabled and self.clone_slots == 0:
            raise ConfigError(
                "balance.enabled=true needs balance.clone_slots >= 1 (slots for clones per rank)"
            )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, raw: dict | None) -> "Config":
        cfg = cls()
        for section, values in (raw or {}).items():
            if section not in _sections():
                raise ConfigError(_unknown(section, _sections()))
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"{section} must be a mapping of keys to values, got {values!r}")
            for key, value in values.items():
                cfg.set(f"{section}.{key}", value)
        resolved = cfg.validate()
        cfg._check_explicit({f"{s}.{k}": v for s, vals in (raw or {}).items() for k, v in (vals or {}).items()},
                            resolved)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Iterable[str] = ()) -> "Config":
        path = Path(path)
        if path.is_dir():
            yamls = sorted(p.name for p in path.glob("*.yaml"))[:5]
            raise ConfigError(f"config file {str(path)!r} is a directory; give a YAML file"
                              + (f" (it holds {', '.join(yamls)})" if yamls else " (e.g. jobs/tiny.yaml)"))
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}: "
                              f"{exc.object[exc.start:exc.start + 1]!r}); give a YAML file (e.g. jobs/tiny.yaml)") from None
        except OSError as exc:
            raise ConfigError(f"config file {str(path)!r} cannot be read ({exc.strerror or exc})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
        cfg = cls.from_dict(raw)
        return cfg.with_overrides(overrides)

    def with_overrides(self, overrides: Iterable[str]) -> "Config":
        """A copy with ``section.key=value`` strings applied (values parsed as YAML)."""
        cfg = self.copy()
        explicit = {}
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like section.key=value")
            key, text = item.split("=", 1)
            try:
                value = yaml.safe_load(text) if text.strip() else ""
            except yaml.YAMLError as exc:
                raise ConfigError(f"override {key.strip()}={text!r}: the value is not valid YAML ({exc})") from None
            cfg.set(key.strip(), value)
            explicit[key.strip()] = value
        # the sizes set before (a byte model's YAML, then model.init_from=DIR) count as given too
        given = {k: cfg.get(k) for k in HF_DERIVED if cfg.get(k) != Config().get(k)}
        cfg._check_explicit({**given, **explicit}, cfg.validate())
        return cfg

    def copy(self) -> "Config":
        return Config.from_plain(self.to_dict())

    @classmethod
    def from_plain(cls, raw: dict) -> "Config":
        """Like from_dict, but without validation (for already-validated dicts)."""
        cfg = cls()
        for section, values in raw.items():
            for key, value in values.items():
                cfg.set(f"{section}.{key}", value)
        return cfg

    def to_dict(self) -> dict:
        """The config as plain sections. With an HF architecture, the keys it takes from the HF
        config (:data:`HF_DERIVED`) are left out where they hold their defaults: they are not this
        config's to set (the resolved ArchSpec has the sizes), so ``from_dict(to_dict())`` loads
        the same config and a saved ``config.yaml`` states no size the model does not have."""
        out = dataclasses.asdict(self)
        if self.model.uses_hf():
            defaults = Config()
            for dotted in HF_DERIVED:
                section, key = dotted.split(".")
                if out[section][key] == defaults.get(dotted):
                    del out[section][key]
        return out

    # ---------------------------------------------------------------- access
    def set(self, dotted: str, value: Any) -> None:
        section, _, key = dotted.partition(".")
        if section not in _sections():
            raise ConfigError(_unknown(section, _sections()))
        obj = getattr(self, section)
        names = [f.name for f in fields(obj)]
        head, dot, sub = key.partition(".")
        if dot and head in names and isinstance(getattr(obj, head), dict):  # model.hf.num_hidden_layers=2
            getattr(obj, head)[sub] = value
            return
        if key not in names:
            raise ConfigError(_unknown(dotted, [f"{section}.{n}" for n in names]))
        hint = get_type_hints(type(obj))[key]
        setattr(obj, key, _coerce(dotted, value, hint))

    def get(self, dotted: str) -> Any:
        section, _, key = dotted.partition(".")
        return getattr(getattr(self, section), key)

    # ---------------------------------------------------------------- validation
    def validate(self) -> arch.ResolvedArch:
        """Each section checks its own keys; the architecture is resolved (:meth:`resolve_arch`:
        an HF config is read and checked) without rewriting any key (an HF architecture's sizes,
        :data:`HF_DERIVED`, live in the resolved ArchSpec); then the checks that span sections.
        Returns the resolved architecture (what the driver sends to the workers)."""
        for section in _sections():
            getattr(self, section).check()
        resolved = self.resolve_arch()
        p, t = self.parallel, self.train
        error = self.world_size_error(p.world_size, num_experts=resolved.spec.num_experts)
        if error:
            raise ConfigError(error)
        if p.zero_stage and not t.master_weights:
            raise ConfigError(f"parallel.zero_stage={p.zero_stage} shards float32 masters and needs "
                              "train.master_weights=true (or parallel.zero_stage=0)")
        if self.data.val_fraction == 0 and not self.data.datasets and t.eval_interval:
            raise ConfigError(f"train.eval_interval={t.eval_interval} but data.val_fraction=0 leaves no validation "
                              "split (the run then never evaluates); set data.val_fraction > 0 or "
                              "train.eval_interval=0")
        spec = resolved.spec
        if self.moe.expert_precision == "fp8" and (spec.expert_hidden % 128 or spec.expert_bias
                                                   or spec.activation != "swiglu" or spec.hidden_size % 4):
            raise ConfigError(f"moe.expert_precision=fp8 runs SwiGLU experts without biases whose width is a "
                              f"multiple of 128 on a hidden size that is a multiple of 4 (the FP8 rows' "
                              f"scales); this model's experts have width {spec.expert_hidden}"
                              f"{', biases' if spec.expert_bias else ''}, activation {spec.activation}, "
                              f"hidden size {spec.hidden_size}: use moe.expert_precision=bf16")
        return resolved

    def world_size_error(self, world_size: int, what: str = "parallel.world_size",
                         num_experts: int | None = None) -> str | None:
        """Why this config cannot train on ``world_size`` ranks (``what`` names where that number
        came from), or None: the experts and the global batch split evenly over the ranks.
        ``num_experts``: the resolved architecture's E (default: ``moe.num_experts`` for the byte
        model; an HF architecture's E is checked only where it is passed)."""
        E = num_experts if num_experts is not None else (None if self.model.uses_hf() else self.moe.num_experts)
        ep = self.parallel.expert_parallel
        if ep != AUTO:  # the experts split over an EP group, not the world
            error = mesh_error(world_size, ep, E)
            if error and world_size % ep:
                return f"parallel.expert_parallel={ep} does not divide {what}={world_size}; choose a divisor of it"
            if error:
                return error
        elif E is not None and E % world_size:
            where = " (the HF config's)" if self.model.uses_hf() else ""
            return (f"moe.num_experts={E}{where} is not divisible by {what}={world_size}; set "
                    "parallel.expert_parallel to a divisor of both (the experts then split over EP groups)")
        if self.train.batch_size % world_size:
            return f"train.batch_size={self.train.batch_size} is not divisible by {what}={world_size}"
        tokens = self.train.batch_size // world_size * self.model.seq_len
        if self.model.dense_precision == "fp8" and tokens % 16:  # model.dense_fp8.FP8_DIM_MULTIPLE
            # the FP8 weight gradient contracts over the tokens, and torch._scaled_mm needs its
            # inner dimension a multiple of 16 (on the GPU; the CPU's emulation would not fail)
            return (f"model.dense_precision=fp8 needs each rank's tokens per step, train.batch_size / {what} x "
                    f"model.seq_len = {self.train.batch_size // world_size} x {self.model.seq_len} = {tokens}, "
                    "to be a multiple of 16 (FP8 weight-gradient GEMMs contract over them); change train.batch_size "
                    "or model.seq_len, or use model.dense_precision=bf16")
        return None

    def resolve_arch(self) -> arch.ResolvedArch:
        """The architecture of this config, resolved: the byte model's spec from ``model.*`` and
        ``moe.*``, or an HF family's from its config.json (and ``model.hf``). The driver calls
        this once and sends the result to the workers (``build_model`` never re-resolves)."""
        m, e = self.model, self.moe
        if m.uses_hf():
            spec, hf = m.resolve_hf()
            return arch.ResolvedArch(spec, hf)
        try:
            spec = arch.ArchSpec.byte(vocab_size=m.vocab_size, d_model=m.d_model, n_heads=m.n_heads,
                                      n_layers=m.n_layers, seq_len=m.seq_len, num_experts=e.num_experts,
                                      top_k=e.top_k, expert_hidden=e.expert_hidden,
                                      dense_first_layer=m.dense_first_layer, dense_hidden=m.dense_hidden)
        except arch.ArchError as exc:
            raise ConfigError(f"model.arch=byte: {exc}") from None
        return arch.ResolvedArch(spec, None)

    def _check_explicit(self, explicit: dict[str, Any], resolved: arch.ResolvedArch) -> None:
        """With an HF architecture, a key of :data:`HF_DERIVED` given explicitly must agree with
        the HF config (the architecture takes it from there); the message says how to change it there."""
        if resolved.hf_config is None:
            return
        spec = resolved.spec
        for key, hf_name in HF_DERIVED.items():
            theirs = getattr(spec, SPEC_FIELDS[key])
            if key in explicit and explicit[key] != theirs:
                raise ConfigError(
                    f"{key}={explicit[key]!r} but model.arch={spec.family} takes it from the HF config "
                    f"({hf_name} = {theirs!r}); change the HF config instead (model.hf.KEY=VALUE)"
                )


# HF keys arch.py reads that a family's transformers config class may not list: older
# config.json files' rope keys (now in rope_parameters), head_dim (any attention), router noise.
LEGACY_HF_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "head_dim", "router_jitter_noise")


def _check_hf_keys(overrides: dict, source: dict, family: str) -> None:
    """Every ``model.hf`` key is one the HF config of ``family`` has: in the source config.json,
    or an attribute of transformers' config class for the family (a typo would be ignored by the
    model silently). ConfigError naming the key, a close match and the allowed keys."""
    unknown = [k for k in overrides if k not in source and k not in LEGACY_HF_KEYS]
    if not unknown:
        return
    try:
        import inspect

        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[family]
    except (ImportError, KeyError):  # no transformers here, or a family it does not know: unchecked
        return
    allowed = (set(source) | set(cls().to_dict()) | set(getattr(cls, "attribute_map", {})) | set(LEGACY_HF_KEYS)
               | (set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}))
    bad = [k for k in unknown if k not in allowed]
    if bad:
        close = difflib.get_close_matches(bad[0], sorted(allowed), n=1, cutoff=0.6)
        hint = f"; did you mean model.hf.{close[0]}?" if close else ""
        raise ConfigError(f"model.hf.{bad[0]} is not a key of a {family} HF config{hint} (allowed: "
                          f"{', '.join(sorted(k for k in allowed if not k.startswith('_')))})")


def _sections() -> list[str]:
    return [f.name for f in fields(Config)]


def _unknown(key: str, valid: list[str]) -> str:
    # Compare the part after a shared section prefix, so "train." alone does not make a match.
    section, dot, rest = key.rpartition(".")
    if dot and all(v.startswith(section + ".") for v in valid):
        names = [v[len(section) + 1:] for v in valid]
        close = [f"{section}.{c}" for c in difflib.get_close_matches(rest, names, n=1, cutoff=0.6)]
    else:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {key!r}{hint} (valid: {', '.join(valid)})"


def _positive(key: str, value: Any, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0  # False for NaN too
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} must be {bound}")


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(allowed)}")


# Paths the workers open, made absolute where the config is read (the driver's directory), so a
# worker started elsewhere finds the same files (data.datasets' paths too).
_DRIVER_RELATIVE_PATHS = ("data.tokenizer",)


# String keys whose documented values YAML reads as booleans: (what false means, what true means).
_BOOL_WORDS = MappingProxyType({"train.progress": ("off", "true")})


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = get_origin(hint) or hint
    if origin is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if origin is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if origin is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if origin is str:
        if isinstance(value, bool):  # YAML reads true/false/yes/no/on/off as booleans
            return _BOOL_WORDS.get(key, ("false", "true"))[value]
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return _absolute(value) if key in _DRIVER_RELATIVE_PATHS and value else value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}={value!r} must be a mapping of names to values")
        return dict(value)
    if origin is list and get_args(hint) == (dict,):  # entries: mappings, or a string for {"path": ...}
        items = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(v, (str, dict)) for v in items):
            raise ConfigError(f"{key}={value!r} must be a list of {{path, weight}} mappings")
        entries = [{"path": v} if isinstance(v, str) else dict(v) for v in items]
        return [{**e, "path": _absolute(e["path"])} if isinstance(e.get("path"), str) and e["path"] else e
                for e in entries]
    if origin is list:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}={value!r} must be a list of strings")
        return list(value)
    return value
