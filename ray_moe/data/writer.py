"""Writing a prepared dataset: the document stream → fixed-size shards per split, durable and
resumable (the format is described in :mod:`ray_moe.data.shards`).

Tokens are appended to the split's in-progress ``.partial`` file; when it holds ``shard_tokens``
it is fsynced and renamed to its shard name, and ``index.json`` is rewritten with every split's
durable length and cursor. An interrupted run loses at most what came after the last finished
shard; the same command resumes from there and writes the same bytes.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ray_moe import dirlock
from ray_moe.data.errors import DataError
from ray_moe.data.shards import (
    FORMAT,
    INDEX_FILE,
    LOCK_FILE,
    META_FILE,
    PPM,
    SPLITS,
    file_digest,
    fsync_dir,
    read_json,
    shard_name,
    val_mask,
    write_json_atomic,
)

log = logging.getLogger(__name__)


@dataclass
class _SplitState:
    index: int = 0  # the in-progress shard's number
    fill: int = 0  # its tokens written (durable up to the last checkpoint)
    cursor: tuple[int, int] = (0, 0)  # (document, token in it) of the next token to write
    documents: int = 0  # documents whose EOS is written
    handle: Any = None  # the open .partial file


@dataclass(frozen=True)
class ResumePoint:
    skip_files: int  # leading input files (stream order) whose documents are all written
    first_doc: int  # stream index of the first document of the first file read


class ShardWriter:
    """Cuts the document stream into fixed-size shards per split; durable and resumable.

    ``plan`` (JSON-able) is everything that decides the bytes: format, dtype, shard_tokens,
    val_fraction, eos_id, tokenizer, inputs, text_field. A directory holding another plan is
    refused; one holding this plan resumes from its index (``resume()`` says which inputs to
    skip); a finished one is left as it is (``complete``). A directory that exists and holds
    anything else is refused. Nothing is created before the first token is written.

    A writer that will write holds an exclusive lock on the directory (``LOCK_FILE``, taken
    before anything in it is read for resuming or changed; released by ``finish``, ``close`` and
    ``discard``, or when the process ends): a second prepare into the same directory is refused
    instead of interleaving its shards with this one's. Confirming a finished dataset takes no
    lock and changes nothing in it.
    """

    def __init__(self, out_dir: str | Path, plan: dict):
        self.out = Path(out_dir).expanduser().resolve()
        self.plan = plan
        self.dtype = np.dtype(plan["dtype"])
        self.shard_tokens = int(plan["shard_tokens"])
        self.eos_id = int(plan["eos_id"])
        self.val_fraction = float(plan["val_fraction"])
        self.splits = SPLITS if round(self.val_fraction * PPM) > 0 else SPLITS[:1]
        self.state = {s: _SplitState() for s in SPLITS}
        self.shards: list[dict] = []
        self.files: list[list] = []  # [path, documents] per finished input file, stream order
        self.complete = False
        self._created = False
        self._new = False  # this run created the directory
        self._lock: Any = None  # the open LOCK_FILE while this writer holds it
        index_path = self.out / INDEX_FILE
        index = read_json(index_path, "rerun prepare into a new directory") if index_path.exists() else None
        if not (index or {}).get("complete") and (index is not None or (self.out / LOCK_FILE).exists()):
            self._take_lock()  # a run to resume, or one starting here: refused at once if it is alive
            index = read_json(index_path, "rerun prepare into a new directory") if index_path.exists() else None
        if index is not None:
            try:
                self._load(index)
            except BaseException:  # refused: the lock must not outlive this constructor (a notebook
                self._release_lock()  # keeps the traceback, and with it this object)
                raise
        elif self.out.exists() and (not self.out.is_dir() or any(p.name != LOCK_FILE for p in self.out.iterdir())):
            self._release_lock()
            raise DataError(f"{self.out} exists and is not a prepared dataset (no {INDEX_FILE}); "
                            "choose another --out (nothing was changed)")

    # ---------------------------------------------------------------- resume
    def _load(self, index: dict) -> None:
        if index.get("plan") != self.plan:
            raise DataError(f"{self.out} holds a dataset prepared with other settings "
                            f"({_first_difference(index.get('plan'), self.plan)}); "
                            "choose another --out or delete that directory (nothing was changed)")
        self.shards = list(index["shards"])
        self.files = [list(f) for f in index["progress"]["files"]]
        self.complete = bool(index.get("complete"))
        self._created = True
        if not self.complete:
            self._announce()
        for split, p in index["progress"]["splits"].items():
            st = self.state[split]
            st.index, st.fill, st.documents = p["index"], p["fill"], p["documents"]
            st.cursor = tuple(p["cursor"])
            if self.complete:
                continue
            partial = self.out / (shard_name(split, st.index) + ".partial")
            final = self.out / shard_name(split, st.index)
            if not partial.exists() and final.exists():  # interrupted between rename and index
                os.replace(final, partial)
            if not partial.exists():
                if st.fill:
                    raise DataError(f"{partial} is missing but {INDEX_FILE} records {st.fill} tokens in it; "
                                    "the dataset directory was changed: prepare into a new --out")
                continue
            have = partial.stat().st_size // self.dtype.itemsize
            if have < st.fill:
                raise DataError(f"{partial} holds {have} tokens but {INDEX_FILE} records {st.fill}; "
                                "the dataset directory was changed: prepare into a new --out")
            with open(partial, "r+b") as fh:  # drop tokens written after the last checkpoint
                fh.truncate(st.fill * self.dtype.itemsize)

    def resume(self) -> ResumePoint:
        """Which leading input files to skip and the stream index of the next file's first
        document: every token of a skipped file's documents is durable in every split."""
        start = min(self.state[s].cursor[0] for s in self.splits)
        skip, docs = 0, 0
        for _path, n in self.files:
            if docs + n > start:
                break
            docs += n
            skip += 1
        del self.files[skip:]  # the files read again are counted again
        return ResumePoint(skip, docs)

    # ---------------------------------------------------------------- writing
    def add(self, first_doc: int, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Documents ``first_doc, first_doc+1, ...``: ids (unsigned ints [sum(lengths)], back to back)
        and lengths (int64 [n]; 0 = an empty document, skipped). Tokens already durable (a
        resumed run re-reading a file) are dropped."""
        n = len(lengths)
        if n == 0:
            return
        lengths = np.asarray(lengths, dtype=np.int64)
        doc = first_doc + np.arange(n, dtype=np.int64)
        with_eos_len = lengths + (lengths > 0)
        stream = np.insert(np.asarray(ids, dtype=np.uint32), np.cumsum(lengths)[lengths > 0],
                           np.uint32(self.eos_id))
        tok_doc = np.repeat(doc, with_eos_len)
        tok_pos = np.arange(len(stream), dtype=np.int64) - np.repeat(np.cumsum(with_eos_len) - with_eos_len,
                                                                     with_eos_len)
        is_eos = tok_pos == np.repeat(with_eos_len - 1, with_eos_len)
        in_val = np.repeat(val_mask(doc, self.val_fraction), with_eos_len)
        end = (first_doc + n, 0)
        for split in self.splits:
            st = self.state[split]
            d0, k0 = st.cursor
            keep = (in_val if split == "val" else ~in_val) & ((tok_doc > d0) | ((tok_doc == d0) & (tok_pos >= k0)))
            if keep.any():
                self._append(split, stream[keep], tok_doc[keep], tok_pos[keep], is_eos[keep], end)
            st.cursor = max(st.cursor, end)

    def _append(self, split: str, toks: np.ndarray, docs: np.ndarray, pos: np.ndarray, eos: np.ndarray,
                end: tuple[int, int]) -> None:
        st, i = self.state[split], 0
        while i < len(toks):
            take = min(self.shard_tokens - st.fill, len(toks) - i)
            self._handle(split).write(toks[i: i + take].astype(self.dtype).tobytes())
            st.documents += int(eos[i: i + take].sum())
            st.fill += take
            i += take
            if st.fill == self.shard_tokens:
                st.cursor = (int(docs[i]), int(pos[i])) if i < len(toks) else end
                self._finish_shard(split)
                self.checkpoint()

    def _handle(self, split: str):
        st = self.state[split]
        if st.handle is None:
            if not self._created:  # the index comes first, so a rerun knows the directory as its own
                made = not self.out.exists()
                self.out.mkdir(parents=True, exist_ok=True)
                if self._lock is None:
                    self._take_lock()
                if (self.out / INDEX_FILE).exists():  # another run began here since this one looked
                    raise DataError(f"{self.out} was started by another prepare after this one began; "
                                    "rerun this command to resume it (nothing was changed by this run)")
                self._announce()
                self._new = made  # only now: a run refused above must not discard the winner's files
                self._created = True
                write_json_atomic(self.out / INDEX_FILE, self._index())
            st.handle = open(self.out / (shard_name(split, st.index) + ".partial"), "ab")  # noqa: SIM115 - kept open across calls
        return st.handle

    def _take_lock(self) -> None:
        try:
            self._lock = dirlock.take(self.out / LOCK_FILE, "prepare")
        except dirlock.LockHeld as exc:
            raise DataError(f"{self.out} is being written by another prepare ({exc.holder}); wait for it to "
                            "end, then rerun to resume or confirm it (nothing was changed)") from None
        except dirlock.LockReplaced:
            raise DataError(f"{self.out}: another prepare was ending there as this one started; rerun "
                            "(nothing was changed)") from None
        except dirlock.LockUnusable as exc:
            raise DataError(f"{exc}; prepare must be able to lock its --out directory (remove or fix "
                            f"{LOCK_FILE} if no prepare is using it)") from None

    def _announce(self) -> None:
        """Name this process in the lock file, for a second prepare's message (only a writer that
        will write does: confirming a finished dataset changes nothing in it)."""
        dirlock.announce(self._lock)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _finish_shard(self, split: str) -> None:
        st = self.state[split]
        partial = self.out / (shard_name(split, st.index) + ".partial")
        if st.handle is not None:
            st.handle.flush()
            os.fsync(st.handle.fileno())
            st.handle.close()
            st.handle = None
        final = self.out / shard_name(split, st.index)
        digest, top = file_digest(partial, self.dtype)
        os.replace(partial, final)
        fsync_dir(self.out)
        self.shards.append({"file": final.name, "split": split, "tokens": st.fill, "sha256": digest, "max_id": top})
        st.index, st.fill = st.index + 1, 0

    def file_done(self, path: str, documents: int) -> None:
        """The stream has passed the end of input ``path`` (``documents`` rows, empty ones too)."""
        done = len(self.files)
        expected = self.plan["inputs"][done]["path"] if done < len(self.plan["inputs"]) else None
        if path != expected:
            raise RuntimeError(f"input {path} finished out of stream order (expected {expected})")
        self.files.append([path, int(documents)])

    def checkpoint(self) -> None:
        """Make every written token durable and record the progress in the index."""
        if not self._created:
            return
        for st in self.state.values():
            if st.handle is not None:
                st.handle.flush()
                os.fsync(st.handle.fileno())
        write_json_atomic(self.out / INDEX_FILE, self._index())

    def _index(self) -> dict:
        return {
            "format": FORMAT, "complete": self.complete, "plan": self.plan,
            "shards": sorted(self.shards, key=lambda s: (SPLITS.index(s["split"]), s["file"])),
            "progress": {
                "splits": {s: {"index": st.index, "fill": st.fill, "cursor": list(st.cursor),
                               "documents": st.documents} for s, st in self.state.items()},
                "files": self.files,
            },
        }

    def finish(self) -> dict:
        """Write each split's last (shorter) shard, the complete index, then ``meta.json``;
        returns the meta. Raises DataError, leaving nothing behind, when no token was written."""
        if not self.complete:
            for split, st in self.state.items():
                if st.fill:
                    self._finish_shard(split)
                elif st.handle is not None or (self.out / (shard_name(split, st.index) + ".partial")).exists():
                    if st.handle is not None:
                        st.handle.close()
                        st.handle = None
                    (self.out / (shard_name(split, st.index) + ".partial")).unlink()
            if not self.shards:
                self._remove_empty_dir()
                docs = sum(n for _, n in self.files)
                raise DataError(f"the inputs hold no text: {len(self.plan['inputs'])} file(s), {docs} document(s), "
                                "all empty; expected UTF-8 text (nothing was written)")
            self.complete = True
            write_json_atomic(self.out / INDEX_FILE, self._index())
        meta = self.meta()
        write_json_atomic(self.out / META_FILE, meta)
        self._release_lock()
        return meta

    def meta(self) -> dict:
        splits = {s: {"documents": self.state[s].documents,
                      "tokens": sum(x["tokens"] for x in self.shards if x["split"] == s),
                      "shards": sum(1 for x in self.shards if x["split"] == s)} for s in SPLITS}
        p = self.plan
        return {
            "format": FORMAT, "dtype": p["dtype"], "shard_tokens": p["shard_tokens"],
            "tokenizer": p["tokenizer"], "vocab_size": p["tokenizer"]["vocab_size"], "eos_id": p["eos_id"],
            "documents": sum(v["documents"] for v in splits.values()),
            "tokens": sum(v["tokens"] for v in splits.values()),
            "max_id": max((x["max_id"] for x in self.shards), default=0),
            "splits": splits, "val_fraction": p["val_fraction"], "text_field": p["text_field"],
            "inputs": p["inputs"], "input_bytes": sum(f["bytes"] for f in p["inputs"]),
        }

    def close(self) -> None:
        """After an error: make what was written durable (a rerun resumes from it), close files."""
        try:
            self.checkpoint()
        finally:
            for st in self.state.values():
                if st.handle is not None:
                    st.handle.close()
                    st.handle = None
            self._release_lock()

    def discard(self) -> None:
        """After bad input: remove what this run wrote when this run created the directory
        (its plan names the bad input, so nothing in it could be resumed); a directory that an
        earlier run made is kept, made durable, as ``close`` leaves it."""
        if not self._new:
            self.close()
            return
        for st in self.state.values():
            if st.handle is not None:
                st.handle.close()
                st.handle = None
        names = [x["file"] for x in self.shards] + [INDEX_FILE, META_FILE, f".{INDEX_FILE}.tmp"]
        names += [shard_name(split, st.index) + ".partial" for split, st in self.state.items()]
        for name in names:
            (self.out / name).unlink(missing_ok=True)
        (self.out / LOCK_FILE).unlink(missing_ok=True)  # still held: no one takes it before the end
        self._remove_empty_dir()
        self._release_lock()

    def _remove_empty_dir(self) -> None:
        if self._created and self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()


def _first_difference(a: Any, b: Any, where: str = "plan") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{where}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}[{i}]")
    return f"{where}: {_short(a)} there, {_short(b)} now"


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 80 else s[:77] + "..."
