"""The shard writer: fixed-size shards that are exactly the document stream, split by document,
the same bytes however the stream is batched or interrupted, and nothing written for nothing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ray_moe.data.errors import DataError
from ray_moe.data.shards import INDEX_FILE, LOCK_FILE, META_FILE, val_mask
from ray_moe.data.writer import ShardWriter
from tests.unit.data.shard_helpers import feed, make_plan, random_files, write_dataset


def _split_stream(files, split, val_fraction=0.25, eos=0):
    docs = [d for f in files for d in f]
    is_val = val_mask(np.arange(len(docs)), val_fraction)
    want = [np.append(d, np.uint32(eos)) for d, v in zip(docs, is_val) if len(d) and v == (split == "val")]
    return np.concatenate(want) if want else np.zeros(0, np.uint32)


def _read_split(out, split):
    files = sorted(out.glob(f"{split}-*.bin"))
    return [np.fromfile(f, dtype="<u2") for f in files]


@pytest.mark.parametrize("seed", [0, 1])
def test_shards_are_the_document_stream_cut_at_fixed_size(tmp_path, seed):
    rng = np.random.default_rng(seed)
    files = random_files(rng, 12)
    meta = write_dataset(tmp_path / "ds", files, shard_tokens=50)
    for split in ("train", "val"):
        shards = _read_split(tmp_path / "ds", split)
        assert all(len(s) == 50 for s in shards[:-1]) and 0 < len(shards[-1]) <= 50
        np.testing.assert_array_equal(np.concatenate(shards), _split_stream(files, split))
        assert meta["splits"][split]["tokens"] == sum(len(s) for s in shards)
    docs = [d for f in files for d in f]
    assert meta["documents"] == sum(1 for d in docs if len(d))
    assert not list((tmp_path / "ds").glob("*.partial"))
    index = json.loads((tmp_path / "ds" / INDEX_FILE).read_text())
    assert index["complete"] and {s["max_id"] for s in index["shards"]} <= set(range(1000))


def test_val_mask_takes_an_exact_evenly_spread_fraction():
    mask = val_mask(np.arange(1000), 0.05)
    assert mask.sum() == 50 and np.flatnonzero(mask)[:3].tolist() == [19, 39, 59]
    assert not val_mask(np.arange(100), 0.0).any()


def test_batching_does_not_change_the_bytes(tmp_path):
    files = random_files(np.random.default_rng(2), 10)
    for name, batch in (("a", 1), ("b", 7)):
        writer = ShardWriter(tmp_path / name, make_plan(10))
        feed(writer, files, batch=batch)
        writer.finish()
    for f in sorted((tmp_path / "a").iterdir()):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


@pytest.mark.parametrize("stop_after_docs", [1, 20])
def test_an_interrupted_run_resumes_to_the_same_bytes(tmp_path, stop_after_docs):
    files = random_files(np.random.default_rng(3), 12)
    write_dataset(tmp_path / "whole", files, shard_tokens=100)

    out = tmp_path / "resumed"
    writer = ShardWriter(out, make_plan(12, shard_tokens=100))
    feed(writer, files, stop_after_docs=stop_after_docs)
    del writer  # the process dies here: no close, no finish (its lock goes with it)
    for f in out.glob("*.bin"):  # only whole shards carry a shard name
        assert f.stat().st_size == 100 * 2, f.name
    assert not (out / META_FILE).exists()

    again = ShardWriter(out, make_plan(12, shard_tokens=100))
    assert not again.complete
    point = again.resume()
    assert point.first_doc == sum(len(f) for f in files[: point.skip_files])
    feed(again, files, first_file=point.skip_files, first_doc=point.first_doc)
    again.finish()
    whole = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert sorted(p.name for p in out.iterdir()) == whole
    for name in whole:
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert ShardWriter(out, make_plan(12, shard_tokens=100)).complete  # a third run has nothing to do


def test_resume_skips_the_files_already_written(tmp_path):
    files = [[np.arange(1, 30, dtype=np.uint32)] * 2 for _ in range(10)]  # 60 tokens per file
    writer = ShardWriter(tmp_path, make_plan(10, shard_tokens=100, val_fraction=0.0))
    feed(writer, files, stop_after_docs=14)
    del writer  # the process dies
    point = ShardWriter(tmp_path, make_plan(10, shard_tokens=100, val_fraction=0.0)).resume()
    assert point.skip_files >= 4 and point.first_doc == 2 * point.skip_files


def test_other_directories_are_refused_and_left_alone(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a prepared dataset"):
        ShardWriter(tmp_path / "mine", make_plan(3))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"

    write_dataset(tmp_path / "ds", random_files(np.random.default_rng(4), 3))
    with pytest.raises(DataError, match=r"plan\.shard_tokens: 50 there, 64 now"):
        ShardWriter(tmp_path / "ds", make_plan(3, shard_tokens=64))


def test_no_text_writes_nothing(tmp_path):
    writer = ShardWriter(tmp_path / "out", make_plan(2))
    feed(writer, [[np.zeros(0, np.uint32)] * 3, []])
    with pytest.raises(DataError, match="hold no text"):
        writer.finish()
    assert not (tmp_path / "out").exists()


def test_discard_removes_only_what_this_run_created(tmp_path):
    files = random_files(np.random.default_rng(5), 6)
    writer = ShardWriter(tmp_path / "new", make_plan(6, shard_tokens=30))
    feed(writer, files, stop_after_docs=8)
    writer.discard()
    assert not (tmp_path / "new").exists()

    writer = ShardWriter(tmp_path / "old", make_plan(6, shard_tokens=30))
    feed(writer, files, stop_after_docs=8)
    writer.close()
    kept = sorted(p.name for p in (tmp_path / "old").iterdir())
    again = ShardWriter(tmp_path / "old", make_plan(6, shard_tokens=30))
    again.resume()
    again.discard()  # an earlier run's directory: kept
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == kept


def _snapshot(path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_a_second_prepare_into_the_same_directory_is_refused(tmp_path):
    files = random_files(np.random.default_rng(6), 8)
    write_dataset(tmp_path / "whole", files, shard_tokens=40)
    out = tmp_path / "ds"
    late = ShardWriter(out, make_plan(8, shard_tokens=40))  # looked before the first run made anything
    first = ShardWriter(out, make_plan(8, shard_tokens=40))
    feed(first, files, stop_after_docs=10)
    first.checkpoint()
    before = _snapshot(out)
    assert f"pid {os.getpid()}" in (out / LOCK_FILE).read_text()
    with pytest.raises(DataError, match=rf"being written by another prepare \(pid {os.getpid()} on .*nothing was changed"):
        ShardWriter(out, make_plan(8, shard_tokens=40))  # a rerun while it runs
    with pytest.raises(DataError, match="being written by another prepare"):
        feed(late, files)  # a run that started beside it
    late.discard()
    assert _snapshot(out) == before

    first.close()  # interrupted: the lock is released, and the rerun resumes
    again = ShardWriter(out, make_plan(8, shard_tokens=40))
    point = again.resume()
    feed(again, files, first_file=point.skip_files, first_doc=point.first_doc)
    again.finish()
    whole = _snapshot(tmp_path / "whole")
    assert _snapshot(out) == whole  # the same bytes as one uninterrupted run (both lock files name this process)


def test_a_run_that_looked_before_another_finished_is_refused(tmp_path):
    files = random_files(np.random.default_rng(7), 5)
    late = ShardWriter(tmp_path / "ds", make_plan(5))
    write_dataset(tmp_path / "ds", files)
    before = _snapshot(tmp_path / "ds")
    with pytest.raises(DataError, match="started by another prepare after this one began"):
        feed(late, files)
    late.discard()
    assert _snapshot(tmp_path / "ds") == before
    assert ShardWriter(tmp_path / "ds", make_plan(5)).complete


def test_a_run_refused_in_a_directory_it_made_keeps_the_winners_files(tmp_path, monkeypatch):
    """B makes the directory, A locks it before B does: B is refused and its discard removes
    nothing of A's; A finishes the same bytes as an uninterrupted run."""
    files = random_files(np.random.default_rng(8), 6)
    write_dataset(tmp_path / "whole", files, shard_tokens=40)
    out = tmp_path / "ds"
    a = ShardWriter(out, make_plan(6, shard_tokens=40))
    b = ShardWriter(out, make_plan(6, shard_tokens=40))
    take = ShardWriter._take_lock

    def a_first(self):
        if self is b:
            feed(a, files, stop_after_docs=5)  # A's first write: it finds B's directory and locks it
        take(self)

    monkeypatch.setattr(ShardWriter, "_take_lock", a_first)
    with pytest.raises(DataError, match="being written by another prepare"):
        feed(b, files)
    monkeypatch.undo()
    b.discard()
    assert (out / INDEX_FILE).exists()  # A's index survived B's discard
    a.close()  # A is interrupted here; its rerun resumes from what it wrote
    again = ShardWriter(out, make_plan(6, shard_tokens=40))
    point = again.resume()
    feed(again, files, first_file=point.skip_files, first_doc=point.first_doc)
    again.finish()
    assert _snapshot(out) == _snapshot(tmp_path / "whole")


def test_a_stale_lock_file_is_taken_over_and_confirming_takes_no_lock(tmp_path):
    files = random_files(np.random.default_rng(9), 4)
    out = tmp_path / "ds"
    out.mkdir()
    (out / LOCK_FILE).write_text("pid 1 on gone\n")  # a run killed between its lock and its index
    write_dataset(out, files)
    older = tmp_path / "older"
    write_dataset(older, files)
    (older / LOCK_FILE).unlink()  # a dataset finished before datasets carried a lock file
    before = _snapshot(older)
    assert ShardWriter(older, make_plan(4)).complete
    assert _snapshot(older) == before


def test_a_file_system_without_locks_is_written_with_a_warning(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    files = random_files(np.random.default_rng(10), 3)
    with caplog.at_level("WARNING"):
        write_dataset(tmp_path / "ds", files)
    assert "does not support file locks" in caplog.text
    assert (tmp_path / "ds" / META_FILE).exists()


def test_a_refused_rerun_leaves_the_lock_free(tmp_path):
    files = random_files(np.random.default_rng(11), 3)
    writer = ShardWriter(tmp_path / "ds", make_plan(3))
    feed(writer, files, stop_after_docs=4)
    writer.close()
    with pytest.raises(DataError, match="other settings") as refused:
        ShardWriter(tmp_path / "ds", make_plan(3, shard_tokens=64))
    again = ShardWriter(tmp_path / "ds", make_plan(3))  # while the refusal's traceback is still alive
    assert refused.value is not None and not again.complete
    again.close()


def test_a_lock_file_that_cannot_be_locked_is_one_line_naming_it(tmp_path, monkeypatch):
    import errno
    import fcntl

    def refused(fd, op):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", refused)
    (tmp_path / "ds").mkdir()  # a run that started here: its lock is taken before anything is read
    (tmp_path / "ds" / LOCK_FILE).write_text("")
    with pytest.raises(DataError, match=rf"{LOCK_FILE} cannot be locked: Bad file descriptor; prepare must"):
        ShardWriter(tmp_path / "ds", make_plan(3))
