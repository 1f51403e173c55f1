"""Writing prepared datasets without Ray, for the unit tests of the writer and the reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ray_moe.data.shards import FORMAT, token_dtype
from ray_moe.data.writer import ShardWriter


def make_plan(n_files: int, *, vocab_size: int = 1000, eos_id: int = 0, shard_tokens: int = 50,
              val_fraction: float = 0.25, tokenizer_hash: str = "h" * 64) -> dict:
    return {
        "format": FORMAT, "dtype": token_dtype(vocab_size).str, "shard_tokens": shard_tokens,
        "val_fraction": val_fraction, "eos_id": eos_id, "text_field": "text",
        "tokenizer": {"hash": tokenizer_hash, "vocab_size": vocab_size, "eos_token": "<eos>", "eos_id": eos_id},
        "inputs": [{"path": f"/in/{i:03d}.txt", "bytes": 1, "kind": "text"} for i in range(n_files)],
    }


def random_files(rng: np.random.Generator, n_files: int, low: int = 1, high: int = 1000) -> list[list[np.ndarray]]:
    """Documents (uint32 id arrays, some empty) of ``n_files`` input files."""
    return [[rng.integers(low, high, size=int(rng.integers(0, 40)), dtype=np.uint32)
             for _ in range(int(rng.integers(0, 6)))] for _ in range(n_files)]


def feed(writer: ShardWriter, files: list[list[np.ndarray]], first_file: int = 0, first_doc: int = 0,
         batch: int = 3, stop_after_docs: int | None = None) -> None:
    """Hand files[first_file:] to the writer in batches of ``batch`` documents, as prepare does."""
    doc, fed = first_doc, 0
    for i in range(first_file, len(files)):
        docs = files[i]
        for j in range(0, len(docs), batch):
            chunk = docs[j: j + batch]
            writer.add(doc, np.concatenate(chunk) if chunk else np.zeros(0, np.uint32),
                       np.array([len(d) for d in chunk], dtype=np.int64))
            doc += len(chunk)
            fed += len(chunk)
            if stop_after_docs is not None and fed >= stop_after_docs:
                return
        writer.file_done(f"/in/{i:03d}.txt", len(docs))


def write_dataset(out: Path, files: list[list[np.ndarray]], **plan_kw) -> dict:
    writer = ShardWriter(out, make_plan(len(files), **plan_kw))
    feed(writer, files)
    return writer.finish()
