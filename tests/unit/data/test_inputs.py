"""Inputs: which files, in which order, text or binary, and their documents."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_moe.data.errors import DataError
from ray_moe.data.inputs import (
    binary_reason,
    check_inputs,
    iter_documents,
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
