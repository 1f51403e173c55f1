"""Cluster smoke test: is this Ray cluster ready to train ray_moe? (``ray-moe smoke --address ADDR``)

    ray-moe smoke --address HOST:PORT [--world-size W] [--device auto|cpu|cuda] [--steps N]
                  [--json PATH] [--timeout S] [--bandwidth-mib M]

Checks, in order, each printed as a table (node id, IP, GPU, rank, status, detail):

1. ``import`` / ``device`` / ``peer_access`` — a task pinned to every alive node
   (NodeAffinitySchedulingStrategy, all of the node's GPUs assigned) imports ray_moe and torch,
   and on GPU nodes checks that CUDA works (driver, memory, a matmul per GPU) and that every
   pair of the node's GPUs has peer access and copies intact;
2. ``bootstrap`` — a WorkerGroup (SPREAD) over all nodes: actors, torch.distributed and the
   transport come up, and the ranks span every node;
3. ``layer_parity`` — the EP layer against the single-process oracle on every rank, on random
   routings and the edge cases (one expert, an empty rank, an empty expert): fp32 on CPU
   (tolerance 1e-5), bf16 on GPU (1e-2);
4. ``transport`` — the transport validators (dispatch/combine, every edge case);
5. ``bandwidth`` — a rank i → rank j matrix in GB/s (torch.distributed send/recv);
6. ``training`` — a few Trainer steps on a tiny model, on the same group: every loss finite, the
   last below the first.

Writes everything as JSON (``--json``), ends with one summary line naming every failing check
with its node / GPU / rank, and exits 0 when everything passed, 1 when a check failed.
Runs on CPU clusters (gloo) as well as GPU clusters (NCCL / NVSHMEM).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import tempfile
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

from ray_moe import usage
from ray_moe.ops.smoke_report import (
    FAIL,
    PASS,
    SKIP,
    SmokeReport,
    condense_error,
    short_id,
)

LAYER_TOL = MappingProxyType({"float32": 1e-5, "bfloat16": 1e-2})
TRANSPORT_TOL = MappingProxyType({"float32": 1e-6, "bfloat16": 1e-2})  # the transport validators' own bounds
GROUP_CHECKS = ("layer_parity", "transport", "bandwidth", "training")


@dataclass
class SmokeOptions:
    address: str | None
    world_size: int | None
    device: str
    steps: int
    json: str | None
    timeout: float
    bandwidth_mib: float | None
    bandwidth_iters: int
    cpu_per_worker: float
    transport: str
    overrides: tuple[str, ...] = ()  # --set KEY=VALUE on top of the tiny model's config


def parse_args(argv: list[str] | None) -> SmokeOptions:
    p = usage.ArgumentParser(prog="ray-moe smoke", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: every GPU of the cluster; on CPU one per node)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--steps", type=int, default=6, help="training steps (0 = skip training)")
    p.add_argument("--json", default=None, help="write the full results here")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds for any one node probe, start-up or collective")
    p.add_argument("--bandwidth-mib", type=float, default=None,
                   help="message size of the bandwidth matrix (default 256 on GPU, 4 on CPU)")
    p.add_argument("--bandwidth-iters", type=int, default=3)
    p.add_argument("--cpu-per-worker", type=float, default=1.0)
    p.add_argument("--transport", default="auto", help="parallel.transport (auto|nvshmem|nccl|gloo)")
    p.add_overrides("the tiny model's checks and training run")
    a = p.parse_args(argv)
    opts = SmokeOptions(a.address, a.world_size, a.device, a.steps, a.json, a.timeout,
                        a.bandwidth_mib, a.bandwidth_iters, a.cpu_per_worker, a.transport, tuple(a.set))
    if opts.overrides:  # a bad override is the user's one-line error before any cluster work, not a failed check
        try:  # the device asked for: a GPU transport needs cuda or auto; the EP degree is checked at the
            # world size asked for (without one, when the group starts: its bootstrap check names it)
            check = opts if a.world_size else dataclasses.replace(
                opts, overrides=opts.overrides + ("parallel.expert_parallel=0",))
            smoke_config(a.world_size or 1, a.device, check, "unused")
        except ValueError as exc:  # ConfigError: names the key and what is allowed
            p.error(f"--set: {exc}")
    return opts


# ---------------------------------------------------------------------- 1. nodes
def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def node_gpus(node: dict[str, Any]) -> int:
    return int(node.get("Resources", {}).get("GPU", 0))


def probe_all_nodes(nodes: list[dict[str, Any]], timeout: float) -> list[dict[str, Any] | str]:
    """One pinned probe task per node; each result is the probe's dict or an error string."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_moe.ops import node_probe

    with node_probe.shipped_by_value():
        probe = ray.remote(node_probe.probe_node)
        refs = [
            probe.options(
                num_cpus=0, num_gpus=node_gpus(n), max_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
            ).remote()
            for n in nodes
        ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    out: list[dict[str, Any] | str] = []
    for ref in refs:
        if ref not in ready:
            ray.cancel(ref, force=True)
            out.append(f"the probe did not finish within {timeout:g}s (node busy, or its GPUs held by others?)")
            continue
        try:
            out.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - the node's failure is the result
            out.append(f"{type(exc).__name__}: {condense_error(str(exc))}")
    return out


def check_nodes(report: SmokeReport, nodes: list[dict[str, Any]], timeout: float) -> None:
    for node, probe in zip(nodes, probe_all_nodes(nodes, timeout)):
        where = {"node_id": node["NodeID"], "ip": node.get("NodeManagerAddress", "")}
        if isinstance(probe, str):
            report.add("import", FAIL, detail=probe, **where)
            continue
        error = probe.get("torch_error") or probe.get("import_error")
        if error:
            report.add("import", FAIL, detail=f"cannot import {'torch' if 'torch_error' in probe else 'ray_moe'}"
                       f" on this node: {error}", data=probe, **where)
        else:
            report.add("import", PASS, data=probe, **where,
                       detail=f"ray_moe {probe.get('ray_moe')}, torch {probe['torch']}, python {probe['python']}")
        if "torch" in probe:
            add_device_rows(report, node, probe, where)


def add_device_rows(report: SmokeReport, node: dict[str, Any], probe: dict[str, Any], where: dict) -> None:
    want = node_gpus(node)
    if want == 0:
        report.add("device", PASS, detail=f"CPU-only node (torch {probe['torch']})", **where)
        return
    if not probe.get("cuda_available") or probe.get("cuda_error"):
        report.add("device", FAIL, **where, detail=(
            f"Ray advertises {want} GPU(s) but CUDA is not usable: "
            f"{probe.get('cuda_error') or 'torch.cuda.is_available() is False'} "
            f"(torch {probe['torch']} built for CUDA {probe.get('torch_cuda')}, "
            f"CUDA_VISIBLE_DEVICES={probe.get('cuda_visible_devices')!r})"))
        return
    gpus = probe["gpus"]
    if len(gpus) != want:
        report.add("device", FAIL, **where, detail=f"Ray advertises {want} GPU(s) but the probe saw {len(gpus)}")
    for g in gpus:
        if "error" in g:
            report.add("device", FAIL, gpu=g["index"], detail=g["error"], data=g, **where)
        else:
            report.add("device", PASS, gpu=g["index"], data=g, **where, detail=(
                f"{g['name']} (sm {g['capability']}), driver {probe.get('driver')}, "
                f"{g['memory_free_gib']:.1f}/{g['memory_total_gib']:.1f} GiB free"))
    if len(gpus) == 1:
        report.add("peer_access", SKIP, gpu=0, detail="one GPU on this node: no peers", **where)
    for src in range(len(gpus) if len(gpus) > 1 else 0):
        pairs = [p for p in probe["peers"] if p["src"] == src]
        bad = [p for p in pairs if p.get("error") or not p.get("can_access") or not p.get("copy_ok")]
        if bad:
            report.add("peer_access", FAIL, gpu=src, data={"pairs": pairs}, **where, detail="; ".join(
                f"→ GPU {p['dst']}: " + (p.get("error") or ("no peer access" if not p.get("can_access")
                                                          else "copy arrived corrupted"))
                for p in bad))
        else:
            report.add("peer_access", PASS, gpu=src, data={"pairs": pairs}, **where,
                       detail=f"peer access and intact copies to {len(pairs)} GPU(s)")


# ---------------------------------------------------------------------- 2. group checks
def smoke_config(world_size: int, device: str, opts: SmokeOptions, run_dir: str):
    """A tiny model on ``world_size`` ranks: small enough for 2 CPU cores, same code paths as a real run
    (``model.compile: auto`` compiles its blocks on CUDA, as a run's would; ``--set model.compile=none``
    checks the eager ones), then ``opts.overrides``."""
    from ray_moe.config import Config

    experts = world_size * math.ceil(8 / world_size)
    return Config.from_dict({
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 32,
                  "dtype": "bfloat16" if device == "cuda" else "float32"},
        "moe": {"num_experts": experts, "top_k": 2, "expert_hidden": 48},
        "parallel": {"world_size": world_size, "device": device, "transport": opts.transport,
                     "cpu_per_worker": opts.cpu_per_worker, "placement_strategy": "SPREAD",
                     "startup_timeout_s": opts.timeout, "collective_timeout_s": opts.timeout},
        "data": {"max_bytes": 200_000, "val_fraction": 0.1},
        "train": {"steps": max(1, opts.steps), "batch_size": 2 * world_size, "lr": 1e-2,
                  "warmup_steps": 0, "eval_batches": 1, "run_dir": run_dir, "resume": False,
                  "plots": False, "step_timeout_s": opts.timeout},
    }).with_overrides(opts.overrides)


def rank_where(r: Any) -> dict[str, Any]:
    return {"node_id": r.node_id, "ip": r.ip, "gpu": r.gpu_id if r.gpu_id >= 0 else None, "rank": r.rank}


def start_group(report: SmokeReport, config: Any, nodes: list[dict[str, Any]], device: str):
    """The ``bootstrap`` check: a WorkerGroup that spans the nodes. Returns it, or None."""
    from ray_moe.config import ConfigError
    from ray_moe.driver.group import GroupError, WorkerGroup

    try:
        group = WorkerGroup(config)
    except ConfigError as exc:  # the rank mesh cannot lie on these nodes (parallel.expert_parallel)
        report.add("bootstrap", FAIL, detail=f"the worker group did not start: {exc}", data={"error": str(exc)})
        return None
    except GroupError as exc:
        broken = [short_id(r.node_id) for r in report.results if r.check == "import" and r.status == FAIL]
        hint = f" (import failed on node {', '.join(broken)})" if broken else ""
        report.add("bootstrap", FAIL, detail=f"the worker group did not start{hint}: {condense_error(str(exc))}",
                   data={"error": str(exc)})
        return None
    for r in group.ranks:
        dp_rank, ep_rank = group.mesh.coords(r.rank)
        report.add("bootstrap", PASS, **rank_where(r), data=r.to_dict() | {"dp_rank": dp_rank, "ep_rank": ep_rank},
                   detail=f"transport {group.transport_name}, pid {r.pid}, local rank {r.local_rank}, "
                          f"EP rank {ep_rank} of EP group {dp_rank} ({group.mesh})")
    usable = {n["NodeID"] for n in nodes
              if (node_gpus(n) if device == "cuda" else n["Resources"].get("CPU", 0)) >= 1}
    spanned = {r.node_id for r in group.ranks}
    missing = usable - spanned
    if missing and group.world_size >= len(usable):
        report.add("bootstrap", FAIL, detail=f"the group spans {len(spanned)} of {len(usable)} usable nodes; "
                   f"missing: {', '.join(sorted(m[:8] for m in missing))}")
    return group


def per_rank_errors(report: SmokeReport, check: str, group: Any,
                    runs: list[tuple[str, Callable, Any]], tol: float, extract: Callable) -> None:
    """Run each (label, fn, case) on every rank; one row per rank with its worst error. Cases
    that cannot run at this world size (an empty rank needs two ranks) are left out and named."""
    worst = [0.0] * group.world_size
    bad: list[list[str]] = [[] for _ in range(group.world_size)]
    errors: list[dict[str, dict]] = [{} for _ in range(group.world_size)]
    ep = group.mesh.ep if getattr(group, "mesh", None) else group.world_size  # each EP group runs a case alone
    skipped = [f"{label} ({why})" for label, _, case in runs if (why := case.applies_to(ep))]
    runs = [run for run in runs if run[2].applies_to(ep) is None]
    for label, fn, case in runs:
        for rank, res in enumerate(group.execute(fn, case, timeout=report.info["timeout"])):
            errs = extract(res)
            errors[rank][label] = errs
            for name, v in errs.items():
                worst[rank] = max(worst[rank], v) if not math.isnan(v) else math.inf
                if not v <= tol:
                    bad[rank].append(f"{label}: {name}={v:.3g}")
    for r in group.ranks:
        ok = not bad[r.rank]
        detail = (f"{len(runs)} case(s), worst rel. error {worst[r.rank]:.2e} <= {tol:g}" if ok
                  else f"{len(bad[r.rank])} error(s) over {tol:g}: " + "; ".join(bad[r.rank][:4]))
        if skipped:
            detail += f"; not run at EP {ep}: " + ", ".join(sorted(set(skipped)))
        report.add(check, PASS if ok else FAIL, **rank_where(r), detail=detail,
                   data={"tolerance": tol, "errors": errors[r.rank], "not_run": skipped})


def check_layer_parity(report: SmokeReport, group: Any, config: Any) -> None:
    from ray_moe.validation import ROUTINGS, Case
    from ray_moe.validation.layer import layer_parity

    dtype = config.model.dtype
    base = Case(num_experts=group.arch.spec.num_experts, top_k=2, hidden=32, expert_hidden=48, dtype=dtype)
    runs = [(routing, layer_parity, base.but(routing=routing)) for routing in ROUTINGS]
    runs.append(("random,uneven", layer_parity, base.but(routing="random", seed=1, tokens_per_rank=(3, 17))))
    per_rank_errors(report, "layer_parity", group, runs, LAYER_TOL[dtype], lambda res: res)


def check_transport(report: SmokeReport, group: Any, config: Any) -> None:
    from ray_moe.validation import EDGE_CASES, Case
    from ray_moe.validation.transport import check_combine, check_dispatch

    dtype = config.model.dtype
    base = Case(num_experts=group.arch.spec.num_experts, dtype=dtype)
    runs = []
    for extra in EDGE_CASES:
        case = base.but(**extra)
        label = ",".join(f"{k}={v}" for k, v in extra.items())
        runs += [(f"dispatch[{label}]", check_dispatch, case), (f"combine[{label}]", check_combine, case)]
    per_rank_errors(report, "transport", group, runs, TRANSPORT_TOL[dtype], lambda res: res["errors"])


def check_bandwidth(report: SmokeReport, group: Any, opts: SmokeOptions) -> None:
    from ray_moe.ops.bandwidth import pair_bandwidth

    if group.world_size < 2:
        report.add("bandwidth", SKIP, detail="skipped: one rank, no pair of ranks to measure")
        return
    mib = opts.bandwidth_mib or (256.0 if group.use_gpu else 4.0)
    nbytes = int(mib * 2**20)
    rows = group.execute(pair_bandwidth, nbytes, opts.bandwidth_iters, timeout=report.info["timeout"] * 4)
    labels = [f"{r.rank}: {r.node_id[:8]}/{'cpu' if r.gpu_id < 0 else r.gpu_id}" for r in group.ranks]
    report.bandwidth = {"labels": labels, "gbps": rows, "bytes": nbytes, "iters": opts.bandwidth_iters}
    for r in group.ranks:
        for dst, gbps in enumerate(rows[r.rank]):
            if dst == r.rank:
                continue
            ok = gbps is not None and gbps > 0 and math.isfinite(gbps)
            report.add("bandwidth", PASS if ok else FAIL, **rank_where(r), data={"dst": dst, "gbps": gbps},
                       detail=f"→ rank {dst} ({group.ranks[dst].node_id[:8]}): "
                              + (f"{gbps:.2f} GB/s" if ok else f"no valid measurement ({gbps})"))


def check_training(report: SmokeReport, config: Any, steps: int, group: Any) -> None:
    from ray_moe.driver.trainer import Trainer

    losses: list[float] = []
    records: list[dict] = []
    with Trainer(config, progress=False, group=group) as trainer:
        for _ in range(steps):
            records.append(trainer.step())
            losses.append(float(records[-1]["loss"]))
        val = float(trainer.evaluate())
    finite = all(math.isfinite(x) for x in losses + [val])
    falls = len(losses) >= 2 and losses[-1] < losses[0]
    detail = f"loss {losses[0]:.3f} → {losses[-1]:.3f} over {steps} steps, val {val:.3f}"
    if not finite:
        detail = "non-finite loss: " + detail
    elif not falls:
        detail = "the loss did not fall: " + detail
    report.add("training", PASS if finite and falls else FAIL, detail=detail,
               data={"losses": losses, "val_loss": val, "world_size": group.world_size, "mesh": str(group.mesh),
                     # rows move inside an EP group: the balance that matters is each group's
                     "imbalance_per_group": records[-1].get("imbalance_per_group") if records else None,
                     "replica_reduce_s": max((r.get("replica_reduce_max", 0.0) for r in records), default=0.0)})


def run_group_checks(report: SmokeReport, group: Any, config: Any, opts: SmokeOptions) -> str | None:
    """Checks on the live group; returns the name of the check that broke the group, or None."""
    from ray_moe.driver.group import WorkerFailure

    steps: list[tuple[str, Callable[[], None]]] = [
        ("layer_parity", lambda: check_layer_parity(report, group, config)),
        ("transport", lambda: check_transport(report, group, config)),
        ("bandwidth", lambda: check_bandwidth(report, group, opts)),
    ]
    for name, run in steps:
        try:
            run()
        except WorkerFailure as exc:
            where = rank_where(group.ranks[exc.rank]) if exc.rank is not None else {}
            report.add(name, FAIL, **where, detail=f"{exc.cause}: {condense_error(str(exc))}",
                       data={"error": str(exc)})
            return name
    return None


def skip_rest(report: SmokeReport, checks: tuple[str, ...], why: str) -> None:
    for check in checks:
        report.add(check, SKIP, detail=why)


# ---------------------------------------------------------------------- driver
def resolve(opts: SmokeOptions, nodes: list[dict[str, Any]]) -> tuple[str, int]:
    """(device, world size) from the options and the cluster's resources."""
    gpus = sum(node_gpus(n) for n in nodes)
    device = opts.device if opts.device != "auto" else ("cuda" if gpus else "cpu")
    world = opts.world_size or (gpus if device == "cuda" else len(nodes))
    return device, max(1, world)


def run_smoke(opts: SmokeOptions) -> SmokeReport:
    import ray

    report = SmokeReport(info={"address": opts.address, "timeout": opts.timeout})
    from ray_moe.connect import ConnectError, connect

    try:  # the address and token checked first: one line within seconds, no Ray retry output
        connect(opts.address, timeout_s=min(opts.timeout, 30.0), log_to_driver=False, logging_level="WARNING")
    except ConnectError as exc:
        report.add("connect", FAIL, detail=condense_error(str(exc)), data={"error": str(exc)})
        return report
    run_dir = tempfile.mkdtemp(prefix="ray-moe-smoke-")
    try:
        nodes = alive_nodes()
        device, world = resolve(opts, nodes)
        report.info |= {"nodes": len(nodes), "device": device, "world_size": world,
                        "ray": ray.__version__, "cluster_resources": ray.cluster_resources()}
        check_nodes(report, nodes, opts.timeout)
        config = smoke_config(world, device, opts, run_dir)
        report.info["config"] = config.to_dict()
        group = start_group(report, config, nodes, device)
        if group is None:
            skip_rest(report, GROUP_CHECKS, "skipped: the worker group did not start")
            return report
        try:
            report.info["transport"] = group.transport_name
            report.info["mesh"] = group.mesh.to_dict()
            broken = run_group_checks(report, group, config, opts)
            if broken:
                skip_rest(report, GROUP_CHECKS[GROUP_CHECKS.index(broken) + 1:],
                          f"skipped: the group failed in {broken}")
            elif opts.steps > 0:
                run_training(report, config, opts.steps, group)
            else:
                skip_rest(report, ("training",), "skipped: --steps 0")
        finally:
            group.close()
        return report
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        ray.shutdown()


def run_training(report: SmokeReport, config: Any, steps: int, group: Any) -> None:
    from ray_moe.driver.group import GroupError
    from ray_moe.driver.trainer import TrainingError

    try:
        check_training(report, config, steps, group)
    except (GroupError, TrainingError) as exc:
        report.add("training", FAIL, detail=f"{type(exc).__name__}: {condense_error(str(exc))}",
                   data={"error": str(exc)})


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    report = run_smoke(opts)
    print(report.render(), flush=True)
    if opts.json:
        report.write_json(opts.json)
        print(f"\nresults: {opts.json}")
    print("\n" + report.summary_line(), flush=True)
    return 0 if report.ok else 1
