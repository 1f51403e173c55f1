"""What the engine reads batches from: the byte corpus (the default) or prepared token
datasets (``data.datasets``: memory-mapped shards from ``ray-moe prepare``, one or a weighted
mixture).

Batches are a pure function of (seed, step): the global batch of step s is ``batch_size``
windows of ``seq_len + 1`` tokens at offsets drawn from a generator seeded by (seed, s), and
rank r of W takes rows ``[r*B/W, (r+1)*B/W)``. So a run resumes exactly from its step counter
(the data position), and the global batch does not depend on the world size: a checkpoint taken
at W=2 continues identically at W=1 or W=4. Windows run across document boundaries (documents
are packed, EOS-separated).

The byte corpus (``data.paths``: files, directories or globs, listed by
:func:`ray_moe.data.inputs.iter_paths`, the walker ``ray-moe prepare`` uses too; default: the
Python standard library's sources) is read whole into memory on every rank; its validation split
is ``data.val_fraction`` of its 4 KiB blocks, evenly spread (:func:`val_bytes`). Token datasets are memory-mapped: each rank maps only the shards its
windows touch, straight from the dataset directory (nothing goes through the driver).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

from ray_moe.config import Config, DataConfig
from ray_moe.data.errors import DataError
from ray_moe.data.inputs import binary_reason, iter_paths
from ray_moe.data.mixture import window_starts
from ray_moe.data.shards import PreparedDataset, val_mask
from ray_moe.data.tokenizer import tokenizer_hash

__all__ = ["Corpus", "DataError", "TokenShards", "has_val_split", "open_corpus"]


def default_paths() -> list[str]:
    return [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")]


VAL_BLOCK = 4096  # bytes per block of the byte corpus's validation rule (fewer in a small corpus)


def val_bytes(n: int, val_fraction: float) -> np.ndarray:
    """bool [n]: the validation bytes of an n-byte corpus. The corpus is cut into blocks of
    VAL_BLOCK bytes (n // 256 when smaller, so that a corpus has at least 256 blocks) and block b
    is a validation block by ``ray-moe prepare``'s rule for documents (:func:`val_mask`): a
    fraction ``val_fraction`` of the blocks, evenly spread over the corpus (not its last part,
    which for the default corpus is one kind of file)."""
    block = max(1, min(VAL_BLOCK, n // 256))
    blocks = val_mask(np.arange(-(-n // block), dtype=np.int64), val_fraction)
    return np.repeat(blocks, block)[:n]


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [N_train]
    val: torch.Tensor  # uint8 [N_val]
    files: int

    @property
    def train_tokens(self) -> int:
        return len(self.train)

    @classmethod
    def load(cls, cfg: DataConfig, min_bytes: int = 2) -> Corpus:
        chunks, total, files = [], 0, 0
        for f in iter_paths(cfg.paths or default_paths(), "data.paths"):
            files += 1
            try:
                b = f.read_bytes()
            except OSError as exc:
                raise DataError(f"data.paths: cannot read {str(f)!r}: {exc}") from exc
            reason = binary_reason(b)
            if reason:
                raise DataError(f"data.paths: {str(f)!r} is not text ({reason}); the byte corpus reads UTF-8 text files")
            if cfg.max_bytes and total + len(b) > cfg.max_bytes:
                b = b[: cfg.max_bytes - total]
            chunks.append(b)
            total += len(b)
            if cfg.max_bytes and total >= cfg.max_bytes:
                break
        data = b"\n".join(chunks)
        in_val = val_bytes(len(data), cfg.val_fraction)
        n_val = int(in_val.sum())
        n_train = len(data) - n_val
        if n_train < min_bytes or (cfg.val_fraction > 0 and n_val < min_bytes):
            raise DataError(
                f"data.paths: the corpus from {files} file(s) has {len(data)} bytes; it needs "
                f"at least {min_bytes} training bytes and {min_bytes} validation bytes "
                f"(data.val_fraction={cfg.val_fraction}) for windows of model.seq_len+1"
            )
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mask = torch.from_numpy(in_val)
        return cls(train=t[~mask].clone(), val=t[mask].clone(), files=files)

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


class TokenShards:
    """Prepared token datasets (one, or a weighted mixture) read through memory maps.

    Every row of a global batch comes from one dataset, chosen by :mod:`ray_moe.data.mixture`
    (each batch gives dataset k ⌊w_k·B⌋ or ⌈w_k·B⌉ rows), at a uniform window start in that
    dataset's split. Opening checks what training needs before any step: each dataset is
    finished and whole, its vocabulary fits the architecture's V, its tokenizer is the run's
    (``data.tokenizer``) or at least the same for every dataset, and each split holds a window.
    """

    def __init__(self, datasets: list[PreparedDataset], weights: list[float], vocab_size: int,
                 vocab_key: str = "model.vocab_size"):
        self.datasets, self.weights, self.vocab_size, self.vocab_key = datasets, weights, vocab_size, vocab_key

    @classmethod
    def open(cls, cfg: DataConfig, vocab_size: int, seq_len: int, vocab_key: str = "model.vocab_size") -> TokenShards:
        """``vocab_size``: the architecture's V; ``vocab_key``: the key that sets it, for messages
        (``model.vocab_size`` for the byte model, ``model.hf.vocab_size`` for an HF family)."""
        run_hash = tokenizer_hash(cfg.tokenizer) if cfg.tokenizer else None
        datasets, weights = [], []
        for path, weight in cfg.mixture():
            ds = PreparedDataset(path)
            where = f"data.datasets: {ds.path}"
            if ds.vocab_size > vocab_size:
                raise DataError(f"{where} was prepared with a tokenizer of {ds.vocab_size} tokens but "
                                f"{vocab_key}={vocab_size}; set {vocab_key} >= {ds.vocab_size}")
            want = run_hash or (datasets[0].tokenizer_hash if datasets else ds.tokenizer_hash)
            if ds.tokenizer_hash != want:
                other = f"data.tokenizer={cfg.tokenizer}" if run_hash else f"{datasets[0].path}"
                raise DataError(f"{where} was prepared with another tokenizer (sha256 {ds.tokenizer_hash[:12]}, "
                                f"{ds.meta['tokenizer'].get('directory', '?')}) than {other} (sha256 {want[:12]}); "
                                "prepare every dataset with the run's tokenizer")
            for name, split in ds.splits.items():
                for file, top in zip(split.files, split.max_ids):
                    if top >= vocab_size:
                        raise DataError(f"{ds.path / file} holds token id {top} but {vocab_key}={vocab_size}; "
                                        "expected ids below the vocabulary size")
                if split.tokens < seq_len + 1:
                    raise DataError(f"{where} has {split.tokens} {name} tokens; a window of model.seq_len+1="
                                    f"{seq_len + 1} needs at least that many (prepare more text"
                                    f"{' or a larger --val-fraction' if name == 'val' else ''})")
            datasets.append(ds)
            weights.append(weight)
        return cls(datasets, weights, vocab_size, vocab_key)

    @property
    def train_tokens(self) -> int:
        return sum(ds.split("train").tokens for ds in self.datasets)

    @property
    def files(self) -> int:
        return sum(len(split.files) for ds in self.datasets for split in ds.splits.values())

    def batch(
        self, split: str, seed: int, step: int, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of global batch ``step``: (inputs, targets) int64 [batch_size/W, seq_len]."""
        if batch_size % world_size:
            raise ValueError(f"train.batch_size={batch_size} is not divisible by world_size={world_size}")
        streams = [ds.split(split) for ds in self.datasets]
        which, starts = window_starts(seed, step, split, batch_size, seq_len + 1, self.weights,
                                      [s.tokens for s in streams])
        per = batch_size // world_size
        rows = slice(rank * per, (rank + 1) * per)
        win = np.stack([streams[k].read(int(s), seq_len + 1) for k, s in zip(which[rows], starts[rows])])
        if win.size and int(win.max()) >= self.vocab_size:
            r, j = np.argwhere(win >= self.vocab_size)[0]
            stream = streams[which[rows][r]]
            file, offset = stream.shard_of(int(starts[rows][r]) + int(j))
            raise DataError(f"{stream.root / file} holds token id {int(win[r, j])} at token {offset} but "
                            f"{self.vocab_key}={self.vocab_size}; the shard is damaged or from another tokenizer")
        t = torch.from_numpy(win)
        return t[:, :-1], t[:, 1:]


def has_val_split(cfg: DataConfig) -> bool:
    """Whether the run's data has a validation split: the byte corpus when ``val_fraction > 0``;
    every prepared dataset when it holds val tokens (only its index is read)."""
    if not cfg.datasets:
        return cfg.val_fraction > 0
    for path, _ in cfg.mixture():
        split = PreparedDataset(path).splits.get("val")
        if split is None or split.tokens == 0:
            return False
    return True


def open_corpus(config: Config, vocab_size: int) -> Corpus | TokenShards:
    """The engine's batch source for ``config``: token datasets when ``data.datasets`` is set
    (their tokens must fit ``vocab_size``, the resolved architecture's), else the byte corpus."""
    if config.data.datasets:
        vocab_key = "model.hf.vocab_size" if config.model.uses_hf() else "model.vocab_size"
        return TokenShards.open(config.data, vocab_size, config.model.seq_len, vocab_key)
    return Corpus.load(config.data, min_bytes=config.model.seq_len + 2)
