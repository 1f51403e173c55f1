"""``ray-moe bench balance``: how well the clone planner balances skewed routing.

``--mode sim`` (CPU, any W/E/K/nodes): synthetic routers whose expert popularity is Zipf(s) with
the hot experts at random positions; each token picks top-K distinct experts (sampling without
replacement, Gumbel top-k). Two experiments:

* **static** (per s): imbalance (max/mean tokens per rank) without cloning, with the plan on the
  loads it was made from, on fresh batches from the same distribution (expected tokens from the
  shares, and the tokens actually routed by the placement's on-device hash rule);
* **shifting** (per s > 0): the hot set is redrawn every ``--shift-every`` steps; a
  :class:`~ray_moe.placement.loads.LoadTracker` (EMA over intervals, as the driver keeps it) feeds a
  re-plan every ``--interval`` steps, and we
  report the imbalance before the shift, its peak after it, and how many re-plan intervals it
  takes to get back under ``--recover-below``.

``--mode train``: real layer steps (forward, backward, clone coherence) on a Ray worker group
(GPUs, or CPUs with ``--device cpu``) with Zipf-skewed routing whose hot experts live on rank 0:
step time and measured imbalance with cloning off, then with the plan made from those loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from typing import Any, Sequence

import numpy as np
import torch

from ray_moe import usage
from ray_moe.config import BalanceConfig
from ray_moe.placement.loads import LoadTracker
from ray_moe.placement.placement import Placement
from ray_moe.placement.planner import (
    nodes_of_ranks,
    plan_placement,
    plan_report,
    predicted_imbalance,
)
from ray_moe.placement.sim import ZipfRouting, routed_imbalance


# ============================================================================ experiments
def static_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per Zipf s: imbalance without cloning / on the plan's loads / on fresh batches."""
    W, E, K, T = args.world_size, args.experts, args.top_k, args.tokens_per_rank
    nodes = nodes_of_ranks(W, args.nodes)
    bytes_per_expert = 3 * args.d_model * args.expert_hidden * args.bytes_per_param
    rows = []
    for s in args.zipf:
        acc: dict[str, list[float]] = {k: [] for k in (
            "no_clone", "plan_loads", "fresh", "fresh_routed", "fresh_no_clone", "clones",
            "cross_node_clones", "plan_ms")}
        for seed in range(args.seeds):
            routing = ZipfRouting.make(E, s, seed)
            gen = torch.Generator().manual_seed(10_000 + seed)
            src = routing.counts(routing.draw(W, T, K, gen), E)
            t0 = time.perf_counter()
            plan = plan_placement(src.sum(0), W, nodes, args.clone_slots,
                                  max_cross_node_clones=args.max_cross_node_clones, source_loads=src)
            acc["plan_ms"].append((time.perf_counter() - t0) * 1e3)
            rep = plan_report(src, None, plan, bytes_per_expert, nodes)
            acc["no_clone"].append(rep["imbalance_native"])
            acc["plan_loads"].append(rep["imbalance_after"])
            acc["clones"].append(rep["clones"])
            acc["cross_node_clones"].append(rep["cross_node_clones"])
            native = Placement.native(E, W, args.clone_slots)
            for _ in range(args.fresh_batches):
                ids = routing.draw(W, T, K, gen)
                fresh = routing.counts(ids, E)
                acc["fresh"].append(predicted_imbalance(fresh, plan))
                acc["fresh_no_clone"].append(predicted_imbalance(fresh, native))
                acc["fresh_routed"].append(routed_imbalance(ids, plan))
        rows.append({
            "zipf_s": s,
            "no_clone": float(np.mean(acc["no_clone"])),
            "plan_loads": float(np.mean(acc["plan_loads"])),
            "plan_loads_max": float(np.max(acc["plan_loads"])),
            "fresh": float(np.mean(acc["fresh"])),
            "fresh_max": float(np.max(acc["fresh"])),
            "fresh_routed_max": float(np.max(acc["fresh_routed"])),
            "clones": float(np.mean(acc["clones"])),
            "cross_node_clones": float(np.mean(acc["cross_node_clones"])),
            "bytes_per_plan_MB": float(np.mean(acc["clones"])) * bytes_per_expert / 2**20,
            "plan_ms": float(np.mean(acc["plan_ms"])),
        })
    return rows


def shifting_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per Zipf s > 0: the hot set is redrawn every ``shift_every`` steps."""
    W, E, K, T = args.world_size, args.experts, args.top_k, args.shift_tokens_per_rank
    nodes = nodes_of_ranks(W, args.nodes)
    rows = []
    for s in [z for z in args.zipf if z > 0]:
        gen = torch.Generator().manual_seed(20_000)
        tracker = LoadTracker(1, E, W, ema=args.ema)
        placement = Placement.native(E, W, args.clone_slots)
        native = placement
        trace: list[dict[str, float]] = []
        replans = changed = moved = 0
        moved_steady = 0  # clones added by re-plans whose last two windows saw no shift
        window: np.ndarray | None = None
        routing = ZipfRouting.make(E, s, 0)
        for step in range(args.shift_steps):
            if step > 0 and step % args.shift_every == 0:
                routing = ZipfRouting.make(E, s, step)
            src = routing.counts(routing.draw(W, T, K, gen), E)
            trace.append({"step": step, "imbalance": predicted_imbalance(src, placement),
                          "no_clone": predicted_imbalance(src, native)})
            window = src if window is None else window + src
            if (step + 1) % args.interval == 0:  # the driver pulls the interval's counts, then plans
                tracker.update(window[None])
                window = None
                new = plan_placement(tracker.loads[0], W, nodes, args.clone_slots, previous=placement,
                                     max_cross_node_clones=args.max_cross_node_clones,
                                     source_loads=tracker.source_loads[0])
                rep = plan_report(tracker.loads[0], placement, new)
                replans += 1
                changed += rep["changed"]
                moved += rep["clones_added"]
                if step - (step // args.shift_every) * args.shift_every >= 2 * args.interval:
                    moved_steady += rep["clones_added"]
                placement = new
        # recovery after each shift: intervals (re-plans) until a step is under the threshold
        recover, peaks, steady = [], [], []
        for shift in range(args.shift_every, args.shift_steps, args.shift_every):
            before = [t["imbalance"] for t in trace[max(0, shift - args.interval):shift]]
            steady.append(float(np.mean(before)))
            after = trace[shift: shift + args.shift_every]
            peaks.append(max(t["imbalance"] for t in after))
            ok = next((t["step"] for t in after if t["imbalance"] <= args.recover_below), None)
            if ok is None:
                recover.append(float("inf"))
            else:  # re-plans happen after steps interval-1, 2*interval-1, ...
                first_plan = (shift // args.interval + 1) * args.interval
                recover.append(0 if ok < first_plan else (ok - first_plan) // args.interval + 1)
        rows.append({
            "zipf_s": s,
            "no_clone": float(np.mean([t["no_clone"] for t in trace])),
            "steady_before_shift": float(np.mean(steady)) if steady else float("nan"),
            "peak_after_shift": float(np.mean(peaks)) if peaks else float("nan"),
            "intervals_to_recover": float(np.max(recover)) if recover else float("nan"),
            "replans": replans,
            "changed": changed,
            "clones_moved": moved,
            "clones_moved_no_shift": moved_steady,
        })
    return rows


# ============================================================================ CLI
def _parser() -> argparse.ArgumentParser:
    ap = usage.ArgumentParser(prog="ray-moe bench balance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("sim", "train"), default="sim",
                    help="sim: planner simulation (CPU); train: layer steps on a Ray group, cloning off vs on")
    ap.add_argument("--device", default="auto", help="train: auto, cuda, cpu")
    ap.add_argument("--transport", default="auto", help="train: auto, nvshmem, nccl, gloo")
    ap.add_argument("--address", default=None, help="train: Ray address")
    ap.add_argument("--dtype", default="bfloat16", help="train: bfloat16 or float32")
    ap.add_argument("--iters", type=int, default=10, help="train: timed steps per setting")
    ap.add_argument("--world-size", type=int, default=16)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--clone-slots", type=int, default=1)
    ap.add_argument("--max-cross-node-clones", type=int, default=-1)
    ap.add_argument("--zipf", type=float, nargs="+", default=[0.0, 0.8, 1.2])
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3, help="routers (hot positions) per s")
    ap.add_argument("--fresh-batches", type=int, default=2, help="fresh batches per router")
    ap.add_argument("--d-model", type=int, default=4096, help="for bytes per cloned expert")
    ap.add_argument("--expert-hidden", type=int, default=1536, help="for bytes per cloned expert")
    ap.add_argument("--bytes-per-param", type=int, default=2)
    ap.add_argument("--shift-steps", type=int, default=300)
    ap.add_argument("--shift-every", type=int, default=100)
    ap.add_argument("--shift-tokens-per-rank", type=int, default=1024)
    ap.add_argument("--interval", type=int, default=10, help="steps between re-plans")
    ap.add_argument("--ema", type=float, default=BalanceConfig().ema,
                    help="EMA factor per re-plan interval (balance.ema)")
    ap.add_argument("--recover-below", type=float, default=1.10)
    ap.add_argument("--no-shift", action="store_true", help="skip the shifting hot-set experiment")
    ap.add_argument("--json", type=str, default=None, help="write results to this JSON file")
    return ap


def run_train(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Real layer steps (forward, backward, clone coherence) on a Ray worker group with skewed
    routing whose hottest experts live on rank 0: cloning off vs on, per Zipf s."""
    from ray_moe.bench.ep_layer import STEP_TIMEOUT_S, StepSpec, time_layer_step
    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup
    from ray_moe.placement.planner import plan_placement, plan_report

    W, E = args.world_size, args.experts
    cfg = Config.from_dict({
        "model": {"d_model": args.d_model, "n_heads": 1, "dtype": args.dtype,
                  "seq_len": args.tokens_per_rank},  # sizes the NVSHMEM buffer
        "moe": {"num_experts": E, "top_k": args.top_k, "expert_hidden": args.expert_hidden},
        "parallel": {"world_size": W, "device": args.device, "transport": args.transport,
                     "cpu_per_worker": 0.5 if args.device == "cpu" else 1,
                     "placement_strategy": "SPREAD"},
        "train": {"batch_size": W},
    })
    rows = []
    with WorkerGroup(cfg, address=args.address) as group:
        node_of_rank = [r.node_rank for r in group.ranks]
        bytes_per_expert = 3 * args.d_model * args.expert_hidden * (2 if args.dtype == "bfloat16" else 4)
        for s in args.zipf:
            spec = StepSpec(tokens=args.tokens_per_rank, d_model=args.d_model, hidden=args.expert_hidden,
                            num_experts=E, top_k=args.top_k, dtype=args.dtype, iters=args.iters,
                            zipf_s=s, clone_slots=args.clone_slots)
            off = group.execute(time_layer_step, asdict(spec), timeout=STEP_TIMEOUT_S)
            source = np.array([r["expert_tokens"] for r in off])  # [W_src, E]
            placement = plan_placement(source.sum(0), W, node_of_rank, args.clone_slots,
                                       source_loads=source,
                                       max_cross_node_clones=args.max_cross_node_clones)
            report = plan_report(source, None, placement, bytes_per_expert, node_of_rank)
            on = group.execute(time_layer_step, dict(asdict(spec), placement=placement.to_dict()),
                               timeout=STEP_TIMEOUT_S)

            def worst(rs, key):
                return max(r[key] for r in rs)

            def imbalance(rs):
                pairs = [r["received_pairs"] for r in rs]
                return max(pairs) / (sum(pairs) / len(pairs)) if sum(pairs) else 1.0

            rows.append({
                "zipf_s": s, "world_size": W, "transport": group.transport_name,
                "step_ms_off": worst(off, "forward_backward_ms"), "step_ms_on": worst(on, "forward_backward_ms"),
                "speedup": worst(off, "forward_backward_ms") / worst(on, "forward_backward_ms"),
                "fwd_ms_off": worst(off, "forward_ms"), "fwd_ms_on": worst(on, "forward_ms"),
                "imbalance_off": imbalance(off), "imbalance_on": imbalance(on),
                "predicted_on": report["imbalance_after"], "clones": report["clones"],
                "clone_bytes": report["bytes_to_move"],
            })
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("world_size", "nodes", "experts", "top_k", "tokens_per_rank", "seeds", "fresh_batches",
                 "shift_steps", "shift_every", "shift_tokens_per_rank", "interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is larger than --experts {args.experts}")
    from tabulate import tabulate

    if args.mode == "train":
        if args.experts % args.world_size:
            parser.error(f"--experts {args.experts} is not divisible by --world-size {args.world_size}")
        rows = run_train(args)
        print(f"layer steps with Zipf-skewed routing (hot experts on rank 0): W={args.world_size}, "
              f"E={args.experts}, top-{args.top_k}, {args.tokens_per_rank} tokens/rank, "
              f"{args.clone_slots} clone slot(s)/rank; step = forward + backward + clone coherence")
        print(tabulate(rows, headers="keys", floatfmt=".3f"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"config": vars(args), "train": rows}, f, indent=2)
        return 0

    if args.world_size % args.nodes or args.experts % args.world_size:
        print(f"need world_size % nodes == 0 and experts % world_size == 0 (got W={args.world_size}, "
              f"nodes={args.nodes}, E={args.experts})", file=sys.stderr)
        return 2
    static = static_rows(args)
    print(f"planner simulation: W={args.world_size} in {args.nodes} nodes, E={args.experts}, "
          f"top-{args.top_k}, {args.clone_slots} clone slot(s)/rank, {args.tokens_per_rank} tokens/rank; "
          f"imbalance = max/mean tokens per rank")
    print(tabulate(static, headers="keys", floatfmt=".3f"))
    shifting = [] if args.no_shift else shifting_rows(args)
    if shifting:
        print(f"\nshifting hot set: new hot positions every {args.shift_every} steps, re-plan every "
              f"{args.interval} steps (EMA {args.ema}), recovered = step imbalance <= {args.recover_below}")
        print(tabulate(shifting, headers="keys", floatfmt=".3f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "static": static, "shifting": shifting}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
