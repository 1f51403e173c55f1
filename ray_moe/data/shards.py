"""The prepared-dataset format: fixed-size shards of token ids, ``index.json``, ``meta.json``.

A dataset directory holds, per split (``train``, ``val``), shards ``{split}-{i:05d}.bin``: raw
little-endian ``uint16`` token ids (``uint32`` when the vocabulary has more than 65536 tokens),
exactly ``shard_tokens`` of them except the split's last shard. A split is one stream: its
documents in stream order, each followed by the EOS token, cut into shards wherever the count
falls (sequences are packed across documents). Document *d* (counted over all inputs in stream
order, empty ones included) is a validation document when ``val_mask(d)``: exactly
``val_fraction`` of them, evenly spread.

``index.json`` lists the finished shards (file, split, tokens, sha256, largest id) and, while
preparation runs, its progress: per split the in-progress shard ``{split}-{i:05d}.bin.partial``,
how many of its tokens are durable, and the cursor (document, token within it) of the next
token; and the documents counted per finished input file. It is rewritten atomically after each
finished shard. ``meta.json`` (tokenizer, vocabulary, documents, tokens, inputs and their sizes)
is written last: a directory without it is an unfinished preparation, which the same command
resumes and which training refuses. A finished shard only ever appears by renaming a complete,
fsynced ``.partial`` file, so no shard is half-written. ``.prepare.lock`` is the lock the one
prepare writing the directory holds (``fcntl.flock``; its text names that process).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ray_moe.data.errors import DataError, load_json

FORMAT = "ray-moe-tokens/1"
INDEX_FILE = "index.json"
META_FILE = "meta.json"
LOCK_FILE = ".prepare.lock"  # held by the one prepare writing the directory (data/writer.py)
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard
PPM = 1_000_000


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size ≤ 65536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def val_mask(doc_index: np.ndarray, val_fraction: float) -> np.ndarray:
    """bool [N]: which documents (int64 [N] stream indices) are validation documents: document
    d is when ⌊(d+1)·f⌋ > ⌊d·f⌋ (f in parts per million), so a fraction f of every run of
    documents, evenly spread, independent of how the stream is batched."""
    ppm = round(val_fraction * PPM)
    d = np.asarray(doc_index, dtype=np.int64)
    return (d + 1) * ppm // PPM > d * ppm // PPM


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to a temporary file, fsync, rename over ``path``, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path, what: str) -> dict:
    obj = load_json(path, f"is missing; {what}")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} file (format {obj.get('format') if isinstance(obj, dict) else None!r})")
    return obj


def file_digest(path: Path, dtype: np.dtype, chunk_tokens: int = 1 << 22) -> tuple[str, int]:
    """(sha256 hex, largest token id) of a shard file, read in chunks."""
    h, top = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_tokens * dtype.itemsize):
            h.update(chunk)
            top = max(top, int(np.frombuffer(chunk, dtype=dtype).max()))
    return h.hexdigest(), top


# ============================================================================ reading
class TokenSplit:
    """One split of a prepared dataset as one token stream over its memory-mapped shards
    (each shard is mapped on first read; nothing is loaded whole)."""

    def __init__(self, root: Path, shards: list[dict], dtype: np.dtype):
        self.root, self.dtype = root, dtype
        self.files = tuple(s["file"] for s in shards)
        self.max_ids = tuple(int(s["max_id"]) for s in shards)
        self.offsets = np.cumsum([0] + [int(s["tokens"]) for s in shards], dtype=np.int64)
        self._maps: dict[int, np.memmap] = {}

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def shard_of(self, position: int) -> tuple[str, int]:
        """(file, token offset in it) of stream position ``position``."""
        i = int(np.searchsorted(self.offsets, position, side="right")) - 1
        return self.files[i], position - int(self.offsets[i])

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start+n) of the stream as int64 [n] (copied out of the maps)."""
        if start < 0 or start + n > self.tokens:
            raise IndexError(f"tokens [{start}, {start + n}) outside the split's {self.tokens}")
        out = np.empty(n, dtype=np.int64)
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        while done < n:
            lo = start + done - int(self.offsets[i])
            take = min(n - done, int(self.offsets[i + 1] - self.offsets[i]) - lo)
            out[done: done + take] = self._map(i)[lo: lo + take]
            done += take
            i += 1
        return out

    def _map(self, i: int) -> np.memmap:
        if i not in self._maps:
            self._maps[i] = np.memmap(self.root / self.files[i], dtype=self.dtype, mode="r")
        return self._maps[i]


class PreparedDataset:
    """A finished dataset directory, checked: its index and meta agree and every shard is
    present at its full size. ``split(name)`` → :class:`TokenSplit`."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        if not self.path.is_dir():
            raise DataError(f"{self.path}: no such dataset directory; prepare one with ray-moe prepare --out {path}")
        index = read_json(self.path / INDEX_FILE, f"{self.path} is not a prepared dataset (ray-moe prepare writes it)")
        if not index.get("complete") or not (self.path / META_FILE).exists():
            raise DataError(f"{self.path}: preparation did not finish ({META_FILE} is missing); "
                            "rerun the same ray-moe prepare command to resume it")
        self.meta = read_json(self.path / META_FILE, "rerun the same ray-moe prepare command")
        dtype = self.meta.get("dtype")
        if dtype not in ("<u2", "<u4"):
            raise DataError(f"{self.path / META_FILE}: dtype {dtype!r}; expected <u2 or <u4")
        self.dtype = np.dtype(dtype)
        try:
            self.splits = self._open_splits(index)
        except DataError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{self.path}: {INDEX_FILE} or {META_FILE} is malformed ({exc!r}); "
                            "prepare the dataset again") from None

    def _open_splits(self, index: dict) -> dict[str, TokenSplit]:
        splits: dict[str, TokenSplit] = {}
        for split in SPLITS:
            shards = [s for s in index["shards"] if s["split"] == split]
            for s in shards:
                f = self.path / s["file"]
                want = int(s["tokens"]) * self.dtype.itemsize
                if not f.is_file():
                    raise DataError(f"{f} is missing ({INDEX_FILE} lists it with {s['tokens']} tokens)")
                if f.stat().st_size != want:
                    raise DataError(f"{f} is truncated or damaged: {f.stat().st_size} bytes, {INDEX_FILE} says "
                                    f"{want} ({s['tokens']} tokens of {self.dtype.itemsize} bytes)")
            splits[split] = TokenSplit(self.path, shards, self.dtype)
            if splits[split].tokens != self.meta["splits"][split]["tokens"]:
                raise DataError(f"{self.path}: {INDEX_FILE} and {META_FILE} disagree on the {split} tokens "
                                f"({splits[split].tokens} vs {self.meta['splits'][split]['tokens']})")
        return splits

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def tokenizer_hash(self) -> str:
        return self.meta["tokenizer"]["hash"]

    def split(self, name: str) -> TokenSplit:
        return self.splits[name]
