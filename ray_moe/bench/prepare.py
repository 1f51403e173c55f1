"""``ray-moe bench prepare``: ``ray-moe prepare`` tokens/s against one Python process.

In one run, on the same files and the same tokenizer:

* **one process, default threads**: read every file, decode it, ``encode_batch`` (the tokenizers
  library spreads a batch over all cores with its Rust thread pool), ids into numpy;
* **one process, one thread**: the same with ``RAYON_NUM_THREADS=1``;
* **ray-moe prepare**: the Ray Data job with ``--workers`` tokenizer actors (one CPU each),
  writing the shards (wall time of the job, actor start-up included; the Ray cluster is already
  running, as it is for a real job).

The baselines run in fresh subprocesses (the thread pool's size is fixed when it first starts).
Every variant must produce the same number of tokens, or the benchmark fails. Files are read
once before timing so every variant finds them in the page cache.

    ray-moe bench prepare --max-mb 40 --workers 2                    # this machine
    ray-moe bench prepare --address HEAD:6379 --workers 64 --input '/shared/corpus/*.jsonl' \\
        --tokenizer /shared/tok --baseline-mb 200                    # a multi-node cluster
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray_moe import usage
from ray_moe.data.inputs import InputFile, iter_documents, resolve_inputs
from ray_moe.data.tokenizer import TextTokenizer, train_bpe


def pick_files(specs: Sequence[str], max_bytes: int) -> list[InputFile]:
    """The inputs in stream order, cut after ``max_bytes`` (0 = all)."""
    chosen, total = [], 0
    for f in resolve_inputs(specs):
        if max_bytes and total >= max_bytes:
            break
        chosen.append(f)
        total += f.size
    return chosen


def single_process(files: Sequence[InputFile], tokenizer_dir: str, text_field: str,
                   batch_docs: int = 1024) -> dict[str, Any]:
    """Tokenize ``files`` here with ``encode_batch``; tokens count one EOS per document, as in
    prepare."""
    tok = TextTokenizer(tokenizer_dir)
    t0 = time.perf_counter()
    tokens = docs = 0
    batch: list[str] = []
    for _, text in iter_documents(files, text_field):
        batch.append(text)
        if len(batch) == batch_docs:
            ids, lengths = tok.encode_documents(batch)
            tokens, docs, batch = tokens + len(ids) + len(lengths), docs + len(lengths), []
    if batch:
        ids, lengths = tok.encode_documents(batch)
        tokens, docs = tokens + len(ids) + len(lengths), docs + len(lengths)
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "documents": docs, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _baseline_in_subprocess(files: list[str], tokenizer_dir: str, text_field: str, threads: int | None) -> dict:
    env = dict(os.environ)
    if threads:
        env["RAYON_NUM_THREADS"] = str(threads)
    else:
        env.pop("RAYON_NUM_THREADS", None)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(files, fh)
    try:
        proc = subprocess.run([sys.executable, "-m", "ray_moe.bench.prepare", "--baseline-files", fh.name,
                               "--tokenizer", tokenizer_dir, "--text-field", text_field],
                              env=env, capture_output=True, text=True, timeout=3600, check=False)
    finally:
        os.unlink(fh.name)
    if proc.returncode != 0:
        raise RuntimeError(f"the single-process baseline failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from ray_moe.connect import connect
    from ray_moe.data.prepare import prepare

    files = pick_files(args.input, int(args.max_mb * 1e6))
    paths = [f.path for f in files]
    base_files = [f.path for f in pick_files(paths, int(args.baseline_mb * 1e6))] if args.baseline_mb else paths
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tokenizer = args.tokenizer
        if not tokenizer:
            tokenizer = str(Path(tmp) / "tok")
            sample = (t for _, t in iter_documents(pick_files(args.input, 2_000_000), args.text_field))
            train_bpe(sample, args.vocab_size, tokenizer)
        for f in files:  # into the page cache
            Path(f.path).read_bytes()

        def ours(round_: int) -> dict[str, Any]:
            t0 = time.perf_counter()
            report = prepare(paths, tokenizer, str(Path(tmp) / f"ds{round_}"), workers=args.workers,
                             text_field=args.text_field, val_fraction=0.01, shard_tokens=args.shard_tokens,
                             progress=False)
            wall = time.perf_counter() - t0
            shutil.rmtree(Path(tmp) / f"ds{round_}")
            steady = (report.tokens - report.first_output_tokens) / (report.seconds - report.first_output_s)
            return {"tokens": report.tokens, "documents": report.meta["documents"], "seconds": wall,
                    "tokens_per_s": report.tokens / wall, "workers": report.workers,
                    "first_output_s": report.first_output_s, "steady_tokens_per_s": steady}

        variants = {
            "ray-moe prepare": ours,
            "one process, default threads": lambda _r: _baseline_in_subprocess(base_files, tokenizer,
                                                                                args.text_field, None),
            "one process, 1 thread": lambda _r: _baseline_in_subprocess(base_files, tokenizer, args.text_field, 1),
        }
        # the address and token checked first (ray_moe.connect); without one, a cluster of this
        # machine's cores, never someone else's
        local = {} if args.address else {"num_cpus": os.cpu_count(), "include_dashboard": False}
        started = connect(args.address or "local", log_to_driver=False, **local)
        try:
            cpus, nodes = ray.cluster_resources().get("CPU", 0), sum(1 for n in ray.nodes() if n["Alive"])
            runs: dict[str, list[dict]] = {name: [] for name in variants}
            names = list(variants)
            for r in range(args.repeats):  # the order rotates, so no variant always runs on a warmer machine
                for name in names[r % len(names):] + names[: r % len(names)]:
                    runs[name].append(variants[name](r))
        finally:
            if started:
                ray.shutdown()
        vocab = TextTokenizer(tokenizer).vocab_size
    rows = {}
    for name, results in runs.items():
        seconds = sorted(x["seconds"] for x in results)
        rows[name] = {**results[0], "seconds": statistics.median(seconds), "all_seconds": seconds,
                      "tokens_per_s": results[0]["tokens"] / statistics.median(seconds)}
        for key in ("first_output_s", "steady_tokens_per_s"):
            if key in results[0]:
                rows[name][key] = statistics.median(x[key] for x in results)
    if not args.baseline_mb:
        counts = {name: {x["tokens"] for x in results} for name, results in runs.items()}
        if len(set().union(*counts.values())) != 1:
            raise RuntimeError(f"the variants disagree on the token count: {counts}")
    mine = rows["ray-moe prepare"]["tokens_per_s"]
    for r in rows.values():
        r["prepare_speedup"] = mine / r["tokens_per_s"]
    return {"files": len(files), "bytes": sum(f.size for f in files), "vocab_size": vocab, "cluster_cpus": cpus,
            "nodes": nodes, "machine_cpus": os.cpu_count(), "repeats": args.repeats, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    from tabulate import tabulate

    default_input = [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")]
    p = usage.ArgumentParser(prog="ray-moe bench prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", default=default_input, help="files, directories or globs (default: stdlib)")
    p.add_argument("--max-mb", type=float, default=40.0, help="use the first MB of the inputs (0 = all)")
    p.add_argument("--baseline-mb", type=float, default=0.0,
                   help="time the single-process baselines on the first MB only (0 = the same inputs)")
    p.add_argument("--tokenizer", default="", help="tokenizer directory (default: a BPE trained on 2 MB of the input)")
    p.add_argument("--vocab-size", type=int, default=4096, help="of the BPE trained when --tokenizer is not given")
    p.add_argument("--text-field", default="text")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="rounds (order rotated); the median is reported")
    p.add_argument("--shard-tokens", type=int, default=1 << 24)
    p.add_argument("--address", default=None, help="Ray address (default: a new local cluster of this machine)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--baseline-files", default=None, help=argparse.SUPPRESS)  # the subprocess side
    args = p.parse_args(argv)
    if args.baseline_files:
        files = resolve_inputs(json.loads(Path(args.baseline_files).read_text()))
        print(json.dumps(single_process(files, args.tokenizer, args.text_field)))
        return 0
    result = run(args)
    table = [(name, r["tokens"], f"{r['seconds']:.2f}", " ".join(f"{x:.1f}" for x in r["all_seconds"]),
              f"{r['tokens_per_s']:,.0f}", f"{r['prepare_speedup']:.2f}x") for name, r in result["rows"].items()]
    print(f"# {result['files']} files, {result['bytes'] / 1e6:.1f} MB, vocab {result['vocab_size']}, "
          f"{result['machine_cpus']} CPUs here, cluster: {result['nodes']} node(s), {result['cluster_cpus']:g} CPUs")
    print(tabulate(table, headers=["variant", "tokens", "median s", "all s", "tokens/s", "prepare vs this"], tablefmt="github"))
    ours = result["rows"]["ray-moe prepare"]
    print(f"ray-moe prepare (medians): first tokens {ours['first_output_s']:.1f} s after the pipeline started "
          f"(actor start-up); after the first batch {ours['steady_tokens_per_s']:,.0f} tokens/s")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
