"""``ray-moe bench precision``: the training step's breakdown with the old and the new optimizer,
and the LM loss's time and memory at a real vocabulary.

Sections (``--sections``):

step   One rank (W = 1) through ``Engine.train_step`` with ``LocalTransport``: what ``ray-moe train``
       runs on one GPU, without Ray's per-step call (~1 % of the step). Variants, side by side in
       one process (each engine freed before the next is built):
         old          bf16 parameters updated by AdamW directly, one tensor at a time
                      (``train.master_weights=false train.optimizer_impl=for_loop``)
         new          float32 masters and AdamW state, ``train.optimizer_impl=auto`` (the one-pass
                      kernel for every bf16 parameter on CUDA), updated in place
         new_fused    the same through torch's fused AdamW (float32 gradient copies)
         new_foreach  the same with foreach AdamW (what runs where the fused kernel does not)
         bf16_moments float32 masters, bf16 AdamW moments (``train.optimizer_state_dtype=bfloat16``):
                      every parameter through the one-pass kernel
         *_overlap    a variant with ``train.overlap_update=true`` (the default): the update on a
                      side stream beside the next step's forward (CUDA); the others update in place
       Columns: medians over ``--iters`` steps after ``--warmup``; optimizer = grad_sync (master
       gradients, cross-rank reduction, norm) + update (clipping, AdamW, masters → parameters).
       ``optimizer_exposed_pct``: the optimizer's share of the step that nothing hides. In place it
       is ``optimizer_pct``; for an ``*_overlap`` variant, whose update runs inside the next step's
       forward, it is its step minus its base variant's step without the optimizer
       (``step - (base step - base optimizer)``), so the base must run in the same call.
curve  ``--curve-steps`` training steps (default 300) of the same model and data with float32 and
       with bf16 AdamW moments (variants ``new`` and ``bf16_moments``): every step's loss, and the
       largest gap of their ``--curve-window``-step running means (the 300-step comparison
       that decides whether bf16 moments can become a default).
loss   ``lm_loss`` forward+backward at N tokens, vocabulary V, hidden H (bf16): the full fp32 logits
       (``F.cross_entropy``), chunked, and Liger-Kernel's fused kernel
       when it imports; peak memory above the inputs, and each one's loss and gradients against
       the full-logits result when that fits.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from ray_moe import usage
from ray_moe.bench.common import free, one_rank, peak_gib, pick_device, reset_peak

IN_PLACE, BESIDE = "train.overlap_update=false", "train.overlap_update=true"
VARIANTS = MappingProxyType({  # step variant → config overrides
    "old": ("train.master_weights=false", "train.optimizer_impl=for_loop", IN_PLACE),
    "new": (IN_PLACE,),  # optimizer_impl auto: onepass on CUDA
    "new_fused": ("train.optimizer_impl=fused", IN_PLACE),
    "new_foreach": ("train.optimizer_impl=foreach", IN_PLACE),
    "bf16_moments": ("train.optimizer_state_dtype=bfloat16", IN_PLACE),  # every parameter through the one-pass kernel
    "new_overlap": (BESIDE,),  # the update beside the next forward (the default)
    "bf16_moments_overlap": ("train.optimizer_state_dtype=bfloat16", BESIDE),
})
OVERLAP = "_overlap"
TIME_KEYS = ("forward", "backward", "optimizer", "grad_sync", "update", "step")


# ============================================================================ step
def step_config(args: argparse.Namespace, variant: str):
    """The real shape as a training config (bf16, one rank, byte-level data) plus the variant's keys."""
    from ray_moe.config import Config

    batch = max(1, args.tokens // args.seq_len)
    base = [
        f"model.n_layers={args.layers}", f"model.d_model={args.d_model}", f"model.n_heads={args.heads}",
        f"model.seq_len={args.seq_len}", f"model.dtype={args.dtype}",
        f"moe.num_experts={args.experts}", f"moe.top_k={args.top_k}", f"moe.expert_hidden={args.expert_hidden}",
        "moe.aux_loss_coef=0.001", "parallel.world_size=1", f"parallel.device={args.device}",
        f"data.max_bytes={args.max_bytes}", f"train.batch_size={batch}", "train.steps=1000",
        "train.warmup_steps=0", "train.lr=3e-4", "train.grad_clip=1.0", "train.plots=false",
    ]
    if args.data_paths:
        base.append(f"data.paths={json.dumps(args.data_paths)}")
    return Config().with_overrides([*base, *VARIANTS[variant], *args.set])


def step_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ray_moe.comm.local import LocalTransport
    from ray_moe.worker.engine import Engine

    device = pick_device(args.device)
    rank_info = one_rank(device)
    rows = []
    for variant in args.variants:
        cfg = step_config(args, variant)
        t0 = time.perf_counter()
        engine = Engine(cfg, rank_info, LocalTransport(), device, cfg.resolve_arch())
        built = time.perf_counter() - t0
        for _ in range(args.warmup):
            engine.train_step()
        base = reset_peak(device)
        results = [engine.train_step() for _ in range(args.iters)]
        med = {k: 1e3 * statistics.median(r["time"][k] for r in results) for k in TIME_KEYS}
        params = sum(p.numel() for p in engine.model.parameters())
        rows.append({
            "variant": variant, **{f"{k}_ms": v for k, v in med.items()},
            "optimizer_pct": 100 * med["optimizer"] / med["step"],
            "tokens": results[-1]["tokens"], "params": params, "optimizer_impl": engine.optimizer.impl,
            "master_weights": cfg.train.master_weights, "loss_impl": engine.loss_impl,
            "last_loss": results[-1]["loss"], "peak_gib": peak_gib(device), "in_use_gib": base / 2**30,
            "build_s": built,
        })
        print(f"  step {variant}: {med['step']:.1f} ms, optimizer {med['optimizer']:.1f} ms", flush=True)
        del engine, results
        free(device)
    return exposed_optimizer(rows)


def exposed_optimizer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``optimizer_exposed_ms``/``_pct`` to step rows (see the module docstring): an
    ``*_overlap`` row's step minus its base row's step without the optimizer; None where the base
    did not run."""
    by = {r["variant"]: r for r in rows}
    for r in rows:
        exposed = r["optimizer_ms"]
        if r["variant"].endswith(OVERLAP):
            base = by.get(r["variant"][: -len(OVERLAP)])
            exposed = None if base is None else r["step_ms"] - (base["step_ms"] - base["optimizer_ms"])
        r["optimizer_exposed_ms"] = exposed
        r["optimizer_exposed_pct"] = None if exposed is None else 100 * exposed / r["step_ms"]
    return rows


# ============================================================================ curve
def curve_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per moment dtype: its losses over ``args.curve_steps`` steps (same seed and data)."""
    from ray_moe.comm.local import LocalTransport
    from ray_moe.worker.engine import Engine

    device = pick_device(args.device)
    rank_info = one_rank(device)
    rows = []
    for variant in ("new", "bf16_moments"):
        cfg = step_config(args, variant).with_overrides([f"train.steps={args.curve_steps}"])
        torch.manual_seed(cfg.train.seed)
        engine = Engine(cfg, rank_info, LocalTransport(), device, cfg.resolve_arch())
        losses = [engine.train_step()["loss"] for _ in range(args.curve_steps)]
        rows.append({"variant": variant, "moments": cfg.train.optimizer_state_dtype, "losses": losses,
                     "first": losses[0], "last_window_mean": statistics.fmean(losses[-args.curve_window:])})
        print(f"  curve {variant}: loss {losses[0]:.4f} -> {rows[-1]['last_window_mean']:.4f}", flush=True)
        del engine
        free(device)
    w = args.curve_window
    means = [[statistics.fmean(r["losses"][i - w:i]) for i in range(w, len(r["losses"]) + 1)] for r in rows]
    gap = max((abs(a - b) for a, b in zip(*means)), default=0.0)
    for r in rows:
        r["max_running_mean_gap"] = gap
    return rows


# ============================================================================ loss
def _full_logits_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.t()).float(), t)


def loss_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ray_moe.model.loss import auto_chunk, liger_available, lm_loss
    from ray_moe.validation import rel_err

    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    N, V, H = args.loss_tokens, args.vocab, args.d_model
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(device)
    impls: dict[str, Callable[[], torch.Tensor]] = {
        "full_logits": lambda: _full_logits_loss(h, w, t),
        "chunked": lambda: lm_loss(h, w, t, impl="chunked", chunk=args.loss_chunk),
    }
    if device.type == "cuda" and liger_available():
        impls["liger"] = lambda: lm_loss(h, w, t, impl="liger")
    rows, reference = [], None
    for name, fn in impls.items():
        row: dict[str, Any] = {"impl": name, "N": N, "V": V, "H": H, "dtype": args.dtype,
                               "chunk": (args.loss_chunk or auto_chunk(N, V, H)) if name == "chunked" else None}
        loss = None
        try:
            times = []
            for i in range(args.loss_iters + 1):
                h.grad = w.grad = None
                base = reset_peak(device)
                t0 = time.perf_counter()
                loss = fn()
                loss.backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
                if i == 0:
                    row["peak_above_inputs_gib"] = peak_gib(device, base)
            row["fwd_bwd_ms"] = 1e3 * statistics.median(times[1:] or times)
            row["loss"] = float(loss.detach())
            result = (loss.detach().float(), h.grad.clone(), w.grad.clone())
            if reference is None and name == "full_logits":
                reference = result
            elif reference is not None:
                row["loss_abs_diff"] = abs(float(result[0] - reference[0]))
                row["rel_err_dh"] = rel_err(result[1], reference[1])
                row["rel_err_dw"] = rel_err(result[2], reference[2])
            del result
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
        loss = h.grad = w.grad = None  # the full path's graph holds 20 GB of saved softmax
        free(device)
        rows.append(row)
        print(f"  loss {name}: {row.get('fwd_bwd_ms', float('nan')):.1f} ms, "
              f"peak {row.get('peak_above_inputs_gib')} GiB {row.get('error', '')}", flush=True)
    return rows


# ============================================================================ CLI
def _parser() -> argparse.ArgumentParser:
    p = usage.ArgumentParser(prog="ray-moe bench precision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="step,loss", help="comma-separated: step, curve, loss")
    p.add_argument("--device", default="auto", help="auto, cuda, cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--variants", default="old,new,new_fused", help=f"step variants: {', '.join(VARIANTS)}")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=4096, help="H (also the loss section's hidden size)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-hidden", type=int, default=1536)
    p.add_argument("--tokens", type=int, default=32768, help="tokens per step (batch = tokens / seq-len)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size cap (data.max_bytes)")
    p.add_argument("--data-paths", nargs="*", default=[], help="corpus files (default: the stdlib's sources)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--curve-steps", type=int, default=300, help="steps of the curve section")
    p.add_argument("--curve-window", type=int, default=20, help="running-mean window of the curve section")
    p.add_argument("--loss-tokens", type=int, default=32768, help="N of the loss section")
    p.add_argument("--vocab", type=int, default=151936, help="V of the loss section")
    p.add_argument("--loss-chunk", type=int, default=0, help="rows per chunk (0 = automatic)")
    p.add_argument("--loss-iters", type=int, default=3)
    p.add_overrides("the step and curve sections' runs")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    sections = [s for s in args.sections.split(",") if s]
    for bad in [s for s in sections if s not in ("step", "curve", "loss")] + [v for v in args.variants if v not in VARIANTS]:
        parser.error(f"unknown section or variant {bad!r}; sections: step, curve, loss; variants: {', '.join(VARIANTS)}")
    for name in ("layers", "d_model", "heads", "experts", "top_k", "expert_hidden", "tokens", "seq_len",
                 "iters", "loss_tokens", "vocab", "loss_iters", "curve_steps", "curve_window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        for v in args.variants:
            step_config(args, v)
    except ValueError as exc:  # ConfigError: names the key
        parser.error(f"--set: {exc}" if args.set else f"--variants={v}: {exc}")
    from tabulate import tabulate

    device = pick_device(args.device)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    out: dict[str, Any] = {"env": env, "args": vars(args)}
    print(f"bench precision on {env['device']} (torch {env['torch']})", flush=True)
    if "step" in sections:
        out["step"] = step_rows(args)
        print(f"\ntraining step, W=1: d_model {args.d_model}, {args.layers} layers, E={args.experts}, "
              f"top-{args.top_k}, I={args.expert_hidden}, {args.tokens} tokens, {args.dtype} (medians, ms)")
        cols = ["variant"] + [f"{k}_ms" for k in TIME_KEYS] + ["optimizer_pct", "optimizer_exposed_pct",
                                                               "optimizer_impl", "peak_gib"]
        print(tabulate([[r[c] for c in cols] for r in out["step"]], headers=cols, floatfmt=".1f"))
    if "curve" in sections:
        out["curve"] = curve_rows(args)
        print(f"\nloss curves, float32 vs bf16 moments, {args.curve_steps} steps: largest gap of "
              f"{args.curve_window}-step running means {out['curve'][0]['max_running_mean_gap']:.4f}")
        cols = ["variant", "moments", "first", "last_window_mean"]
        print(tabulate([[r[c] for c in cols] for r in out["curve"]], headers=cols, floatfmt=".4f"))
    if "loss" in sections:
        out["loss"] = loss_rows(args)
        print(f"\nLM loss forward+backward: N={args.loss_tokens}, V={args.vocab}, H={args.d_model}, {args.dtype}")
        cols = ["impl", "chunk", "fwd_bwd_ms", "peak_above_inputs_gib", "loss_abs_diff", "rel_err_dh", "rel_err_dw",
                "error"]
        print(tabulate([[r.get(c) for c in cols] for r in out["loss"]], headers=cols, floatfmt=".4g"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
