"""``ray-moe bench grad_reduce``: how much of a training step the replicated gradients' reduction
is exposed for, at ZeRO stage 0 (one all-reduce after backward), 1 and 2 (buckets reduce-scattered
while backward runs), at W ≥ 2.

Trains ``--iters`` steps after ``--warmup`` with the Trainer on ``--world-size`` ranks per stage
(``parallel.zero_stage``), at a real architecture cut to ``--layers`` layers (``--hf-config``, a
preset: its vocabulary included, so the embeddings and LM head weigh what they do) or the byte
model. Columns, medians over steps of the slowest rank: the step, backward, ``grad_reduce`` (the
engine's measure: after backward, the time until the replicated gradients are reduced: the
all-reduce at stage 0, the wait for buckets still in flight at 1 and 2) and its share of the step
(the target: ≤ 2 % at W=2), the update, peak GPU memory per rank.

On a rank mesh (``--ep N`` < ``--world-size``: EP N × DP W/N, ``parallel.expert_parallel``) the
experts' gradients are also summed over their DP replicas: ``replica_reduce`` is the time after
backward until that is done (the wait for the per-layer all-reduces launched in backward at
stage 0, the experts' reduce-scatters over the replicas at 1 and 2) and ``replica_pct`` its share
of the step (the target at EP2 × DP2: ≤ 2 %), e.g.
``ray-moe bench grad_reduce --world-size 4 --ep 2 --stages 0,1,2``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ray_moe import usage

TIME_KEYS = ("step", "forward", "backward", "grad_sync", "grad_reduce", "replica_reduce", "update")


def config_for(args: argparse.Namespace, stage: int, run_dir: str):
    from ray_moe.config import Config

    model: dict[str, Any] = {"seq_len": args.seq_len, "dtype": args.dtype,
                             "activation_checkpointing": args.checkpointing}
    if args.hf_config:
        model.update(hf_config=args.hf_config, hf={"num_hidden_layers": args.layers})
    else:
        model.update(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads)
    return Config.from_dict({
        "model": model,
        "moe": {} if args.hf_config else {"num_experts": args.experts, "top_k": args.top_k,
                                          "expert_hidden": args.expert_hidden},
        "parallel": {"world_size": args.world_size, "device": args.device, "transport": args.transport,
                     "cpu_per_worker": 1 if args.device != "cpu" else 0.5, "zero_stage": stage,
                     "grad_bucket_size": args.bucket_size, "expert_parallel": args.ep},
        "data": {"max_bytes": args.max_bytes},
        "train": {"batch_size": args.world_size * max(1, args.tokens // args.seq_len), "steps": 1000,
                  "warmup_steps": 0, "lr": 3e-4, "optimizer_state_dtype": args.moments, "plots": False,
                  "run_dir": run_dir, "resume": "false", "overwrite": True},
    }).with_overrides(args.set)


def stage_rows(args: argparse.Namespace, group: Any = None) -> list[dict[str, Any]]:
    """One row per ZeRO stage; ``group``: an existing worker group of ``--world-size`` ranks."""
    import tempfile

    from ray_moe.bench.common import reset_worker_peak, worker_peak_gib
    from ray_moe.driver.trainer import Trainer

    rows = []
    for stage in args.stages:
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = config_for(args, stage, run_dir)
            with Trainer(cfg, progress=False, group=group) as t:
                for _ in range(args.warmup):
                    t.step()
                t.group.execute(reset_worker_peak, timeout=120)
                steps = [t.step() for _ in range(args.iters)]
                peaks = t.group.execute(worker_peak_gib, timeout=120)
                t_mesh = t.group.mesh
        med = {k: 1e3 * statistics.median(max(s["time_per_rank"][k]) for s in steps) for k in TIME_KEYS}
        rows.append({"stage": stage, **{f"{k}_ms": v for k, v in med.items()},
                     "exposed_pct": 100 * med["grad_reduce"] / med["step"],
                     "replica_pct": 100 * med["replica_reduce"] / med["step"], "mesh": str(t_mesh),
                     "peak_gib": max(peaks) if all(p is not None for p in peaks) else None,
                     "loss": steps[-1]["loss"], "tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps)})
        print(f"  stage {stage} ({t_mesh}): step {med['step']:.1f} ms, exposed reduction {med['grad_reduce']:.2f} ms "
              f"({rows[-1]['exposed_pct']:.2f} %), replicas' expert reduction {med['replica_reduce']:.2f} ms "
              f"({rows[-1]['replica_pct']:.2f} %)", flush=True)
    return rows


def _parser() -> argparse.ArgumentParser:
    p = usage.ArgumentParser(prog="ray-moe bench grad_reduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--stages", default="0,1,2", help="comma-separated ZeRO stages")
    p.add_argument("--ep", type=int, default=0,
                   help="parallel.expert_parallel: EP degree of the rank mesh (0: auto, whole world on one node)")
    p.add_argument("--device", default="auto", help="auto, cuda, cpu")
    p.add_argument("--transport", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--moments", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--hf-config", default="qwen3-30b-a3b", help="a preset cut to --layers layers; '' = byte model")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--checkpointing", default="full", choices=("none", "moe", "full"))
    p.add_argument("--d-model", type=int, default=256, help="byte model only")
    p.add_argument("--heads", type=int, default=4, help="byte model only")
    p.add_argument("--experts", type=int, default=8, help="byte model only")
    p.add_argument("--top-k", type=int, default=2, help="byte model only")
    p.add_argument("--expert-hidden", type=int, default=256, help="byte model only")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--bucket-size", type=int, default=40_000_000, help="parallel.grad_bucket_size")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size cap (data.max_bytes)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_overrides()
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    return p


def main(argv: Sequence[str] | None = None, group: Any = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.stages = [int(s) for s in args.stages.split(",") if s]
    except ValueError:
        parser.error(f"--stages={args.stages!r} must be comma-separated integers among 0, 1, 2")
    if not args.stages or any(s not in (0, 1, 2) for s in args.stages):
        parser.error(f"--stages={args.stages} must name stages among 0, 1, 2")
    for name in ("world_size", "layers", "tokens", "seq_len", "iters", "bucket_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.world_size < 2:
        parser.error("--world-size must be >= 2: one rank reduces nothing")
    try:
        config_for(args, args.stages[0], "runs/bench-grad-reduce-check")
    except ValueError as exc:  # ConfigError: names the key
        parser.error(f"--set: {exc}" if args.set else str(exc))
    from tabulate import tabulate

    print(f"bench grad_reduce: W={args.world_size} (EP {args.ep or 'auto'}), {args.hf_config or 'byte model'} x {args.layers} layers, "
          f"{args.tokens} tokens/rank, {args.dtype}, moments {args.moments}", flush=True)
    out: dict[str, Any] = {"env": {"host": platform.node(), "date": time.strftime("%Y-%m-%d")}, "args": vars(args),
                           "rows": stage_rows(args, group)}
    cols = ["stage", "mesh"] + [f"{k}_ms" for k in TIME_KEYS] + ["exposed_pct", "replica_pct", "peak_gib"]
    print(tabulate([[r[c] for c in cols] for r in out["rows"]], headers=cols, floatfmt=".2f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
