"""``ray-moe bench curve``: loss curves of config variants trained side by side from one seed on
one device (e.g. bf16 against FP8 experts), with the final-loss difference.

    ray-moe bench curve --preset qwen3-30b-a3b --layers 2 --steps 1000 --tokens 16384 --seq-len 2048 \\
        --dataset data/stdlib --tokenizer tok/stdlib --out curve/ \\
        --variants "bf16=;fp8=moe.expert_precision=fp8"

Each variant (``NAME=KEY=VALUE,KEY=VALUE``; ``;`` between variants; the first is the reference)
is the base config (the preset at ``--layers`` layers, ``--experts`` routed experts, the
vocabulary of ``--dataset``'s tokenizer, one rank) with its overrides on top. Every variant is an
:class:`~ray_moe.worker.engine.Engine` on one rank with a
:class:`~ray_moe.comm.local.LocalTransport`: what ``ray-moe train`` runs in its one actor on one
GPU, without Ray's per-step actor call, the checkpoints and the evaluation that a run adds; the
loss is the number the trainer logs (``Engine.train_step``). The engines live together and take
their steps in turn (step s of every variant, then s + 1), so they see the same batches in the
same order (a batch is a function of the seed and the step) from the same initial weights (the
model's own generator, seeded by ``train.seed``), and a run stopped by ``--time-limit-s`` still
leaves curves of one length.

Writes to ``--out``: ``curve.csv`` (step, then each variant's training loss; rewritten every
``--log-every`` steps, so a killed run keeps its curve so far), ``curve.json`` (setup, per
variant: first step's seconds, compilation included; median step ms; the mean loss over the last
``--tail`` steps (non-finite ones left out, and counted with the skipped steps); its relative
difference from the reference; the validation loss over ``--eval-batches`` batches at the end
and its difference) and, where matplotlib imports,
``curve.png`` (the curves, their ``--smooth``-step moving averages, and the smoothed relative
difference in percent). ``--target-pct`` (default 0.25, DeepSeek-V3's FP8 against bf16) is
what the summary line checks the tail's difference against.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ray_moe import usage
from ray_moe.bench.common import free, missing_device, one_rank, pick_device

if TYPE_CHECKING:
    from ray_moe.config import Config


def parse_variants(text: str) -> list[tuple[str, list[str]]]:
    """``"bf16=;fp8=moe.expert_precision=fp8,model.dense_precision=fp8"`` → [(name, overrides)].
    Raises ValueError naming the bad part (names unique and non-empty, overrides KEY=VALUE)."""
    out: list[tuple[str, list[str]]] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, eq, rest = part.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ValueError(f"variant {part!r} must look like NAME=KEY=VALUE,... (NAME= for the base config)")
        if name in (n for n, _ in out):
            raise ValueError(f"variant name {name!r} is given twice")
        overrides = [o.strip() for o in rest.split(",") if o.strip()]
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"variant {name!r}: override {bad[0]!r} must look like section.key=value")
        out.append((name, overrides))
    if len(out) < 1:
        raise ValueError(f"--variants {text!r} names no variant")
    return out


def dataset_vocab(dataset: str) -> int:
    """The vocabulary of a prepared dataset's tokenizer (its ``meta.json``; ``ray-moe prepare``)."""
    meta = Path(dataset).expanduser() / "meta.json"
    try:
        return int(json.loads(meta.read_text())["tokenizer"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--dataset {dataset}: {meta} is missing or unreadable ({exc}); give a directory "
                         "that ray-moe prepare finished") from None


def base_config(args: argparse.Namespace) -> "Config":
    """The preset at ``args.layers`` layers as a one-rank training config on ``args.dataset``."""
    from ray_moe.bench.train import expert_cut
    from ray_moe.config import Config

    vocab = -(-dataset_vocab(args.dataset) // 128) * 128  # the tokenizer's, rounded for the head's GEMMs
    hf = {"num_hidden_layers": args.layers, "vocab_size": vocab, **expert_cut(args.preset, args.experts)}
    keys = [
        f"model.hf_config={args.preset}", f"model.hf={json.dumps(hf)}", f"model.seq_len={args.seq_len}",
        f"model.dtype={args.dtype}", "parallel.world_size=1", f"parallel.device={args.device}",
        f"data.datasets={args.dataset}", f"train.batch_size={max(1, args.tokens // args.seq_len)}",
        f"train.steps={args.steps}", f"train.warmup_steps={args.warmup_steps}", f"train.lr={args.lr}",
        f"train.seed={args.seed}", f"train.eval_batches={max(1, args.eval_batches)}", "train.plots=false",
        *([f"data.tokenizer={args.tokenizer}"] if args.tokenizer else []), *args.set,
    ]
    return Config().with_overrides(keys)


def _checksum(engine: Any) -> float:
    """A float64 sum over every parameter's values: equal for engines built from one seed."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in engine.model.parameters()))


def tail_mean(losses: list[float], tail: int) -> float:
    """Mean of the last ``tail`` finite losses (NaN when none)."""
    last = [v for v in losses[-tail:] if math.isfinite(v)]
    return statistics.fmean(last) if last else math.nan


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (fewer at the start)."""
    out, run = [], 0.0
    for i, v in enumerate(values):
        run += v
        if i >= window:
            run -= values[i - window]
        out.append(run / min(i + 1, window))
    return out


def write_csv(path: Path, names: list[str], losses: dict[str, list[float]]) -> None:
    """``path``: a row per step (the steps every variant has taken), a column per variant; written
    beside and renamed over, so a reader never sees half a file."""
    n = min(len(losses[name]) for name in names)
    tmp = path.with_suffix(".csv.partial")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *names])
        for i in range(n):
            w.writerow([i + 1, *(f"{losses[name][i]:.6f}" for name in names)])
    tmp.replace(path)


def plot(path: Path, names: list[str], losses: dict[str, list[float]], smooth: int, title: str) -> str | None:
    """``curve.png``: the curves and their moving averages, and the smoothed difference from the
    first in percent. Returns why not where matplotlib does not import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib does not import ({exc})"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    ref = moving_average(losses[names[0]], smooth)
    for i, name in enumerate(names):
        steps = range(1, len(losses[name]) + 1)
        avg = moving_average(losses[name], smooth)
        color = f"C{i}"
        top.plot(steps, losses[name], color=color, alpha=0.25, linewidth=0.6)
        top.plot(steps, avg, color=color, label=f"{name} ({smooth}-step mean)")
        if i:
            bottom.plot(steps, [100 * (a / r - 1) for a, r in zip(avg, ref)], color=color, label=f"{name} vs {names[0]}")
    top.set_ylabel("training loss (nats/token)")
    top.set_title(title, fontsize=9)
    top.legend()
    top.grid(alpha=0.3)
    bottom.axhline(0, color="k", linewidth=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("difference (%)")
    bottom.grid(alpha=0.3)
    if len(names) > 1:
        bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = usage.ArgumentParser(prog="ray-moe bench curve", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", help="model.hf_config: an HF preset, config.json or directory")
    p.add_argument("--layers", type=int, default=2, help="num_hidden_layers")
    p.add_argument("--experts", type=int, default=0, help="cut the routed experts to this many (0: the preset's)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (train.batch_size = tokens / seq-len)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (linear warm-up, cosine to 10 %%)")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="auto", help="auto, cuda, cpu")
    p.add_argument("--dataset", required=True, help="a dataset directory from ray-moe prepare")
    p.add_argument("--tokenizer", default="", help="its tokenizer directory (data.tokenizer: checked against it)")
    p.add_argument("--variants", default="bf16=;fp8=moe.expert_precision=fp8",
                   help="NAME=KEY=VALUE,KEY=VALUE;NAME=... (NAME= alone: the base config; the first is the reference)")
    p.add_overrides("every variant")
    p.add_argument("--out", required=True, help="directory for curve.csv, curve.json and curve.png")
    p.add_argument("--tail", type=int, default=50, help="steps the final loss is averaged over")
    p.add_argument("--smooth", type=int, default=20, help="moving-average window of the plot")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches at the end (0: none)")
    p.add_argument("--target-pct", type=float, default=0.25, help="the tail's relative difference to check (%%)")
    p.add_argument("--log-every", type=int, default=50, help="steps between progress lines and CSV rewrites")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="stop every variant at the same step once this many seconds have passed (0: none)")
    args = p.parse_args(argv)
    for key in ("layers", "steps", "tokens", "seq_len", "tail", "smooth", "log_every"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    for key in ("experts", "warmup_steps", "eval_batches"):
        if getattr(args, key) < 0:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 0")
    if args.tokens < args.seq_len:
        p.error(f"--tokens={args.tokens} must be at least --seq-len={args.seq_len} (one sequence)")
    try:
        args.variant_list = parse_variants(args.variants)
        dataset_vocab(args.dataset)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _build(cfg: Any, device: torch.device) -> Any:
    from ray_moe.comm.local import LocalTransport
    from ray_moe.worker.engine import Engine

    return Engine(cfg, one_rank(device), LocalTransport(), device, cfg.resolve_arch())


def _setup(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    setup = {"args": {k: v for k, v in vars(args).items() if k != "variant_list"},
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
             "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        setup["triton"] = triton.__version__
    except ImportError:
        pass
    return setup


def _run(engines: dict[str, Any], names: list[str], args: argparse.Namespace, out: Path
         ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, int], int | None]:
    """Step every engine in turn (step s of each, then s + 1) for ``args.steps`` steps or until
    ``args.time_limit_s``; a progress line and ``curve.csv`` every ``args.log_every`` steps.
    Returns (losses, step seconds, skipped steps per variant, the step where the time limit
    stopped them or None); a non-finite loss is NaN."""
    losses: dict[str, list[float]] = {n: [] for n in names}
    step_s: dict[str, list[float]] = {n: [] for n in names}
    skipped = {n: 0 for n in names}
    t0 = time.perf_counter()
    for step in range(args.steps):
        for name in names:
            rec = engines[name].train_step()
            losses[name].append(float(rec["loss"]) if not rec["nonfinite"] else math.nan)
            step_s[name].append(rec["time"]["step"])
            skipped[name] += bool(rec["skipped"])
        done = step + 1
        elapsed = time.perf_counter() - t0
        if done % args.log_every == 0 or done == args.steps or done == 1:
            write_csv(out / "curve.csv", names, losses)
            ref = tail_mean(losses[names[0]], args.log_every)
            cols = "  ".join(f"{n} {tail_mean(losses[n], args.log_every):.4f} "
                             f"({1e3 * statistics.median(step_s[n][-args.log_every:]):.0f} ms"
                             + (f", {100 * (tail_mean(losses[n], args.log_every) / ref - 1):+.2f} %)" if i else ")")
                             for i, n in enumerate(names))
            eta = elapsed / done * (args.steps - done)
            print(f"step {done}/{args.steps}  {cols}  {elapsed:.0f} s, eta {eta:.0f} s", flush=True)
        if args.time_limit_s and elapsed > args.time_limit_s and done < args.steps:
            print(f"# --time-limit-s {args.time_limit_s:g} passed: every variant stops at step {done}", flush=True)
            return losses, step_s, skipped, done
    return losses, step_s, skipped, None


def _summary_line(name: str, r: dict[str, Any], reference: str, args: argparse.Namespace) -> str:
    """One variant's summary: its final (tail) loss and, but for the reference, the relative
    difference from the reference's and whether it is within ``args.target_pct``."""
    ref = name == reference
    return (f"{name}: final loss (mean of the last {min(args.tail, r['steps'])} steps) {r['final_loss']:.4f}"
            + ("" if ref else f", {r['final_loss_rel_diff_pct']:+.3f} % vs {reference} (within {args.target_pct:g} %: "
               f"{'yes' if abs(r['final_loss_rel_diff_pct']) <= args.target_pct else 'no'})")
            + (f"; validation {r['val_loss']:.4f}" if "val_loss" in r else "")
            + (f" ({r['val_loss_rel_diff_pct']:+.3f} %)" if "val_loss" in r and not ref else "")
            + f"; median step {r['median_step_ms']:.1f} ms, first {r['first_step_s']:.1f} s")


def main(argv: list[str]) -> int:
    """CLI entry (``ray-moe bench curve ...``). Returns the exit code."""
    from ray_moe.config import ConfigError

    args = parse_args(argv)
    device = pick_device(args.device)
    error = missing_device("ray-moe bench curve", device)
    if error:
        print(error, file=sys.stderr)
        return 2
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    base = base_config(args)
    configs = []
    for name, overrides in args.variant_list:
        try:
            configs.append((name, base.with_overrides(overrides)))
        except ConfigError as exc:
            raise ConfigError(f"variant {name!r}: {exc}") from None
    names = [n for n, _ in configs]
    start = time.perf_counter()
    engines, checksums = {}, {}
    for name, cfg in configs:
        engines[name] = _build(cfg, device)
        checksums[name] = _checksum(engines[name])
    spec = engines[names[0]].model.spec
    print(f"# {args.preset}: {spec.num_layers} layers, H={spec.hidden_size}, {spec.num_experts} experts of "
          f"{spec.expert_hidden}, top-{spec.top_k}, vocab {spec.vocab_size}; {args.tokens} tokens/step "
          f"({base.train.batch_size} x {args.seq_len}), {args.steps} steps, lr {args.lr:g}, seed {args.seed}; "
          f"built in {time.perf_counter() - start:.1f} s", flush=True)
    losses, step_s, skipped, stopped_at = _run(engines, names, args, out)
    write_csv(out / "curve.csv", names, losses)
    ref_tail = tail_mean(losses[names[0]], args.tail)
    nb = args.eval_batches
    evals = {n: engines[n].eval_mean(engines[n].eval_sum(0, nb), nb) for n in names} if nb else {}
    summary: dict[str, Any] = {}
    for name in names:
        tail = tail_mean(losses[name], args.tail)
        first = step_s[name][0] if step_s[name] else math.nan
        row = {"steps": len(losses[name]), "first_step_s": first,
               "median_step_ms": 1e3 * statistics.median(step_s[name][1:] or step_s[name]),
               "final_loss": tail, "final_loss_rel_diff_pct": 100 * (tail / ref_tail - 1),
               "skipped_steps": skipped[name], "nonfinite_steps": sum(math.isnan(v) for v in losses[name]),
               "init_checksum": checksums[name]}
        if name in evals:
            row.update(val_loss=evals[name], val_loss_rel_diff_pct=100 * (evals[name] / evals[names[0]] - 1))
        summary[name] = row
    title = (f"{args.preset}, {spec.num_layers} layers, {spec.num_experts} experts, {args.tokens} tokens/step, "
             f"seed {args.seed} ({', '.join(names)})")
    note = plot(out / "curve.png", names, losses, args.smooth, title)
    result = {"setup": _setup(args, device), "reference": names[0], "tail_steps": args.tail,
              "target_pct": args.target_pct, "stopped_at": stopped_at,
              "same_init": len(set(checksums.values())) == 1, "variants": summary, "plot": note or "curve.png",
              "wall_s": time.perf_counter() - start}
    (out / "curve.json").write_text(json.dumps(result, indent=1, default=str))
    for name in names:
        print(_summary_line(name, summary[name], names[0], args), flush=True)
    print(f"same initial weights: {result['same_init']}; {note or 'plot: ' + str(out / 'curve.png')}; "
          f"wrote {out / 'curve.csv'}, {out / 'curve.json'}", flush=True)
    for engine in engines.values():
        engine.close()
    engines.clear()
    free(device)
    return 0
