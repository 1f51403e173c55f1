"""Input files: which files a list of paths, directories and globs names, what kind each is,
whether it is text, and its documents.

Which files (:func:`iter_paths`, the one walker: ``ray-moe prepare``, ``ray-moe tokenizer train``
and the byte corpus of ``data.paths`` all use it): a file is taken as named; a directory gives
every file below it; a glob (``*``, ``?``, ``[``; ``**`` recursive) every file it matches. Below
a named directory and for a wildcard, hidden names (a leading ``.``) and ``__pycache__``
directories are skipped (a pattern whose last part starts with ``.``, e.g. ``dir/**/.*rc``, still
matches hidden files); symbolic links to directories are followed by ``**`` (each directory once)
but not in a directory walk. Files come in sorted path order, each once (by resolved path), as
resolved paths.

Kinds, in the order a prepared dataset's document stream visits them (sorted by path within
a kind):

* ``text``: any file that is not one of the two below; the whole file is one document, decoded
  as UTF-8 (invalid bytes replaced by U+FFFD, counted and reported). A file with a NUL byte
  or many control characters is binary and refused (see :func:`binary_reason`).
* ``jsonl`` (``.jsonl``, ``.ndjson``, ``.json``: JSON lines): one document per line, its text
  in a string field (``text`` by default).
* ``parquet``: one document per row, its text in a string column.

A document with no text (empty, or a null field) is skipped.
"""

from __future__ import annotations

import fnmatch
import glob
import heapq
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ray_moe.data.errors import DataError

TEXT, JSONL, PARQUET = "text", "jsonl", "parquet"
KINDS = (TEXT, JSONL, PARQUET)  # the stream order of a prepared dataset
SUFFIX_KIND = MappingProxyType({".jsonl": JSONL, ".ndjson": JSONL, ".json": JSONL, ".parquet": PARQUET})
SNIFF_BYTES = 1 << 16  # what the driver reads of each input before starting any work
MAX_CONTROL_FRACTION = 0.1  # above this share of control characters a file is binary
CONTROL_BYTES = bytes(b for b in range(32) if chr(b) not in "\t\n\r\f\v\b\x1b") + b"\x7f"


@dataclass(frozen=True)
class InputFile:
    path: str  # absolute
    size: int  # bytes
    kind: str  # text | jsonl | parquet

    def to_dict(self) -> dict:
        return {"path": self.path, "bytes": self.size, "kind": self.kind}


def kind_of(path: str) -> str:
    return SUFFIX_KIND.get(Path(path).suffix.lower(), TEXT)


SKIPPED_DIRS = ("__pycache__",)  # besides hidden names: never walked into (see the module docstring)


def _skipped(name: str, is_dir: bool, name_pattern: str | None = None) -> bool:
    """The walker's one rule: a hidden name, or a directory of :data:`SKIPPED_DIRS`, is not taken
    (a hidden file still is when ``name_pattern`` itself starts with ``.``)."""
    if is_dir:
        return name.startswith(".") or name in SKIPPED_DIRS
    return name.startswith(".") and not (name_pattern or "").startswith(".")


def _walk_sorted(root: Path, name_pattern: str | None, visited: set[tuple[int, int]] | None = None,
                 ) -> Iterator[Path]:
    """Files below ``root`` in sorted path order, lazily: a depth-first walk over each
    directory's sorted entries gives exactly the order of ``sorted()`` over the paths, so a
    reader that stops early (``data.max_bytes``) never lists the rest of the tree.

    ``name_pattern`` set: ``root/**/name_pattern`` (links to directories followed, as glob's
    ``**`` does, but each directory walked once, so a link back up the tree ends); None: every
    file below ``root`` (links to directories not followed). :func:`_skipped` names are left out."""
    visited = set() if visited is None else visited
    try:
        st = root.stat()
        if (st.st_dev, st.st_ino) in visited:
            return
        visited.add((st.st_dev, st.st_ino))
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        is_dir = e.is_dir(follow_symlinks=name_pattern is not None)
        if _skipped(e.name, is_dir, name_pattern):
            continue
        if is_dir:
            yield from _walk_sorted(Path(e.path), name_pattern, visited)
        elif e.is_file() and (name_pattern is None or fnmatch.fnmatchcase(e.name, name_pattern)):
            yield Path(e.path)


def _files_of(spec: str, what: str) -> Iterator[Path]:
    """The files one entry names, in sorted order (lazily where it can be)."""
    p = Path(spec).expanduser()
    if p.is_file():
        yield p
        return
    if p.is_dir():
        found = _walk_sorted(p, None)
        empty = f"{what}: the directory {spec!r} holds no files"
    elif any(ch in spec for ch in "*?["):
        base, _, name = str(p).rpartition("/**/")
        if base and not any(ch in base for ch in "*?[") and "/" not in name and Path(base).is_dir():
            found = _walk_sorted(Path(base), name)
        else:  # any other glob: glob's own walk (hidden names skipped for wildcards), then the rule
            literal = set(Path(spec).parts)
            found = iter(sorted(Path(f) for f in glob.glob(str(p), recursive=True) if os.path.isfile(f)
                                and not any(d in Path(f).parts and d not in literal for d in SKIPPED_DIRS)))
        empty = f"{what}: the pattern {spec!r} matches no file"
    else:
        raise DataError(f"{what}: {spec!r} does not exist")
    first = next(found, None)
    if first is None:
        raise DataError(empty)
    yield first
    yield from found


def iter_paths(specs: Sequence[str], what: str = "--input") -> Iterator[Path]:
    """Files named by paths, directories or globs (the rule: the module docstring): resolved, in
    sorted order, each once. Lazy, so a reader that stops early (``data.max_bytes``) lists only
    the start of a large tree; an entry that names nothing raises a DataError starting with
    ``what`` before the first file is yielded."""
    heads = []
    for spec in specs:  # pull each entry's first file now, so bad entries fail up front
        stream = _files_of(spec, what)
        first = next(stream)
        heads.append(itertools.chain([first], stream))
    seen: set[Path] = set()
    for f in heapq.merge(*heads):
        r = f.resolve()
        if r not in seen:
            seen.add(r)
            yield r


def resolve_inputs(specs: Sequence[str], what: str = "--input") -> list[InputFile]:
    """The files of :func:`iter_paths`, in stream order (kind, then path)."""
    if not specs:
        raise DataError(f"{what}: no input given; name files, directories or globs of text, .jsonl or .parquet")
    files = [InputFile(str(f), f.stat().st_size, kind_of(str(f))) for f in iter_paths(specs, what)]
    return sorted(files, key=lambda f: (KINDS.index(f.kind), f.path))


def invalid_utf8_bytes(data: bytes) -> int:
    """How many bytes of ``data`` are not part of valid UTF-8."""
    return len(data) - len(data.decode("utf-8", "ignore").encode("utf-8"))


def binary_reason(data: bytes) -> str | None:
    """Why ``data`` (a file's bytes, or its first ones) is not text, or None when it is text:
    a NUL byte, or more than ``MAX_CONTROL_FRACTION`` control characters (other than whitespace,
    backspace and escape). Bytes that are not UTF-8 (a file in Latin-1 or KOI8-R) do not make a
    file binary: they are replaced by U+FFFD and counted."""
    nul = data.find(b"\x00")
    if nul >= 0:
        return f"binary content (a NUL byte at offset {nul})"
    control = len(data) - len(data.translate(None, CONTROL_BYTES))
    if data and control > MAX_CONTROL_FRACTION * len(data):
        return f"binary content ({control} of {len(data)} bytes are control characters)"
    return None


def decode_text(path: str, data: bytes) -> tuple[str, int]:
    """A text file's bytes → (its text, how many invalid UTF-8 bytes were replaced by U+FFFD).
    Raises DataError naming ``path`` when the bytes are binary."""
    reason = binary_reason(data)
    if reason:
        raise DataError(f"{path}: {reason}; expected UTF-8 text")
    bad = invalid_utf8_bytes(data)
    return data.decode("utf-8", "replace"), bad


def field_text(path: str, value: object, text_field: str) -> str:
    """A structured document's text field: a string, or "" for a missing/null one."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{path}: the {text_field!r} field holds a {type(value).__name__}; expected a string")
    return value


def check_inputs(files: Sequence[InputFile], text_field: str) -> None:
    """What can be checked from the start of each file, before any work starts: text files are
    text, JSON lines hold objects with a string ``text_field``, parquet files have that column."""
    if not files:
        raise DataError("no input files")
    if sum(f.size for f in files) == 0:
        raise DataError(f"the {len(files)} input file(s) are all empty; expected text")
    for f in files:
        if f.kind == PARQUET:
            _check_parquet(f.path, text_field)
            continue
        with open(f.path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
        reason = binary_reason(head)
        if reason:
            what = "UTF-8 text" if f.kind == TEXT else "JSON lines (UTF-8)"
            raise DataError(f"{f.path}: {reason}; expected {what}")
        if f.kind == JSONL:
            _check_first_json_line(f.path, head, text_field)


def _check_first_json_line(path: str, head: bytes, text_field: str) -> None:
    line = next((ln for ln in head.split(b"\n") if ln.strip()), b"")
    if not line:
        return  # empty: no documents
    try:
        obj = json.loads(line)
    except ValueError:
        raise DataError(f"{path}: the first line is not JSON; expected JSON lines "
                        f"(one object per line with a {text_field!r} string)") from None
    if not isinstance(obj, dict) or text_field not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{path}: the first line has no {text_field!r} field (it has {keys}); "
                        "pass the text field's name with --text-field")


def _check_parquet(path: str, text_field: str) -> None:
    import pyarrow.parquet as pq

    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"PAR1":
        raise DataError(f"{path}: not a parquet file (no PAR1 header); expected .parquet")
    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for damaged files
        raise DataError(f"{path}: cannot read the parquet schema ({exc}); the file may be truncated") from None
    if text_field not in schema.names:
        raise DataError(f"{path}: no {text_field!r} column (it has {schema.names}); "
                        "pass the text column's name with --text-field")


def iter_documents(files: Sequence[InputFile], text_field: str = "text") -> Iterator[tuple[str, str]]:
    """(path, text) of every non-empty document, in stream order, read in this process (for
    tokenizer training and the single-process benchmark; ``prepare`` reads through Ray Data)."""
    for f in files:
        if f.kind == TEXT:
            text, _ = decode_text(f.path, Path(f.path).read_bytes())
            if text:
                yield f.path, text
        elif f.kind == JSONL:
            with open(f.path, encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        text = field_text(f.path, json.loads(line).get(text_field), text_field)
                        if text:
                            yield f.path, text
        else:
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(f.path).iter_batches(columns=[text_field]):
                for value in batch.column(0).to_pylist():
                    text = field_text(f.path, value, text_field)
                    if text:
                        yield f.path, text
