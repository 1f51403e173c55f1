"""Checks on the driver before any worker starts: what the workers would refuse after seconds of
start-up (a data path that is not there, a dataset that does not fit the model, model.init_from
that is not a model directory or disagrees with model.hf_config) is refused here, at once, as one
line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ray_moe import arch
from ray_moe.config import HF_MODEL_DIR, Config, ConfigError
from ray_moe.worker.data import open_corpus

# A byte corpus up to this size is read on the driver too (the workers read it again); a larger
# one is left to the workers.
DRIVER_READ_BYTES = 64 << 20
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json")
# ArchSpec fields that loaded weights make irrelevant.
_IGNORED = ("init_std",)


def preflight(config: Config, resolved: arch.ResolvedArch) -> None:
    """Raise ConfigError or DataError (``ray_moe.data.errors``) for inputs the workers would refuse;
    ``resolved``: the run's architecture (``config.validate()``'s)."""
    check_init_from(config, resolved)
    check_data(config, resolved.spec.vocab_size)


def check_init_from(config: Config, resolved: arch.ResolvedArch) -> None:
    """``model.init_from``: an existing Hugging Face model directory whose config.json agrees with
    the run's architecture (``model.hf_config`` with ``model.hf`` on top) when both are given."""
    m = config.model
    if not m.init_from:
        return
    path = Path(m.init_from).expanduser()
    want = HF_MODEL_DIR
    if not path.exists():
        raise ConfigError(f"model.init_from={m.init_from!r} does not exist; expected {want}")
    if not path.is_dir() or not (path / "config.json").is_file():
        what = "a directory without config.json" if path.is_dir() else "a file"
        raise ConfigError(f"model.init_from={m.init_from!r} is {what}; expected {want}")
    if not any((path / name).is_file() for name in WEIGHTS_FILES):
        raise ConfigError(f"model.init_from={m.init_from!r} holds no weights (neither {' nor '.join(WEIGHTS_FILES)}); "
                          f"expected {want}")
    check_weight_files(path)
    if not m.hf_config:
        return
    try:
        theirs = arch.resolve(str(path), m.hf)[0]
    except arch.ArchError:
        return  # config.validate names these
    ours = resolved.spec
    diffs = [f"{f.name} {getattr(theirs, f.name)} there, {getattr(ours, f.name)} in model.hf_config"
             for f in dataclasses.fields(arch.ArchSpec)
             if f.name not in _IGNORED and getattr(theirs, f.name) != getattr(ours, f.name)]
    if diffs:
        raise ConfigError(f"model.init_from={m.init_from!r} holds a model whose config.json differs from "
                          f"model.hf_config={m.hf_config!r} ({'; '.join(diffs[:3])}"
                          f"{'; ...' if len(diffs) > 3 else ''}); the weights need their own config: clear "
                          "model.hf_config (model.hf_config='') to use it, or point it at the same directory")


def check_weight_files(path: Path) -> None:
    """Every safetensors file of the model directory ``path`` (model.safetensors, or the shards
    that model.safetensors.index.json lists) exists and has a readable header; only the headers
    are read. Raises ConfigError naming the file."""
    from safetensors import SafetensorError, safe_open

    index = path / WEIGHTS_FILES[1]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"model.init_from: {index} is not a safetensors index with a weight_map "
                              f"({type(exc).__name__}: {exc})") from None
    else:
        shards = [WEIGHTS_FILES[0]]
    for name in shards:
        shard = path / name
        if not shard.is_file():
            raise ConfigError(f"model.init_from: {shard}, listed in {index.name}, does not exist")
        try:
            with safe_open(str(shard), "pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"model.init_from: {shard} is not a readable safetensors file ({exc}); expected "
                              "weights as transformers' save_pretrained writes them") from None


def check_data(config: Config, vocab_size: int) -> None:
    """Open the run's data as a worker would (``vocab_size``: the architecture's): prepared
    datasets, and the byte corpus up to DRIVER_READ_BYTES (a larger one is checked on its first
    DRIVER_READ_BYTES)."""
    d = config.data
    if d.datasets or 0 < d.max_bytes <= DRIVER_READ_BYTES:
        open_corpus(config, vocab_size)
        return
    # Only a part is read: its validation split is not the run's, so only the run's own rule for
    # that (checked by the workers) could refuse a tiny data.val_fraction.
    vf = max(d.val_fraction, 0.01) if d.val_fraction > 0 else 0.0
    open_corpus(config.with_overrides([f"data.max_bytes={DRIVER_READ_BYTES}", f"data.val_fraction={vf}"]), vocab_size)
