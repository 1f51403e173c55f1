"""Atomic, resharding checkpoints.

Layout under ``<run_dir>/checkpoints/``::

    step_00000040/
        meta.json                 step, optimizer steps, world size, config, placement, and the
                                  size + sha256 of every file (written last)
        rank00000.safetensors     rank 0: replicated params + their optimizer state, its experts
        rank00001.safetensors     rank 1: its experts (keys name logical experts)
    latest                        name of the newest complete checkpoint (replaced atomically)

Each rank writes its own file straight into a temporary directory (data never passes through
the driver; on a multi-node cluster ``run_dir`` must be shared storage). The driver then writes
``meta.json`` and renames the directory into place: a crash at any point leaves the previous
checkpoint untouched. Loading checks every file's size and hash and refuses a corrupt or partial
checkpoint naming the file; tensors load through safetensors (no pickle).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

META = "meta.json"
LATEST = "latest"


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


def write_shard(staging: str | Path, rank: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write one rank's tensors; returns {file, bytes, sha256} for the meta."""
    path = Path(staging) / f"rank{rank:05d}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
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
        if path.stat().st_size != entry["bytes"] or _sha256(path) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} is corrupt (size or sha256 differs from {META})"
            )
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


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete, uncorrupted checkpoint under run_dir (None if there is none)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    candidates = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    for c in candidates:
        try:
            read_meta(c)
            return c
        except CheckpointError:
            continue
    return None


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
