"""``ray-moe prepare``: tokenize text into a prepared dataset with Ray Data.

    prepare(["corpus/**/*.jsonl"], tokenizer="tok/", out="data/corpus", address="auto")

The pipeline, per input kind in stream order (text, then JSON lines, then parquet)::

    read_binary_files | read_json | read_parquet   (Ray Data's readers, on the cluster)
      → map_batches(Tokenize)                       (an actor pool: the tokenizer is built once per
                                                     actor, each batch encoded with encode_batch)
      → the driver, in input order                  (ShardWriter: + EOS, val split, fixed-size shards)

Tokenizing (the CPU-heavy part) runs in the Ray workers; the driver only appends ids to the
shard files, so the output directory need only be reachable from the driver, while the inputs
must be readable on every node (a shared file system, or one node). Before any work starts the
driver checks every input (text or binary, the JSON/parquet text field), the tokenizer, and the
output directory (a directory of another plan or of other files is refused). Rerunning the same
command resumes an interrupted run, skipping the input files whose tokens are already durable,
and leaves a finished one as it is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ray_moe.data.errors import DataError
from ray_moe.data.inputs import (
    JSONL,
    KINDS,
    PARQUET,
    TEXT,
    InputFile,
    check_inputs,
    decode_text,
    field_text,
    resolve_inputs,
)
from ray_moe.data.shards import DEFAULT_SHARD_TOKENS, FORMAT, token_dtype
from ray_moe.data.tokenizer import TextTokenizer, encode_documents, load_for_documents
from ray_moe.data.writer import ShardWriter

log = logging.getLogger(__name__)

DOCS_PER_BATCH = MappingProxyType({TEXT: 32, JSONL: 512, PARQUET: 512})  # rows per map_batches call, at most
BLOCK_BYTES = 16 << 20  # Ray Data block size: a large JSON/parquet file is read as several blocks


class PrepareError(RuntimeError):
    """The preparation job cannot run (no cluster, workers stalled); the message says why."""


@dataclass
class PrepareReport:
    out: str
    tokens: int  # tokens written by this run (EOS included)
    documents: int  # documents read by this run (empty ones included)
    seconds: float  # the pipeline's wall time in this run
    first_output_s: float  # of which before the first tokens came back (actor start-up, first batch)
    first_output_tokens: int  # the tokens of that first batch
    workers: int
    skipped_files: int  # input files not read again (resumed run)
    up_to_date: bool  # the dataset was already complete
    meta: dict = field(default_factory=dict)
    invalid_utf8: dict = field(default_factory=dict)  # path → bytes replaced by U+FFFD

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def prepare(
    inputs: Sequence[str],
    tokenizer: str,
    out: str,
    *,
    address: str | None = None,
    workers: int | None = None,
    cpus_per_worker: float = 1.0,
    text_field: str = "text",
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool | None = None,
    stall_timeout_s: float = 600.0,
) -> PrepareReport:
    """Prepare (or resume, or confirm) the dataset ``out`` from ``inputs`` (files, directories,
    globs) with the tokenizer directory ``tokenizer``.

    ``workers`` tokenizer actors of ``cpus_per_worker`` CPUs each (default: as many as the
    cluster's CPUs hold); ``val_fraction`` of the documents go to the validation split;
    ``progress``: tokens and tokens/s (a bar on a terminal, else a line every 10 s; False: none).
    ``stall_timeout_s``: give up when the workers deliver nothing for that long.

    Raises DataError naming bad input: before anything is written for what the driver can see
    (paths, the first 64 KiB of each file, the tokenizer, the output directory); for what only
    the workers see (binary content further in, a later row without text), removing what this
    run wrote. Raises PrepareError when the job cannot run. Documents are encoded with special
    tokens in their text taken as plain text: EOS only ever separates documents.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if shard_tokens <= 0:
        raise DataError(f"--shard-tokens {shard_tokens}: must be > 0")
    if workers is not None and workers <= 0:
        raise DataError(f"--workers {workers}: must be > 0")
    if not cpus_per_worker > 0:
        raise DataError(f"--cpus-per-worker {cpus_per_worker}: must be > 0")
    if not text_field:
        raise DataError("--text-field must name the field or column holding the text")
    files = resolve_inputs(inputs)
    check_inputs(files, text_field)
    tok = TextTokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    plan = {
        "format": FORMAT, "dtype": dtype.str, "shard_tokens": shard_tokens, "val_fraction": val_fraction,
        "eos_id": tok.eos_id, "text_field": text_field,
        "tokenizer": {k: v for k, v in tok.describe().items() if k != "directory"},
        "inputs": [f.to_dict() for f in files],
    }
    writer = ShardWriter(out, plan)
    if writer.complete:
        return PrepareReport(out=str(writer.out), tokens=0, documents=0, seconds=0.0, first_output_s=0.0,
                             first_output_tokens=0, workers=0, skipped_files=len(files), up_to_date=True,
                             meta=writer.finish())
    try:  # the writer may hold the directory's lock already (a run to resume): never past a failure
        start = writer.resume()
        started_ray = _connect(address)
    except BaseException:
        writer.close()
        raise
    todo = files[start.skip_files:]
    try:
        import ray

        n_workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1) // cpus_per_worker))
        stream = _Stream(writer, files, start.skip_files, start.first_doc)
        bar = _Progress(sum(f.size for f in files), sum(f.size for f in files[:start.skip_files]), progress)
        t0, first_output, first_tokens = time.perf_counter(), 0.0, 0
        try:
            for kind in KINDS:
                group = [f for f in todo if f.kind == kind]
                if group:
                    ds = _dataset(kind, group, tok, text_field, n_workers, cpus_per_worker)
                    with _ray_data_quiet():
                        try:
                            for batch in _batches(ds, stall_timeout_s):
                                first_output = first_output or time.perf_counter() - t0
                                tokens = stream.add(batch)
                                first_tokens = first_tokens or tokens
                                bar.update(tokens, stream.bytes_done)
                        except Exception as exc:  # Ray Data's reader failed: a bad row it does not name?
                            bad = None if isinstance(exc, (DataError, PrepareError)) else bad_row(kind, group)
                            if bad is not None:
                                raise DataError(bad) from None
                            lost = _cluster_failure(exc)
                            if lost:
                                raise PrepareError(lost) from None
                            raise
            stream.end()
            bar.update(0, stream.bytes_done)
            meta = writer.finish()
        except DataError:
            writer.discard()  # bad input: what this run wrote cannot be resumed with other inputs
            raise
        except BaseException:
            writer.close()  # interrupted: the same command resumes from here
            raise
        finally:
            bar.close()
        seconds = time.perf_counter() - t0
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    for path, n in stream.invalid.items():
        log.warning("%s: %d bytes are not UTF-8; they were replaced by U+FFFD", path, n)
    if meta["splits"]["val"]["tokens"] == 0 and val_fraction > 0:
        log.warning("the validation split is empty (%d documents at --val-fraction %g); training on this "
                    "dataset cannot evaluate", meta["documents"], val_fraction)
    return PrepareReport(out=str(writer.out), tokens=stream.tokens, documents=stream.doc - start.first_doc,
                         seconds=seconds, first_output_s=first_output, first_output_tokens=first_tokens,
                         workers=n_workers, skipped_files=start.skip_files, up_to_date=False, meta=meta,
                         invalid_utf8=dict(stream.invalid))


def bad_row(kind: str, files: Sequence[InputFile]) -> str | None:
    """The first malformed row of ``files`` as "PATH:LINE: what is wrong; what is expected" (JSON
    lines: a line that is not one JSON object), or None when none is found. Read on the driver
    only after Ray Data's reader failed, whose error names neither the file nor the line."""
    if kind != JSONL:
        return None
    for f in files:
        with open(f.path, "rb") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                    # JSONDecodeError's msg ends before its position ("Invalid control character at")
                    why = f"{exc.msg} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
                    return f"{f.path}:{n}: not valid JSON ({why}); each line of a .jsonl file must be one JSON object"
                if not isinstance(obj, dict):
                    return (f"{f.path}:{n}: a JSON {type(obj).__name__}, not an object; each line of a .jsonl file "
                            "must be one JSON object")
    return None


@contextlib.contextmanager
def _ray_data_quiet() -> Iterator[None]:
    """Ray Data logs a failed execution's traceback (hundreds of lines) before raising it; the
    exception is raised here either way, named (:func:`bad_row`) where it can be."""
    logger = logging.getLogger("ray.data")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# ============================================================================ the Ray side
class Tokenize:
    """Ray Data ``map_batches`` class: a batch of rows → (path, ids list<shard dtype>, invalid, error).

    Built once per actor: the tokenizer comes as ``tokenizer.json`` text (no shared file system
    needed for it), and its Rust thread pool is sized to the actor's CPUs. Bad input comes back
    as data (``error``: the DataError's message, per row), so the driver raises it as itself.
    """

    def __init__(self, tokenizer_json: str, kind: str, text_field: str, threads: int, dtype: str):
        os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the pool first starts
        self.tokenizer = load_for_documents(tokenizer_json)
        self.kind, self.text_field, self.dtype = kind, text_field, np.dtype(dtype)

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        paths = batch.column("path").to_pylist()
        invalid, errors, texts = [0] * len(paths), [None] * len(paths), [""] * len(paths)
        if self.kind == TEXT:
            values = batch.column("bytes").to_pylist()
        elif self.text_field in batch.column_names:
            values = batch.column(self.text_field).to_pylist()
        else:
            values = [None] * len(paths)
            errors[0] = (f"{paths[0]}: no {self.text_field!r} field (it has "
                         f"{[c for c in batch.column_names if c != 'path']}); pass it with --text-field")
        for i, (path, value) in enumerate(zip(paths, values)):
            try:
                if self.kind == TEXT:
                    texts[i], invalid[i] = decode_text(path, value)
                else:
                    texts[i] = field_text(path, value, self.text_field)
            except DataError as exc:
                errors[i] = str(exc)
        ids, lengths = encode_documents(self.tokenizer, texts)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return pa.table({
            "path": pa.array(paths, pa.string()),
            "ids": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(ids.astype(self.dtype))),  # shard dtype
            "invalid": pa.array(invalid, pa.int64()),
            "error": pa.array(errors, pa.string()),
        })


def _dataset(kind: str, files: list[InputFile], tok: TextTokenizer, text_field: str, workers: int,
             cpus_per_worker: float) -> Any:
    import ray.data

    paths = [f.path for f in files]
    # Reading is I/O: its tasks take no CPU slot (the CPUs go to the tokenizers), and at most one
    # runs per tokenizer at a time (each new task may start a worker process).
    read_args = {"include_paths": True, "num_cpus": 0, "concurrency": max(1, min(len(files), workers))}
    if kind == TEXT:
        ds = ray.data.read_binary_files(paths, **read_args)
    elif kind == JSONL:
        ds = ray.data.read_json(paths, lines=True, file_extensions=None, **read_args)
    else:
        ds = ray.data.read_parquet(paths, columns=[text_field], **read_args)
    ctx = ds.context
    ctx.execution_options.preserve_order = True  # the document stream's order is the inputs' order
    ctx.enable_progress_bars = False  # ours shows tokens/s; Ray's would print per operator
    from ray.util.debug import log_once

    log_once("ray_data_progress_manager_disabled")  # Ray's "progress bars disabled" notice: not for our users
    ctx.print_on_execution_start = False
    ctx.enable_auto_log_stats = False
    ctx.target_max_block_size = BLOCK_BYTES
    # Few text files: small batches, so that every worker gets some.
    rows = DOCS_PER_BATCH[kind] if kind != TEXT else max(1, min(DOCS_PER_BATCH[kind], len(files) // (4 * workers)))
    return ds.map_batches(
        Tokenize, fn_constructor_args=(tok.to_json(), kind, text_field, max(1, int(cpus_per_worker)),
                                       token_dtype(tok.vocab_size).str),
        compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=cpus_per_worker,
        batch_format="pyarrow", batch_size=rows, zero_copy_batch=True,
    )


def _batches(ds: Any, stall_timeout_s: float) -> Iterator[Any]:
    """The dataset's output tables in order; PrepareError when none arrives for
    ``stall_timeout_s``."""
    q: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            for table in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                while not stop.is_set():
                    try:
                        q.put(table, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return  # leaving the loop closes the iterator, which stops the execution
            q.put(end)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            q.put(exc)

    thread = threading.Thread(target=produce, name="prepare-reader", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = q.get(timeout=stall_timeout_s)
            except queue.Empty:
                raise PrepareError(f"the Ray workers delivered no tokens for {stall_timeout_s:g} s; is the cluster "
                                   "short of CPUs or memory? (--stall-timeout-s)") from None
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # the reader stops at its next table; one stuck in Ray is left behind (a daemon)
        deadline = time.monotonic() + 30
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
            thread.join(timeout=0.1)


def _cluster_failure(exc: BaseException) -> str | None:
    """One line for a failure of the Ray cluster under the job (a worker or node lost, e.g. a
    cluster stopped while the job ran), which the same command resumes from; None for other
    errors (a bug shows its traceback)."""
    import ray.exceptions

    lost = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError, ray.exceptions.WorkerCrashedError,
            ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError, ray.exceptions.RaySystemError)
    if not isinstance(exc, lost):
        return None
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return (f"the Ray cluster failed under the job ({type(exc).__name__}: {first}); the shards written so "
            "far are kept, and the same command resumes from them")


def _connect(address: str | None) -> bool:
    """Attach to the cluster at ``address`` (or RAY_ADDRESS), or start a local one, the address
    and token checked first (:mod:`ray_moe.connect`); True when this call started Ray (and should
    shut it down)."""
    from ray_moe.connect import ConnectError, connect

    local = {} if (address or os.environ.get("RAY_ADDRESS")) else {"include_dashboard": False}
    try:
        return connect(address, log_to_driver=False, logging_level=logging.WARNING, **local)
    except ConnectError as exc:
        raise PrepareError(str(exc)) from None


# ============================================================================ the driver side
class _Stream:
    """Output tables, in input order → the writer, with per-file document counts."""

    def __init__(self, writer: ShardWriter, files: list[InputFile], next_file: int, first_doc: int):
        self.writer, self.files = writer, files
        self.position = {f.path: i for i, f in enumerate(files)}
        self.file = next_file  # the input being read now (stream order)
        self.rows = 0  # its rows so far
        self.doc = first_doc
        self.tokens = 0
        self.bytes_done = sum(f.size for f in files[:next_file])
        self.invalid: dict[str, int] = {}

    def add(self, table: Any) -> int:
        """One output table; returns the tokens it carried (EOS included)."""
        errors = table.column("error")
        if errors.null_count < len(errors):
            raise DataError(next(e for e in errors.to_pylist() if e is not None))
        paths = table.column("path").to_pylist()
        ids = table.column("ids").combine_chunks()
        offsets = np.asarray(ids.offsets)
        lengths = np.diff(offsets)
        values = ids.values.to_numpy(zero_copy_only=False)[offsets[0]: offsets[-1]]
        for path, n in zip(paths, table.column("invalid").to_pylist()):
            if n:
                self.invalid[path] = self.invalid.get(path, 0) + n
        self._advance(paths)
        self.writer.add(self.doc, values, lengths)
        self.doc += len(lengths)
        tokens = int(lengths.sum() + (lengths > 0).sum())
        self.tokens += tokens
        return tokens

    def _advance(self, paths: list[str]) -> None:
        for path in paths:
            i = self.position.get(path)
            if i is None:
                i = self.position.get(str(Path(path).resolve()))
            if i is None or i < self.file:
                raise RuntimeError(f"prepare: a row of {path} arrived out of input order")
            while self.file < i:
                self._file_done()
            self.rows += 1

    def _file_done(self) -> None:
        f = self.files[self.file]
        self.writer.file_done(f.path, self.rows)
        self.bytes_done += f.size
        self.file += 1
        self.rows = 0

    def end(self) -> None:
        while self.file < len(self.files):
            self._file_done()


class _Progress:
    """Tokens and tokens/s: a tqdm bar on a terminal, else a plain line every 10 s."""

    def __init__(self, total_bytes: int, done_bytes: int, enabled: bool | None):
        self.enabled = enabled is not False
        self.total_bytes = total_bytes
        self.tokens, self.t0, self.last = 0, time.monotonic(), time.monotonic()
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc="prepare", unit="tok", unit_scale=True, dynamic_ncols=True)
        self.done_bytes = done_bytes

    def update(self, tokens: int, done_bytes: int) -> None:
        self.tokens += tokens
        self.done_bytes = done_bytes
        if self.bar is not None:
            self.bar.update(tokens)
            self.bar.set_postfix_str(f"inputs {100 * done_bytes / max(1, self.total_bytes):.0f}%", refresh=False)
        elif self.enabled and time.monotonic() - self.last >= 10:
            self.last = time.monotonic()
            self._line()

    def _line(self) -> None:
        dt = max(1e-9, time.monotonic() - self.t0)
        print(f"prepare: {self.tokens:,} tokens, {self.tokens / dt:,.0f} tokens/s, "
              f"inputs {100 * self.done_bytes / max(1, self.total_bytes):.0f}% done", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self._line()
