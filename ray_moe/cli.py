"""Command line: ``ray-moe train | prepare | tokenizer | export | bench | smoke``.

    ray-moe train --config jobs/tiny.yaml [--address ADDR] [section.key=value ...]
    ray-moe prepare --input PATH... --tokenizer DIR --out DIR [--address ADDR]   (token shards)
    ray-moe tokenizer train --vocab-size N --input PATH... --out DIR              (byte-level BPE)
    ray-moe export CHECKPOINT --format hf --out DIR [--replace]  (a checkpoint or run directory → an HF model directory)
    ray-moe bench comm|layer|balance|precision|prepare|train|grad_reduce|overlap|curve [options]     (see ``ray-moe bench NAME --help``)
    ray-moe smoke --address ADDR                    (validate a cluster before a run)

Exit code 0 on success; on failure a one-line reason on stderr and a non-zero code.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import signal
import sys
import threading
from types import MappingProxyType

from ray_moe import usage

# A write that fails for one of these reasons is the user's to fix: one line, not a traceback.
UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
# name → (what it measures, where it runs): `ray-moe bench --help` lists them.
BENCH_HELP = MappingProxyType({
    "comm": ("NVSHMEM dispatch/combine against NCCL's all-to-all exchange, per tokens per rank", "GPUs (>= 2)"),
    "layer": ("one MoE layer: expert GEMMs, routing, saved activations, the layer beside SonicMoE; "
              "expert-parallel rows (--sections ep)", "a GPU; --sections ep also on a CPU cluster"),
    "balance": ("how well clone placement evens skewed routing (--mode sim: simulated routers; train: a run)",
                "CPU (--mode sim), GPUs or CPU (--mode train --device cpu)"),
    "precision": ("a training step's phases with each optimizer, and the LM loss's time and memory",
                  "a GPU, or the CPU with --device cpu (slow)"),
    "prepare": ("ray-moe prepare's tokens/s against one Python process on the same files", "CPU"),
    "train": ("one rank's training step of an HF family, phase by phase, beside torchtitan",
              "a GPU, or the CPU with --device cpu (small --layers)"),
    "grad_reduce": ("how much of a step the gradient reduction is exposed for at ZeRO stages 0, 1, 2",
                    "GPUs (>= 2), or a CPU cluster with --device cpu"),
    "overlap": ("a step at W ranks against one rank running the same tokens per rank",
                "GPUs (>= 2), or a CPU cluster with --device cpu"),
    "curve": ("loss curves of config variants (e.g. bf16 and FP8 experts) from one seed, side by side",
              "a GPU, or the CPU with --device cpu (tiny presets)"),
})
BENCHES = tuple(BENCH_HELP)


def _train(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from ray_moe.config import Config
    from ray_moe.driver.run_dir import refuse_past_the_end
    from ray_moe.driver.trainer import Trainer

    config = Config.from_yaml(args.config, args.overrides)
    refuse_past_the_end(config.train)  # before anything starts or is written
    print("# config (whole: RUN_DIR/config.yaml)")
    print(compact_config(config), flush=True)
    with Trainer(config, address=args.address, progress=not args.no_progress) as trainer:
        print(f"# run_dir {trainer.run_dir} (step {trainer.step_count} of {config.train.steps})", flush=True)
        trainer.train()
        summary = trainer.summary()
    print("\n# summary")
    print(tabulate([(k, _fmt(v)) for k, v in summary.items()], tablefmt="github",
                   headers=["metric", "value"]))
    print(f"# results in {summary['run_dir']}", flush=True)
    return 0


def compact_config(config) -> str:
    """One line per section: the keys that differ from the defaults (``section: (defaults)`` when none)."""
    from ray_moe.config import Config

    default, lines = Config().to_dict(), []
    for section, values in config.to_dict().items():
        changed = [f"{k}={v}" for k, v in values.items() if default[section][k] != v]
        lines.append(f"{section}: " + (" ".join(changed) if changed else "(defaults)"))
    return "\n".join(lines)


def _prepare(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from ray_moe.data.prepare import prepare

    report = prepare(
        args.input, args.tokenizer, args.out, address=args.address, workers=args.workers,
        cpus_per_worker=args.cpus_per_worker, text_field=args.text_field, val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens, progress=False if args.no_progress else None,
        stall_timeout_s=args.stall_timeout_s,
    )
    meta = report.meta
    rows = [("dataset", report.out), ("state", "already complete" if report.up_to_date else "written"),
            ("documents", meta["documents"]), ("tokens", meta["tokens"]),
            ("train / val tokens", f"{meta['splits']['train']['tokens']} / {meta['splits']['val']['tokens']}"),
            ("shards", meta["splits"]["train"]["shards"] + meta["splits"]["val"]["shards"]),
            ("dtype", meta["dtype"]), ("vocab_size", meta["vocab_size"])]
    if not report.up_to_date:
        rows += [("input files skipped (resumed)", report.skipped_files), ("workers", report.workers),
                 ("seconds", f"{report.seconds:.1f}"), ("tokens/s", f"{report.tokens_per_s:,.0f}")]
    print(tabulate(rows, tablefmt="github", headers=["prepare", "value"]))
    return 0


def _tokenizer_train(args: argparse.Namespace) -> int:
    from ray_moe.data.inputs import check_inputs, iter_documents, resolve_inputs
    from ray_moe.data.tokenizer import train_bpe

    files = resolve_inputs(args.input)
    check_inputs(files, args.text_field)
    try:
        tok = train_bpe((text for _, text in iter_documents(files, args.text_field)), args.vocab_size, args.out,
                        min_frequency=args.min_frequency)
    except (ValueError, AttributeError) as exc:  # a malformed JSON line past the part checked first
        from ray_moe.data.errors import DataError
        from ray_moe.data.inputs import JSONL
        from ray_moe.data.prepare import bad_row

        bad = None if isinstance(exc, DataError) else bad_row(JSONL, [f for f in files if f.kind == JSONL])
        if bad is None:
            raise
        raise DataError(bad) from None
    print(f"tokenizer {tok.directory}: vocab_size {tok.vocab_size}, eos {tok.eos_token!r} (id {tok.eos_id}), "
          f"sha256 {tok.hash[:12]}, trained on {len(files)} file(s)")
    return 0


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else v


class UsageError(ValueError):
    """A command-line argument that cannot be used; the message names it and what is allowed."""


def _export_source(given: str):
    """The checkpoint to export: ``given`` itself, or a run directory's newest valid one; a run
    directory without one is named with its corrupt checkpoints (and why each is corrupt)."""
    from pathlib import Path

    from ray_moe.checkpoint import CheckpointError, META, checkpoints_dir, resolve_checkpoint, scan_checkpoints

    path = Path(given).expanduser().resolve()
    if not path.exists():
        raise CheckpointError(f"{given!r} does not exist; give a checkpoint (RUN_DIR/checkpoints/step_N) or a run "
                              "directory")
    if (path / META).is_file() or not checkpoints_dir(path).is_dir():
        return resolve_checkpoint(path)
    valid, corrupt = scan_checkpoints(path)
    if valid:
        return valid[0]
    aside = sorted(p.name for p in checkpoints_dir(path).glob("corrupt-step_*"))
    found = [f"{p.name}: {why}" for p, why in corrupt] + [f"{name} (set aside as corrupt)" for name in aside]
    raise CheckpointError(f"run directory {str(path)!r} holds no valid checkpoint"
                          + (f" ({'; '.join(found)})" if found else " (none was saved)")
                          + "; export a valid checkpoint directory instead")


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ray_moe.checkpoint import CheckpointError, as_umask_allows, iter_tensors, read_meta
    from ray_moe.config import Config, torch_dtype
    from ray_moe.model.hf import write_hf_dir

    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out!r} is a file; give a directory (a new or empty one, or one to replace "
                         "whole with --replace)")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not args.replace:
        shown = ", ".join(held[:4]) + (f", ... ({len(held)} entries)" if len(held) > 4 else "")
        raise UsageError(f"--out {args.out!r} is not empty (it holds {shown}); give a new or empty directory, or "
                         "add --replace to replace it whole with the export")
    path = _export_source(args.checkpoint)
    source, target = Path(args.checkpoint).expanduser().resolve(), out.resolve()
    for kept in (source, path.resolve()):
        if target == kept or target in kept.parents or kept in target.parents:
            raise UsageError(f"--out {args.out!r} overlaps the checkpoint it exports ({str(kept)!r}); give a "
                             "directory outside the run")
    if target in (Path.cwd().resolve(), Path.home().resolve(), Path(target.anchor)):
        raise UsageError(f"--out {args.out!r} is the current, home or root directory; give a directory of its own")
    meta = read_meta(path)
    config = Config.from_plain(meta["config"])
    if not meta.get("hf_config") and not config.model.uses_hf():
        from ray_moe.arch import FAMILIES

        raise CheckpointError(f"checkpoint {str(path)!r} is of model.arch=byte, which has no Hugging Face "
                              f"equivalent; --format hf exports runs of {', '.join(FAMILIES)}")
    from ray_moe.arch import ArchSpec

    hf_config = meta.get("hf_config") or config.resolve_arch().hf_config
    spec = ArchSpec.from_hf(hf_config)
    dtype = torch_dtype(args.dtype or config.model.dtype)
    # Written beside --out, then swapped in whole: the directory never mixes two models, and a
    # write that fails (a full disk) leaves it as it was.
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        report = write_hf_dir(staging, spec, hf_config, iter_tensors(path, meta), dtype,
                              max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
                              tokenizer_dir=getattr(config.data, "tokenizer", "") or None)
        for name in report["files"]:
            as_umask_allows(staging / name)
        _swap_in(staging, out)
    except Exception as exc:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(exc, OSError) and type(exc).__name__ != "SafetensorError":
            raise
        code = f" ({errno.errorcode.get(exc.errno, exc.errno)})" if getattr(exc, "errno", None) else ""
        raise UsageError(f"--out {args.out!r}: cannot write the model there ({getattr(exc, 'strerror', None) or exc}"
                         f"{code}); {args.out} is as it was: free space or choose another directory") from None
    print(f"exported {str(path)!r} (step {meta['step']}) to {args.out}: {report['tensors']} tensors, "
          f"{report['bytes'] / 1e6:.1f} MB {str(dtype).removeprefix('torch.')}, files: {', '.join(report['files'])}")
    return 0


def _swap_in(new, out) -> None:
    """Put directory ``new`` at ``out``: an existing ``out`` is moved aside first and removed once
    ``new`` is in place (restored if the rename fails)."""
    import shutil

    if not out.exists():
        os.replace(new, out)
        return
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    os.replace(out, old)
    try:
        os.replace(new, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"ray_moe.bench.{args.name}")
    return int(module.main(args.rest) or 0)


def _smoke(args: argparse.Namespace) -> int:
    from ray_moe.ops.smoke import main as smoke_main

    return int(smoke_main(args.rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = usage.ArgumentParser(prog="ray-moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train an MoE language model from a YAML config")
    p.add_argument("--config", required=True, help="YAML config (e.g. jobs/tiny.yaml)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a new local cluster)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(fn=_train)
    e = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    e.add_argument("checkpoint", help="a checkpoint directory (step_*) or a run directory (its latest)")
    e.add_argument("--format", choices=("hf",), required=True, help="hf: config.json + safetensors shards")
    e.add_argument("--out", required=True, help="output directory: new or empty (a non-empty one needs --replace)")
    e.add_argument("--replace", action="store_true",
                   help="replace a non-empty --out whole (everything in it goes) once the export is written")
    e.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="tensor dtype (default: the run's model.dtype)")
    e.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (GiB)")
    e.set_defaults(fn=_export)
    pp = sub.add_parser("prepare", help="tokenize text into memory-mapped token shards with Ray Data")
    pp.add_argument("--input", nargs="+", required=True,
                    help="files, directories or globs: text (a file is a document), .jsonl or .parquet")
    pp.add_argument("--tokenizer", required=True, help="tokenizer directory (a Hugging Face tokenizer.json)")
    pp.add_argument("--out", required=True, help="dataset directory (new, or this command's to resume)")
    pp.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a new local cluster)")
    pp.add_argument("--text-field", default="text", help="the text field of .jsonl / column of .parquet")
    pp.add_argument("--val-fraction", type=float, default=0.01, help="documents kept for validation")
    pp.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard")
    pp.add_argument("--workers", type=int, default=None, help="tokenizer actors (default: the cluster's CPUs)")
    pp.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs per tokenizer actor")
    pp.add_argument("--stall-timeout-s", type=float, default=600.0,
                    help="give up when the workers deliver nothing for this long")
    pp.add_argument("--no-progress", action="store_true", help="no progress output")
    pp.set_defaults(fn=_prepare)
    tk = sub.add_parser("tokenizer", help="tokenizers: train a byte-level BPE on local text")
    tks = tk.add_subparsers(dest="action", required=True)
    tt = tks.add_parser("train", help="train a byte-level BPE tokenizer")
    tt.add_argument("--vocab-size", type=int, required=True, help="tokens (>= 257: 256 bytes + EOS + merges)")
    tt.add_argument("--input", nargs="+", required=True, help="files, directories or globs (as for prepare)")
    tt.add_argument("--out", required=True, help="directory for tokenizer.json (must not hold one)")
    tt.add_argument("--text-field", default="text", help="the text field of .jsonl / column of .parquet")
    tt.add_argument("--min-frequency", type=int, default=2, help="merges need at least this many occurrences")
    tt.set_defaults(fn=_tokenizer_train)
    listing = "\n".join(f"  {name:<12} {what}\n  {'':<12} runs on: {where}" for name, (what, where) in BENCH_HELP.items())
    b = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES),
                       description=f"benchmarks (options: ray-moe bench NAME --help):\n{listing}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("name", choices=BENCHES, help="the benchmark (listed above)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=_bench)
    s = sub.add_parser("smoke", help="cluster smoke test (see ray-moe smoke --help)")
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=_smoke)
    return parser


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``ray-moe [-v] smoke ARGS...``: ARGS go to :mod:`ray_moe.ops.smoke` untouched (argparse's
    REMAINDER would reject ARGS that start with an option, e.g. ``smoke --address X``)."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            return (argv[: i + 1], argv[i + 1:]) if arg == "smoke" else (argv, None)
    return argv, None


def main(argv: list[str] | None = None) -> int:
    head, passthrough = _split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(head)
    if passthrough is not None:
        args.rest = passthrough
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from ray_moe.arch import ArchError
    from ray_moe.checkpoint import CheckpointError
    from ray_moe.config import ConfigError
    from ray_moe.connect import ConnectError
    from ray_moe.data.errors import DataError
    from ray_moe.data.prepare import PrepareError
    from ray_moe.driver.errors import GroupError, TrainingError, TrainingInterrupted
    from ray_moe.model.hf import WeightsError

    # A command started in the background by a script inherits SIGINT ignored: `kill -INT` must
    # still stop it as Ctrl-C does (train installs its own handlers, which checkpoint first).
    interruptible = (signal.getsignal(signal.SIGINT) == signal.SIG_IGN
                     and threading.current_thread() is threading.main_thread())
    if interruptible:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return args.fn(args)
    except TrainingInterrupted as exc:
        print(f"ray-moe {args.command}: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except (ConfigError, DataError, GroupError, TrainingError, CheckpointError, WeightsError, ArchError,
            PrepareError, UsageError, ConnectError) as exc:
        # Named here: Ray must not print the workers' copies of it ("Unhandled error" tracebacks of
        # results dropped on the way out); Ray reads this variable each time it would.
        os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
        print(f"ray-moe {args.command}: error: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ray-moe {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno not in UNWRITABLE:
            raise
        os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
        import errno as errno_names

        where = exc.filename or "a file"
        print(f"ray-moe {args.command}: error: cannot write {where}: {exc.strerror or exc} "
              f"({errno_names.errorcode.get(exc.errno, exc.errno)}); free space or fix the permissions, then rerun",
              file=sys.stderr)
        return 2
    finally:
        if interruptible:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
