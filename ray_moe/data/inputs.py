"""Input files: which files a list of paths, directories and globs names, what kind each is,
whether it is text, and its documents.

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

import glob
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


def resolve_inputs(specs: Sequence[str], what: str = "--input") -> list[InputFile]:
    """Files named by paths, directories (every file below, hidden ones skipped) or globs
    (``**`` recursive), deduplicated, in stream order (kind, then path)."""
    if not specs:
        raise DataError(f"{what}: no input given; name files, directories or globs of text, .jsonl or .parquet")
    found: set[str] = set()
    for spec in specs:
        p = Path(spec).expanduser()
        if p.is_file():
            found.add(str(p.resolve()))
        elif p.is_dir():
            below = [f for f in p.rglob("*") if f.is_file()
                     and not any(part.startswith(".") for part in f.relative_to(p).parts)]
            if not below:
                raise DataError(f"{what}: the directory {spec!r} holds no files")
            found.update(str(f.resolve()) for f in below)
        elif any(ch in spec for ch in "*?["):
            matched = [f for f in glob.glob(str(p), recursive=True) if os.path.isfile(f)]
            if not matched:
                raise DataError(f"{what}: the pattern {spec!r} matches no file")
            found.update(str(Path(f).resolve()) for f in matched)
        else:
            raise DataError(f"{what}: {spec!r} does not exist")
    files = [InputFile(f, os.path.getsize(f), kind_of(f)) for f in found]
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
