"""Atomic, resharding checkpoints: files, the key schema, and the compatibility checks.

Layout under ``<run_dir>/checkpoints/``::

    step_00000040/
        meta.json                 step, optimizer steps, world size, config, the placement of every
                                  MoE layer, the re-cloning state (load statistics), and the
                                  size + sha256 of every file (written last)
        rank00000.safetensors     rank 0: replicated params + their optimizer state, its experts
        rank00001.safetensors     rank 1: its experts (keys name logical experts)
    latest                        name of the newest complete checkpoint (replaced atomically)

Key schema (:func:`shard_state` writes it, :func:`load_shard_state` reads it): a replicated
parameter under its module name (``layers.0.self_attn.q_proj.weight``); an expert-sharded
parameter (marked with :class:`~ray_moe.placement.placement.ExpertShard`) once per *logical*
expert, ``layers.1.mlp.routed.experts.{e}.w13``, so any world size can load it; optimizer state under
``optim.{key}.{exp_avg|exp_avg_sq}``; replicated buffers that training changes under
``buffer.{name}``; each rank's RNG under ``rng.rank{r}.{cpu|cuda}``.

Byte-model checkpoints written before the byte model became an architecture of the one decoder
(module names ``tok_emb``, ``blocks.i.attn.qkv``, ``blocks.i.ffn``, ...) are recognised by their
keys and renamed on load (:func:`migrate_keys`).

Each rank writes its own file straight into a temporary directory (data never passes through
the driver; on a multi-node cluster ``run_dir`` must be shared storage). The driver then writes
``meta.json`` and renames the directory into place: a crash at any point leaves the previous
checkpoint untouched. Loading checks every file's size and hash and refuses a corrupt or partial
checkpoint naming the file; tensors load through safetensors (no pickle).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ray_moe.arch import ArchSpec, ResolvedArch
from ray_moe.config import Config, ConfigError
from ray_moe.placement.placement import expert_shard

META = "meta.json"
LATEST = "latest"
OPTIM_STATES = ("exp_avg", "exp_avg_sq")
# What a checkpoint must agree on to be loaded (everything else may change on resume): the
# architecture's fields, named by the config key that sets them (an HF config sets them there) ...
ARCH_FIELDS = MappingProxyType({
    "model.arch": "family", "model.n_layers": "num_layers", "model.d_model": "hidden_size",
    "model.n_heads": "num_heads", "model.vocab_size": "vocab_size", "model.dense_first_layer": "moe_layers",
    "moe.num_experts": "num_experts", "moe.expert_hidden": "expert_hidden",
})
# ... and these config keys as they are.
COMPATIBLE_KEYS = ("model.seq_len",)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt; the message names the file."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def new_staging_dir(run_dir: str | Path, step: int) -> Path:
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_name(step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def as_umask_allows(path: str | Path) -> None:
    """Give ``path`` the mode a file this process creates gets (0666 less the umask): safetensors
    writes owner-only files, and weights on shared storage are read by others like the rest."""
    umask = None
    try:  # read without changing it (os.umask sets it: another thread could create a file meanwhile)
        with open("/proc/self/status") as f:
            umask = next((int(line.split()[1], 8) for line in f if line.startswith("Umask:")), None)
    except OSError:
        pass
    if umask is None:
        umask = os.umask(0o022)
        os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_shard(staging: str | Path, rank: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write one rank's tensors; returns {file, bytes, sha256} for the meta."""
    path = Path(staging) / f"rank{rank:05d}.safetensors"
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    except SafetensorError as exc:  # its I/O errors name the OS error only in their text
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        # an OSError with its errno, so that a full or read-only disk is not retried as a dead worker
        raise OSError(int(code.group(1)), f"{path}: {exc}") from exc
    as_umask_allows(path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


def commit(staging: str | Path, meta: dict[str, Any], files: list[dict[str, Any]]) -> Path:
    """Write meta.json, rename the staging directory into place, point ``latest`` at it."""
    staging = Path(staging)
    meta = dict(meta, files=files)
    tmp_meta = staging / (META + ".tmp")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, staging / META)
    final = staging.parent / step_name(meta["step"])
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    pointer = staging.parent / (LATEST + ".tmp")
    pointer.write_text(final.name)
    os.replace(pointer, staging.parent / LATEST)
    return final


def read_meta(ckpt: str | Path) -> dict[str, Any]:
    """Check a checkpoint directory completely; return its meta. Raises CheckpointError."""
    ckpt = Path(ckpt)
    meta_path = ckpt / META
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} is incomplete: {META} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {str(meta_path)!r} is corrupt: {exc}") from exc
    for entry in meta.get("files", []):
        path = ckpt / entry["file"]
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {str(path)!r} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt: {size} bytes, "
                                  f"{META} says {entry['bytes']} (truncated or overwritten)")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt: its sha256 differs "
                                  f"from the one in {META} (bytes changed)")
    if not meta.get("files"):
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lists no tensor files in {META}")
    return meta


def load_tensors(ckpt: str | Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """All tensors of a checked checkpoint, merged (safetensors: no code is unpickled)."""
    out: dict[str, torch.Tensor] = {}
    for entry in meta["files"]:
        path = Path(ckpt) / entry["file"]
        try:
            out.update(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: {exc}") from exc
    return out


def iter_tensors(ckpt: str | Path, meta: dict[str, Any]) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(key, loader) for every tensor of a checked checkpoint, file by file; calling a loader
    (while the iteration is at it) reads that one tensor, so a whole model is never in memory."""
    from safetensors import safe_open

    for entry in meta["files"]:
        path = Path(ckpt) / entry["file"]
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open handles are not dicts)
                    yield key, (lambda f=f, key=key: f.get_tensor(key))
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: {exc}") from exc


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its latest complete checkpoint)."""
    path = Path(path).expanduser().resolve()
    if (path / META).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{str(path)!r} is neither a checkpoint (no {META}) nor a run directory with one")
    return latest


def scan_checkpoints(run_dir: str | Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Every checkpoint under run_dir, checked: (valid ones newest first, [(corrupt one, why)]).

    Newest means highest step; ``latest`` only breaks no ties (a step has one directory).
    """
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return [], []
    valid, corrupt = [], []
    for c in sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True):
        try:
            read_meta(c)
            valid.append(c)
        except CheckpointError as exc:
            corrupt.append((c, str(exc)))
    return valid, corrupt


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete, uncorrupted checkpoint under run_dir (None if there is none)."""
    valid, _ = scan_checkpoints(run_dir)
    return valid[0] if valid else None


def expert_key(param_name: str, expert: int) -> str:
    """``layers.1.mlp.routed.w13``, expert 5 → ``layers.1.mlp.routed.experts.5.w13`` (world-size independent)."""
    prefix, kind = param_name.rsplit(".", 1)
    return f"{prefix}.experts.{expert}.{kind}"


def optim_key(key: str, state: str) -> str:
    return f"optim.{key}.{state}"


def buffer_key(name: str) -> str:
    return f"buffer.{name}"


def rng_key(rank: int, device_type: str) -> str:
    return f"rng.rank{rank}.{device_type}"


def shard_state(
    named_params: Iterable[tuple[str, torch.Tensor]],
    optim_state: Mapping[torch.Tensor, Mapping[str, torch.Tensor]],
    rank: int,
    device: torch.device,
    named_buffers: Iterable[tuple[str, torch.Tensor]] = (),
) -> dict[str, torch.Tensor]:
    """This rank's part of a checkpoint as flat named CPU tensors.

    Args:
        named_params: (name, parameter) of the model (or the optimizer's master copies under the
            model's names); expert-sharded ones carry ``expert_shard``.
        optim_state: the optimizer's per-parameter state, keyed by the tensors of
            ``named_params`` (``exp_avg``/``exp_avg_sq`` shaped like the parameter; other entries
            are not saved: the step count is in the meta).
        rank: this rank; replicated parameters and their state come from rank 0 only.
        device: this rank's device (its RNG state is saved too).
        named_buffers: (name, tensor) of replicated non-parameter state that training changes
            (e.g. a router's balancing bias), saved from rank 0 under ``buffer.{name}``.
    """
    out: dict[str, torch.Tensor] = {}
    if rank == 0:
        for name, buf in named_buffers:
            out[buffer_key(name)] = buf.detach().cpu().clone()
    for name, p in named_params:
        state = optim_state.get(p, {})
        shard = expert_shard(p)
        if shard is not None:  # native slots only: clones are copies
            for slot, e in enumerate(shard.native_experts):
                key = expert_key(name, e)
                out[key] = p.detach()[slot].cpu().clone()
                for s in OPTIM_STATES:
                    if s in state:
                        out[optim_key(key, s)] = state[s][slot].cpu().clone()
        elif rank == 0:
            out[name] = p.detach().cpu().clone()
            for s in OPTIM_STATES:
                if s in state:
                    out[optim_key(name, s)] = state[s].cpu().clone()
    out[rng_key(rank, "cpu")] = torch.get_rng_state()
    if device.type == "cuda":
        out[rng_key(rank, "cuda")] = torch.cuda.get_rng_state(device)
    return out


@torch.no_grad()
def load_shard_state(
    named_params: Iterable[tuple[str, torch.Tensor]],
    optim_state: dict[torch.Tensor, dict[str, torch.Tensor]],
    tensors: Mapping[str, torch.Tensor],
    opt_steps: int,
    rank: int,
    device: torch.device,
    named_buffers: Iterable[tuple[str, torch.Tensor]] = (),
) -> None:
    """Load a whole checkpoint (every rank's tensors merged) into this rank's parameters and
    optimizer state (``optim_state``, the optimizer's ``state`` dict, filled in place).

    Expert-sharded parameters take their native experts' rows (clone slots are left to the
    caller, which refills them from the owners); the optimizer state is restored only when
    ``opt_steps > 0``; this rank's RNG is restored when the saved run had this rank.
    Raises :class:`CheckpointError` naming a missing tensor or a shape that does not match.
    An old byte-model checkpoint is renamed first (:func:`migrate_keys`).
    """
    tensors = migrate_keys(tensors)
    for name, buf in named_buffers:
        buf.copy_(_need(tensors, buffer_key(name), buf.shape))
    for name, p in named_params:
        shard = expert_shard(p)
        state: dict[str, torch.Tensor] = {}
        if shard is not None:
            for slot, e in enumerate(shard.native_experts):
                key = expert_key(name, e)
                p[slot].copy_(_need(tensors, key, p[slot].shape))
                if opt_steps > 0:
                    for s in OPTIM_STATES:
                        state.setdefault(s, torch.zeros_like(p))[slot].copy_(
                            _need(tensors, optim_key(key, s), p[slot].shape))
        else:
            p.copy_(_need(tensors, name, p.shape))
            if opt_steps > 0:
                for s in OPTIM_STATES:
                    state[s] = _need(tensors, optim_key(name, s), p.shape).to(p.device, p.dtype).clone()
        if opt_steps > 0:
            state["step"] = torch.tensor(float(opt_steps))
            optim_state[p] = state
    if rng_key(rank, "cpu") in tensors:
        torch.set_rng_state(tensors[rng_key(rank, "cpu")])
    if device.type == "cuda" and rng_key(rank, "cuda") in tensors:
        torch.cuda.set_rng_state(tensors[rng_key(rank, "cuda")], device)


# The byte model's module names before it became an architecture of the one decoder
# (ray_moe.model.decoder): old name → new name, per block, with the fused tensors split.
_OLD_TOP = MappingProxyType({"tok_emb.weight": "embed_tokens.weight", "pos_emb": "embed_positions",
                             "norm_f.weight": "norm.weight"})
_OLD_BLOCK = MappingProxyType({
    "norm1.weight": ("input_layernorm.weight",), "norm2.weight": ("post_attention_layernorm.weight",),
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.proj.weight": ("self_attn.o_proj.weight",),
    "ffn.w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),  # a dense first layer
    "ffn.w2.weight": ("mlp.down_proj.weight",),
})


def is_old_byte_layout(keys: Iterable[str]) -> bool:
    """True when a checkpoint's keys are the byte model's old module names (``tok_emb``, ``blocks.i``)."""
    return any(k == "tok_emb.weight" or k.startswith("blocks.") for k in keys)


def _migrate_name(name: str) -> list[str] | None:
    """The new parameter name(s) of an old byte-model name (several: a fused tensor split along
    dim 0 in that order); None when the name is not one of the old layout's."""
    if name in _OLD_TOP:
        return [_OLD_TOP[name]]
    if not name.startswith("blocks."):
        return None
    _, i, rest = name.split(".", 2)
    if rest in _OLD_BLOCK:
        return [f"layers.{i}.{n}" for n in _OLD_BLOCK[rest]]
    if rest.startswith("ffn."):  # the MoE layer: router, experts.{e}.w13 / w2, buffers
        return [f"layers.{i}.mlp.routed.{rest[len('ffn.'):]}"]
    return None


def migrate_keys(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the current module names: an old byte-model checkpoint
    (:func:`is_old_byte_layout`) renamed, its fused tensors (q|k|v [3H, H], a dense layer's
    gate|up [2I, H]) split along dim 0, optimizer state and buffers with their parameter; any
    other checkpoint unchanged. Expert keys stay per logical expert (any world size loads them)."""
    if not is_old_byte_layout(tensors):
        return dict(tensors)
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        prefix, suffix, name = "", "", key
        if key.startswith("optim."):
            prefix = "optim."
            name, _, state = key[len(prefix):].rpartition(".")
            suffix = "." + state
        elif key.startswith("buffer."):
            prefix, name = "buffer.", key[len("buffer."):]
        new = _migrate_name(name)
        if new is None:
            out[key] = t
            continue
        parts = t.chunk(len(new), dim=0) if len(new) > 1 else (t,)
        for n, part in zip(new, parts):
            out[prefix + n + suffix] = part.contiguous()
    return out


def _need(tensors: Mapping[str, torch.Tensor], key: str, shape: torch.Size) -> torch.Tensor:
    if key not in tensors:
        raise CheckpointError(f"checkpoint has no tensor {key!r}")
    t = tensors[key]
    if t.shape != shape:
        raise CheckpointError(f"checkpoint tensor {key!r} has shape {tuple(t.shape)}; the model expects {tuple(shape)}")
    return t


def saved_arch(meta: Mapping[str, Any]) -> ArchSpec:
    """The architecture a checkpoint was written with: its HF config (``meta["hf_config"]``), else
    the byte model of its config (a key the saving version did not have was at its default)."""
    if meta.get("hf_config"):
        return ArchSpec.from_hf(meta["hf_config"])
    saved, defaults = meta["config"], Config()

    def get(dotted: str) -> Any:
        section, key = dotted.split(".")
        return saved.get(section, {}).get(key, defaults.get(dotted))

    spec = ArchSpec.byte(vocab_size=get("model.vocab_size"), d_model=get("model.d_model"),
                         n_heads=get("model.n_heads"), n_layers=get("model.n_layers"),
                         seq_len=get("model.seq_len"), num_experts=get("moe.num_experts"),
                         top_k=get("moe.top_k"), expert_hidden=get("moe.expert_hidden"),
                         dense_first_layer=get("model.dense_first_layer"), dense_hidden=get("model.dense_hidden"))
    return dataclasses.replace(spec, family=get("model.arch"))  # an HF run saved before meta had hf_config


def check_compatible(meta: Mapping[str, Any], config: Config, path: str | Path, arch: ResolvedArch) -> None:
    """Raise :class:`~ray_moe.config.ConfigError` naming the first key on which ``config`` (of the
    resolved architecture ``arch``) and the checkpoint differ: an architecture field of
    :data:`ARCH_FIELDS` (the checkpoint's: :func:`saved_arch`), or a key of :data:`COMPATIBLE_KEYS`."""
    theirs_spec = saved_arch(meta)
    saved, defaults = meta["config"], Config()
    differ = []
    for dotted, field in ARCH_FIELDS.items():
        ours, theirs = getattr(arch.spec, field), getattr(theirs_spec, field)
        if field == "moe_layers":  # the dense layers: named by the byte model's key
            ours, theirs = not ours[0], not theirs[0]
        differ.append((dotted, ours, theirs) if ours != theirs else None)
    for dotted in COMPATIBLE_KEYS:
        section, key = dotted.split(".")
        differ.append((dotted, config.get(dotted), saved.get(section, {}).get(key, defaults.get(dotted))))
    for entry in differ:
        if entry is not None and entry[1] != entry[2]:
            dotted, ours, theirs = entry
            raise ConfigError(f"{dotted}={ours} but checkpoint {str(path)!r} has {theirs}")
    if arch.spec.moe_layers != theirs_spec.moe_layers:
        raise ConfigError(f"the dense layers differ: the model has MoE layers {arch.spec.moe_layers}, "
                          f"checkpoint {str(path)!r} {theirs_spec.moe_layers}")


def clean_staging(run_dir: str | Path) -> None:
    """Remove staging directories left by interrupted saves."""
    root = checkpoints_dir(run_dir)
    for p in root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
