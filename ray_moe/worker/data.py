"""Byte-level corpus with no download: the Python standard library's sources by default.

Batches are a pure function of (seed, step): the global batch of step s is ``batch_size``
windows of ``seq_len + 1`` bytes at offsets drawn from a generator seeded by (seed, s), and
rank r of W takes rows ``[r*B/W, (r+1)*B/W)``. So a run resumes exactly from its step counter
(the data position), and the global batch does not depend on the world size: a checkpoint taken
at W=2 continues identically at W=1 or W=4.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ray_moe.config import DataConfig


class DataError(ValueError):
    """The corpus cannot be built; the message names the path or setting at fault."""


def default_paths() -> list[str]:
    return [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")]


def resolve_files(patterns: list[str]) -> list[Path]:
    """Files named by paths, directories (every file below) or globs, sorted, deduplicated."""
    files: set[Path] = set()
    for pat in patterns:
        p = Path(pat).expanduser()
        if p.is_file():
            files.add(p.resolve())
        elif p.is_dir():
            files.update(f.resolve() for f in p.rglob("*") if f.is_file())
        elif any(ch in pat for ch in "*?["):
            matched = [Path(f).resolve() for f in glob.glob(str(p), recursive=True) if os.path.isfile(f)]
            if not matched:
                raise DataError(f"data.paths: the pattern {pat!r} matches no file")
            files.update(matched)
        else:
            raise DataError(f"data.paths: {pat!r} does not exist")
    return sorted(files)


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [N_train]
    val: torch.Tensor  # uint8 [N_val]
    files: int

    @classmethod
    def load(cls, cfg: DataConfig, min_bytes: int = 2) -> "Corpus":
        files = resolve_files(cfg.paths or default_paths())
        chunks, total = [], 0
        for f in files:
            try:
                b = f.read_bytes()
            except OSError as exc:
                raise DataError(f"data.paths: cannot read {str(f)!r}: {exc}") from exc
            if cfg.max_bytes and total + len(b) > cfg.max_bytes:
                b = b[: cfg.max_bytes - total]
            chunks.append(b)
            total += len(b)
            if cfg.max_bytes and total >= cfg.max_bytes:
                break
        data = b"\n".join(chunks)
        n_val = int(len(data) * cfg.val_fraction)
        n_train = len(data) - n_val
        if n_train < min_bytes or (cfg.val_fraction > 0 and n_val < min_bytes):
            raise DataError(
                f"data.paths: the corpus from {len(files)} file(s) has {len(data)} bytes; it needs "
                f"at least {min_bytes} training bytes and {min_bytes} validation bytes "
                f"(data.val_fraction={cfg.val_fraction}) for windows of model.seq_len+1"
            )
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return cls(train=t[:n_train].clone(), val=t[n_train:].clone(), files=len(files))

    def batch(
        self, split: str, seed: int, step: int, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of global batch ``step``: (inputs, targets) int64 [batch_size/W, seq_len]."""
        data = self.train if split == "train" else self.val
        if batch_size % world_size:
            raise ValueError(f"train.batch_size={batch_size} is not divisible by world_size={world_size}")
        g = torch.Generator().manual_seed((seed * 1_000_003 + step * 2 + (split == "val")) & 0x7FFFFFFF)
        starts = torch.randint(0, len(data) - seq_len - 1 + 1, (batch_size,), generator=g)
        per = batch_size // world_size
        starts = starts[rank * per : (rank + 1) * per]
        idx = starts.unsqueeze(1) + torch.arange(seq_len + 1)
        win = data[idx].long()
        return win[:, :-1], win[:, 1:]
