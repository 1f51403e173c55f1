"""``ray-moe bench overlap``: a real architecture's training step at W ranks (the default step, and
variants of the settings that overlap communication with compute) against one rank running the
same tokens per rank (the step expert parallelism would take if its exchanges cost nothing: the
same FLOPs per GPU, every expert local).

The Trainer at ``--world-size`` ranks (one group for every W-rank variant, a fresh model per run)
and at one rank, ``--hf-config`` cut to each of ``--layers`` depths, ``--tokens`` per rank in sequences of
``--seq-len``, ``--checkpointing``; ``--warmup`` steps, then ``--iters`` timed ones. The variants
run ``--rounds`` times, every other round in reverse order (ABBA: the GPUs slow as they heat, which
favours whatever runs first), and each column is the median over the rounds of each round's median
over steps of the slowest rank. Columns: step, forward, backward, grad sync, update (the engine's
phases; the forward includes waiting for the previous step's overlapped update), ``scaling`` = one
rank's step / this step, tokens/s per GPU, peak GPU memory, ``imbalance`` (max over ranks / mean of
the (token, expert) pairs each rank computed, within each EP group and averaged over the groups and layers: the slowest rank's experts set
the step, and a fresh model routes unevenly; the ``rebalance`` variant re-clones hot experts) (``--trace-dir``: one more step of each
run in the first round under torch.profiler, every rank's trace kept). With two or more depths, a ``per layer``
row per variant: the slope between the first and the last depth, without what does not grow with
depth (the replicated embedding and LM head's gradients and update: at a 2-layer cut of a model
with a 151,936-token vocabulary, most of what W ranks lose to one). ``--zero-stage`` (2, as the real jobs)
applies at W ranks; one rank has nothing to reduce. ``--ep N`` runs the W ranks as a rank mesh of
EP N × DP W/N (``parallel.expert_parallel``; the one-rank reference is unchanged): the
``replica_reduce`` column is then the experts' reduction over their replicas exposed after
backward (0 at DP 1).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from ray_moe import usage

# A variant is one of these, or several joined by "+" (their overrides together): at W ranks
# "sequential" is the default step, each rank's batch through the blocks in one pass.
VARIANTS = MappingProxyType({
    "sequential": {},
    "param_gather": {"parallel.overlap_param_gather": True},  # ZeRO's update beside the next forward (the default)
    "no_param_gather": {"parallel.overlap_param_gather": False},  # ZeRO's update after backward, main stream
    "bf16_reduce": {"parallel.grad_reduce_dtype": "bfloat16"},
    # hot experts re-cloned from the routing measured every 2 steps (a fresh model routes unevenly:
    # at W=4 one rank's grouped GEMMs took 3.6x another's in a trace of 2026-11-26)
    "rebalance": {"balance.enabled": True, "balance.interval": 2, "balance.clone_slots": 4, "balance.ema": 0.0},
})


def variant_overrides(name: str) -> dict[str, Any]:
    """The config overrides of a variant name ("a+b": a's and b's together)."""
    out: dict[str, Any] = {}
    for part in name.split("+"):
        out.update(VARIANTS[part])
    return out


TIME_KEYS = ("step", "forward", "backward", "grad_sync", "replica_reduce", "update")


def config_for(args: argparse.Namespace, world_size: int, variant: str, run_dir: str, layers: int | None = None):
    """The Trainer's config of one run: ``variant``'s overrides at W ranks (one rank: none)."""
    from ray_moe.config import Config

    config = Config.from_dict({
        "model": {"hf_config": args.hf_config, "hf": {"num_hidden_layers": layers or args.layers[0]},
                  "seq_len": args.seq_len, "dtype": args.dtype, "activation_checkpointing": args.checkpointing},
        "parallel": {"world_size": world_size, "device": args.device, "transport": args.transport,
                     "cpu_per_worker": 1 if args.device != "cpu" else 0.5, "comm_programs": args.comm_programs,
                     "zero_stage": args.zero_stage if world_size > 1 else 0,
                     "expert_parallel": args.ep if world_size > 1 else 0},
        "data": {"max_bytes": args.max_bytes},
        "train": {"batch_size": world_size * (args.tokens // args.seq_len), "steps": 1000, "warmup_steps": 0,
                  "lr": 3e-4, "plots": False, "run_dir": run_dir, "resume": "false", "overwrite": True},
    })
    over = variant_overrides(variant) if world_size > 1 else {}
    over = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in over.items()] + list(args.set)
    return config.with_overrides(over) if over else config


def _profiled_step(worker: Any, path: str) -> str:
    """One more training step on this worker under torch.profiler (the CPU's operators, and its
    GPU's kernels where it has one), its Chrome trace kept at ``path`` ({rank} filled in), gzipped.

    Profiler and step run in one worker call, so nothing else the actor's second thread answers
    meanwhile (a health check) lands between them; every rank's profiler is running before any
    rank starts the step (a barrier), else a rank's first exchange holds its wait for a peer still
    starting its profiler (200 ms at W=2, measured 2026-11-26). Read the trace with ``python -m
    ray_moe.bench.timeline --after '' TRACE``: its default starts the listing after the last NCCL
    kernel, which in a ZeRO step is the closing all-gather."""
    import os

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from ray_moe.bench.timeline import keep_gzipped

    cuda = worker.engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        if worker.engine.distributed:
            dist.barrier()
        worker.step()
        if cuda:
            torch.cuda.synchronize(worker.engine.device)
    fd, raw = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(raw)
        return keep_gzipped(raw, path.format(rank=worker.rank_info.rank))
    finally:
        os.unlink(raw)


def run_once(args: argparse.Namespace, group: Any, world_size: int, variant: str, layers: int,
             trace: str | None = None) -> dict[str, Any]:
    """One Trainer on ``group``: medians over ``--iters`` steps of the slowest rank's phases (ms).
    ``trace``: then one more step under torch.profiler on every rank, each rank's Chrome trace kept
    at ``trace`` (a path with ``{rank}``)."""
    from ray_moe.bench.common import reset_worker_peak, worker_peak_gib
    from ray_moe.driver.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        with Trainer(config_for(args, world_size, variant, run_dir, layers), progress=False, group=group) as t:
            for _ in range(args.warmup):
                t.step()
            t.group.execute(reset_worker_peak, timeout=120)
            steps = [t.step() for _ in range(args.iters)]
            peaks = t.group.execute(worker_peak_gib, timeout=120)
            if trace:
                t.group.execute(_profiled_step, trace, timeout=300)
    row = {f"{k}_ms": 1e3 * statistics.median(max(s["time_per_rank"][k]) for s in steps) for k in TIME_KEYS}
    row["imbalance"] = statistics.median(s.get("imbalance", 1.0) for s in steps)
    row["peak_gib"] = max(peaks) if all(p is not None for p in peaks) else None
    row["loss"] = steps[-1]["loss"]
    return row


def rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per depth in ``--layers``: every variant at ``--world-size`` in ABBA rounds, then one rank,
    and the scaling against it; with two or more depths also a ``per layer`` row per variant, the
    slope between the first and the last depth (what the replicated embedding, LM head and the
    update, whose cost does not grow with depth, leave out) and its scaling."""
    from ray_moe.driver.group import WorkerGroup

    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        with WorkerGroup(config_for(args, args.world_size, "sequential", run_dir)) as group:
            for layers in args.layers:
                for r in range(args.rounds):
                    for v in (args.variants if r % 2 == 0 else args.variants[::-1]):
                        trace = (f"{args.trace_dir}/{v}_l{layers}_w{args.world_size}_rank{{rank}}.json.gz"
                                 if args.trace_dir and r == 0 else None)
                        runs.setdefault((layers, v), []).append(
                            run_once(args, group, args.world_size, v, layers, trace))
                        print(f"  {layers} layers, round {r}: W={args.world_size} {v}: "
                              f"step {runs[layers, v][-1]['step_ms']:.1f} ms", flush=True)
        with WorkerGroup(config_for(args, 1, "sequential", run_dir)) as group:
            for layers in args.layers:
                for r in range(args.rounds):
                    trace = f"{args.trace_dir}/one_rank_l{layers}_rank{{rank}}.json.gz" if args.trace_dir and r == 0 else None
                    runs.setdefault((layers, "one rank"), []).append(run_once(args, group, 1, "sequential", layers, trace))
                    print(f"  {layers} layers, round {r}: one rank: step {runs[layers, 'one rank'][-1]['step_ms']:.1f} ms",
                          flush=True)
    out = []
    names = ["one rank", *args.variants]
    for layers in args.layers:
        ref = _median_row(runs[layers, "one rank"])
        for name in names:
            row = {"layers": layers, "variant": name, "world_size": 1 if name == "one rank" else args.world_size,
                   **_median_row(runs[layers, name]), "steps_ms_per_round": [r["step_ms"] for r in runs[layers, name]]}
            row["scaling"] = ref["step_ms"] / row["step_ms"]
            row["tokens_per_s_per_gpu"] = args.tokens / (row["step_ms"] / 1e3)
            out.append(row)
    if len(args.layers) >= 2:
        a, b = args.layers[0], args.layers[-1]
        slope = {n: per_layer(_median_row(runs[a, n]), _median_row(runs[b, n]), b - a) for n in names}
        for name in names:
            ours, ref = slope[name]["step_ms"], slope["one rank"]["step_ms"]
            out.append({"layers": "per layer", "variant": name, "world_size": 1 if name == "one rank" else args.world_size,
                        **slope[name], "scaling": ref / ours if ours and ref else None})
    return out


def per_layer(first: dict[str, Any], last: dict[str, Any], layers: int) -> dict[str, float | None]:
    """The two-point slope of each time (ms per added layer) between two depths ``layers`` apart;
    None where the deeper run was not slower (timing noise larger than a layer's time), never a
    negative time."""
    out: dict[str, float | None] = {}
    for key in (f"{t}_ms" for t in TIME_KEYS):
        slope = (last[key] - first[key]) / layers
        out[key] = slope if slope > 0 else None
    return out


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [f"{k}_ms" for k in TIME_KEYS]
    row = {k: statistics.median(r[k] for r in runs) for k in keys}
    peaks = [r["peak_gib"] for r in runs if r["peak_gib"] is not None]
    row["peak_gib"] = max(peaks) if peaks else None
    row["imbalance"] = statistics.median(r["imbalance"] for r in runs)
    row["loss"] = runs[-1]["loss"]
    return row


def _parser() -> argparse.ArgumentParser:
    p = usage.ArgumentParser(prog="ray-moe bench overlap", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--variants", default="sequential",
                   help=f"comma list of variants, each one of {', '.join(VARIANTS)} or several joined by '+' "
                        "(e.g. bf16_reduce+no_param_gather)")
    p.add_argument("--device", default="auto", help="auto, cuda, cpu")
    p.add_argument("--transport", default="auto")
    p.add_argument("--comm-programs", type=int, default=0, help="parallel.comm_programs (NVSHMEM: 0 = every SM)")
    p.add_argument("--ep", type=int, default=0,
                   help="parallel.expert_parallel at W ranks: EP N x DP W/N (0: auto, the whole world on one node)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--hf-config", default="qwen3-30b-a3b", help="an HF preset, cut to --layers layers")
    p.add_argument("--layers", default="2", help="comma list of depths (num_hidden_layers); two or more: "
                   "also the per-layer slope between the first and the last")
    p.add_argument("--checkpointing", default="none", choices=("none", "moe", "full"))
    p.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2),
                   help="parallel.zero_stage at W ranks (2: the replicated gradients reduce-scattered while backward runs)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank per step")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size cap (data.max_bytes)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=8)
    p.add_overrides()
    p.add_argument("--trace-dir", default=None,
                   help="after each run's timed steps in the first round, one step under torch.profiler on every "
                        "rank: its Chrome trace kept here (read with python -m ray_moe.bench.timeline TRACE)")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    raw = args.layers
    try:
        args.layers = [int(v) for v in raw.split(",")]
    except ValueError:
        args.layers = []
    if not args.layers or any(v < 1 for v in args.layers) or len(set(args.layers)) != len(args.layers):
        parser.error(f"--layers={raw!r} must be a comma list of distinct integers >= 1")
    if not args.variants or any(part not in VARIANTS for v in args.variants for part in v.split("+")):
        parser.error(f"--variants={','.join(args.variants)!r} must name some of {', '.join(VARIANTS)} "
                     "(or several joined by '+')")
    for name in ("world_size", "tokens", "seq_len", "rounds", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.world_size < 2:
        parser.error("--world-size must be >= 2: one rank exchanges nothing (it is the reference)")
    if args.tokens % args.seq_len:
        parser.error(f"--tokens={args.tokens} must be a multiple of --seq-len={args.seq_len}")
    if args.comm_programs < 0:
        parser.error(f"--comm-programs must be >= 0, got {args.comm_programs}")
    try:
        for v in args.variants:
            where = "--set" if args.set else f"--variants={v}"
            config_for(args, args.world_size, v, "runs/bench-overlap-check")
    except ValueError as exc:  # ConfigError: names the key
        parser.error(f"{where}: {exc}")
    from tabulate import tabulate

    print(f"bench overlap: W={args.world_size}, {args.hf_config} x {','.join(map(str, args.layers))} layers, {args.tokens} tokens/rank, "
          f"checkpointing {args.checkpointing}, {args.rounds} rounds", flush=True)
    out: dict[str, Any] = {"env": {"host": platform.node(), "date": time.strftime("%Y-%m-%d")}, "args": vars(args),
                           "rows": rows(args)}
    cols = ["layers", "variant", "world_size"] + [f"{k}_ms" for k in TIME_KEYS] + ["scaling", "tokens_per_s_per_gpu",
                                                                                    "peak_gib", "imbalance"]
    print(tabulate([[r.get(c) for c in cols] for r in out["rows"]], headers=cols, floatfmt=".3f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
