"""Inputs: which files, in which order, text or binary, and their documents."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_moe.data.errors import DataError
from ray_moe.data.inputs import (
    binary_reason,
    check_inputs,
    iter_documents,
    iter_paths,
    resolve_inputs,
)


def test_inputs_resolve_in_stream_order(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": null}\n{"text": "two"}\n')
    pq.write_table(pa.table({"text": ["three", None, "four"]}), tmp_path / "c.parquet")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("skipped")
    files = resolve_inputs([str(tmp_path), str(tmp_path / "*.txt")])
    assert [(os.path.basename(f.path), f.kind) for f in files] == [
        ("b.txt", "text"), ("a.jsonl", "jsonl"), ("c.parquet", "parquet")]
    check_inputs(files, "text")
    assert [t for _, t in iter_documents(files)] == ["bee", "one", "two", "three", "four"]


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        resolve_inputs([str(tmp_path / "nope.txt")])
    with pytest.raises(DataError, match="matches no file"):
        resolve_inputs([str(tmp_path / "*.jsonl")])
    with pytest.raises(DataError, match="holds no files"):
        resolve_inputs([str(tmp_path)])
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="all empty"):
        check_inputs(resolve_inputs([str(tmp_path)]), "text")


def test_binary_content_is_told_from_text():
    rng = np.random.default_rng(0)
    assert binary_reason("plain text, ünïcode ✓\n".encode()) is None
    assert binary_reason("caf\xe9 au lait\n".encode("latin-1")) is None  # a few bad bytes: text, replaced
    assert binary_reason("# -*- coding: latin-1 -*-\nu'\xe4\xf6\xfc\xdf\xe9\xe8'\n".encode("latin-1")) is None
    assert "NUL byte at offset 3" in binary_reason(b"ELF\x00\x01")
    assert "control characters" in binary_reason(bytes(rng.integers(1, 256, 4000, dtype=np.uint8)))  # no NUL
    assert binary_reason(bytes(rng.integers(128, 256, 4000, dtype=np.uint8))) is None  # not UTF-8: replaced


def test_structured_inputs_without_the_text_field_are_named(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"a.jsonl: the first line has no 'text' field \(it has \['body'\]\)"):
        check_inputs(resolve_inputs([str(tmp_path / "a.jsonl")]), "text")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet: no 'text' column"):
        check_inputs(resolve_inputs([str(tmp_path / "b.parquet")]), "text")
    (tmp_path / "c.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="c.parquet: not a parquet file"):
        check_inputs(resolve_inputs([str(tmp_path / "c.parquet")]), "text")


def _tree(root: Path) -> None:
    for rel in ("b.py", "a/z.py", "a/b/c.py", "a-b/x.py", "a/.hidden/h.py", ".top.py", "a/notes.txt", "A/up.py",
                "a/__pycache__/z.cpython-311.pyc", "a/__pycache__/odd.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)


def _kept(root: Path, p: Path) -> bool:
    """The walker's rule, written out: no hidden name and no __pycache__ below ``root``."""
    return not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts)


def test_files_come_lazily_in_the_order_sorted_paths_give(tmp_path):
    """The lazy walk (``root/**/pattern`` and directories) yields what glob / rglob and sorted()
    give, less hidden names and __pycache__, each file once across overlapping entries; a link
    back up the tree ends (glob's ``**`` follows links to directories, rglob does not)."""
    _tree(tmp_path)
    os.symlink(tmp_path, tmp_path / "a" / "loop")  # a cycle: must not recurse forever
    pattern = f"{tmp_path}/**/*.py"
    want = sorted(Path(f).resolve() for f in glob.glob(pattern, recursive=True)
                  if os.path.isfile(f) and "/loop/" not in f and _kept(tmp_path, Path(f)))
    assert tmp_path / "a" / "__pycache__" / "odd.py" not in want and tmp_path / "a" / "z.py" in want
    assert list(iter_paths([pattern])) == want
    every = sorted({p.resolve() for p in tmp_path.rglob("*") if p.is_file() and _kept(tmp_path, p)})
    assert tmp_path / "A" / "up.py" in every and tmp_path / ".top.py" not in every
    assert list(iter_paths([str(tmp_path)])) == every
    assert list(iter_paths([str(tmp_path / "a"), pattern, str(tmp_path / "b.py")])) == sorted(set(want) | {
        p.resolve() for p in (tmp_path / "a").rglob("*") if p.is_file() and _kept(tmp_path, p)})
    assert list(iter_paths([f"{tmp_path}/**/.*.py"])) == [tmp_path / ".top.py"]  # asked for by name
    files = iter_paths([pattern])
    assert next(files) == want[0]  # lazily: the rest of the tree is not listed yet


def test_a_missing_entry_fails_before_any_file_is_read(tmp_path):
    _tree(tmp_path)
    with pytest.raises(DataError, match="data.paths: .*missing.txt' does not exist"):
        next(iter_paths([str(tmp_path / "b.py"), str(tmp_path / "missing.txt")], "data.paths"))
    with pytest.raises(DataError, match="matches no file"):
        next(iter_paths([str(tmp_path / "b.py"), f"{tmp_path}/**/*.rst"]))
    (tmp_path / "only_hidden").mkdir()
    (tmp_path / "only_hidden" / ".x").write_text("x")
    with pytest.raises(DataError, match="holds no files"):
        next(iter_paths([str(tmp_path / "only_hidden")]))
