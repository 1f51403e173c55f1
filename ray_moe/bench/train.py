"""``ray-moe bench train``: one GPU's training step of an HF family at N layers, phase by phase,
beside torchtitan's model of the same config; or (``--loss-only``) the LM head + loss alone.

Step mode (default). For each ``--layers`` count: ray_moe's :class:`~ray_moe.worker.engine.Engine`
on one rank with a :class:`~ray_moe.comm.local.LocalTransport` (what ``ray-moe train`` runs on one
GPU, without Ray's per-step actor call: the driver's cost is not in these numbers), ``--warmup``
steps, then ``--iters`` instrumented steps (CUDA events between the phases, one host read of the
gradient norm as in ``Engine.train_step``):

  forward          embedding, decoder layers, final norm (``model.hidden_states``)
  lm head + loss   :func:`~ray_moe.model.loss.lm_loss` forward; it also computes both gradients
  backward         the loss's backward (scaling the saved gradients) and the decoder's backward
  grad sync        master gradients, global norm (host read)
  optimizer        AdamW on every parameter (expert and replicated; not split), masters → params;
                   with ``train.overlap_update`` (the default) only its launch: the update runs on a
                   side stream, and what of it the next step's forward waits for is in that
                   ``forward``

and ``engine.train_step()`` itself for the ``step`` column. Then per layer count: peak memory,
tokens/s and model TFLOP/s, ``model FLOPs = 6 · A · T + 6 · L · h · d · S · T`` (A: active
parameters per token, :meth:`ray_moe.arch.ArchSpec.active_params_per_token`, the embedding table
excluded; T tokens; L layers, h heads, d head dim, S sequence length: the causal attention's two
GEMMs, forward and backward, half of the full square). With two or more layer counts a row
``outside layers`` extrapolates the step to zero layers (the embedding, head, loss and the
optimizer of the replicated non-layer parameters): ``(b·t_a − a·t_b) / (b − a)``.

torchtitan (``--titan``, where it imports: ``scripts/make-titan-bundle.sh``): its model of the
preset's family (qwen3_moe, deepseek_v3 with MLA, gpt_oss with sinks and sliding windows:
:mod:`ray_moe.bench.titan`, which says what of each config it does not follow) built from the same
HF config as ray_moe's row, with as many parameters (``params`` on both rows), bf16 parameters,
grouped-mm experts, its own attention (SDPA; gpt-oss: flex attention with its block masks), the
loss as torchtitan's (``F.cross_entropy`` on the full float32 logits), torch's fused AdamW on the
bf16 parameters (no float32 masters: fewer bytes than ray_moe's optimizer), no load balancing bias
update. The same phases.

Compiled variants, each a row of its own beside the eager one: ``--compile`` (ray_moe with
``model.compile=blocks``: each block's attention half, norms and dense MLPs compiled, the MoE layer
eager) and ``--titan-compile`` (torchtitan's own ``apply_compile``: per block, ``fullgraph=True``,
and its compiled loss, as ``compile.enable`` with components model and loss). At least one warmup
step runs before anything is timed; ``first step s`` is the first warmup step's time (compilation
included: compile time ≈ first step s − step ms / 1000). Every timed row gets ``x titan compiled``
(its step over torchtitan compiled's at the same layer count) and ``x titan eager`` where those ran;
the ``outside layers`` rows also the per-layer slopes' ratios.

Loss-only mode (``--loss-only``): ``lm_loss`` forward + backward at ``--tokens`` × ``--hidden`` ×
``--vocab`` for each of chunked, fused (where Triton runs), liger (where it imports) and the full
float32 logits (torch; skipped where they do not fit), with peak memory, the loss's and the
gradients' error against the full-logits float32 oracle, and time ratios against ``fused`` (else
the first). Runs on the CPU at tiny sizes (the fused kernel there only under
``TRITON_INTERPRET=1``).

``--experts N`` cuts the preset's routed experts so that a layer of a large model's shape fits
one GPU (DeepSeek-V3: hidden 7168, MLA, experts of 2048, top-8); ``--attention-share`` adds each
row's attention time (every block's attention half, forward and backward, timed alone) and its
share of the step (torchtitan's rows too: each block's ``attention_norm`` + ``attention``).

``--variants "bf16=;fp8=moe.expert_precision=fp8"``: ray_moe's rows once per named variant (its
config overrides after the name, space separated), timed in the same run in ABBA order (A B B A:
each variant built and timed twice, its row the mean of the two visits' medians, ``step spread``
their difference over that mean), each with ``x FIRST``, its step over the first variant's of the same kind and
layer count. torchtitan's rows run once. ``--skip-eager`` leaves only the compiled rows of a side
that has them (``--compile``, ``--titan-compile``).

Both modes print a table and (``--json``) write the rows with the setup.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from ray_moe import usage
from ray_moe.bench import titan
from ray_moe.bench.common import free, missing_device, one_rank, peak_gib, pick_device, reset_peak, sync

PHASES = ("forward", "lm head + loss", "backward", "grad sync", "optimizer")
Variant = tuple[str, tuple[str, ...]]  # --variants: a name and its config overrides


# ============================================================================ helpers
class Marks:
    """Named points in a step: CUDA events on a GPU (no sync until :meth:`ms`), host time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.points: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points.append((name, ev))
        else:
            self.points.append((name, time.perf_counter()))

    def ms(self) -> dict[str, float]:
        """Milliseconds from each point to the next, keyed by the later point's name. Waits for the
        last point only: work on other streams (the overlapped update, ``train.overlap_update``)
        stays in flight into the next step, as it does in training."""
        if self.device.type == "cuda" and self.points:
            self.points[-1][1].synchronize()
        out = {}
        for (_, a), (name, b) in zip(self.points, self.points[1:]):
            out[name] = a.elapsed_time(b) if self.device.type == "cuda" else 1e3 * (b - a)
        return out


def _median_rows(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def _print_table(rows: list[dict]) -> None:
    from tabulate import tabulate

    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    print(tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols, floatfmt=".3f"), flush=True)


def _print_progress(row: dict) -> None:
    """One row as one line while the bench runs (the table comes once, when every row is in)."""
    items = [f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
             if k not in ("model", "layers")]
    print(f"# {row.get('model')}, {row.get('layers')} layers: " + ", ".join(items), flush=True)


def model_flops(spec: Any, tokens: int, seq_len: int) -> float:
    """Training FLOPs of one step: 6·A·T + 6·L·h·d·S·T (see the module docstring)."""
    attn = 6.0 * spec.num_layers * spec.num_heads * spec.head_dim * seq_len
    return (6.0 * spec.active_params_per_token() + attn) * tokens


# ============================================================================ ray_moe step
def engine_config(args: argparse.Namespace, layers: int, overrides: tuple[str, ...] = ()):
    """The HF preset at ``layers`` layers as a one-rank training config, ``--set`` and then a
    variant's ``overrides`` on top."""
    from ray_moe.config import Config

    batch = max(1, args.tokens // args.seq_len)
    hf = {"num_hidden_layers": layers, **expert_cut(args.preset, args.experts)}
    keys = [
        f"model.hf_config={args.preset}", f"model.hf={json.dumps(hf)}",
        f"model.seq_len={args.seq_len}", f"model.dtype={args.dtype}", "parallel.world_size=1",
        f"parallel.device={args.device}", f"data.max_bytes={args.max_bytes}", f"train.batch_size={batch}",
        "train.steps=1000", "train.warmup_steps=0", "train.lr=3e-4", "train.grad_clip=1.0", "train.plots=false",
        *args.set, *overrides,
    ]
    return Config().with_overrides(keys)


EXPERT_KEYS = MappingProxyType({"qwen3_moe": "num_experts", "mixtral": "num_local_experts",
                                "glm4_moe": "n_routed_experts", "deepseek_v3": "n_routed_experts",
                                "gpt_oss": "num_local_experts"})


def expert_cut(preset: str, experts: int) -> dict[str, Any]:
    """HF keys that cut ``preset``'s routed experts to ``experts`` (0: none) so that a layer of the
    real shape fits one GPU: the family's expert count, expert groups at most ``experts / 2`` (each
    group keeps two, the group score's), ``topk_group`` at most the groups; the first dense layers
    stay (``--set model.hf.first_k_dense_replace=0`` makes every layer an MoE layer)."""
    if not experts:
        return {}
    from ray_moe.arch import family_of, load_hf_config

    hf = load_hf_config(preset)
    out: dict[str, Any] = {EXPERT_KEYS[family_of(hf)]: experts}
    if int(hf.get("n_group") or 1) > 1:
        groups = min(int(hf["n_group"]), max(1, experts // 2))
        out.update(n_group=groups, topk_group=min(int(hf.get("topk_group") or 1), groups))
    return out


def attention_ms(engine: Any, args: argparse.Namespace, compiled: bool) -> float:
    """Milliseconds of every block's attention half (norm, attention, residual; the compiled region
    with ``compiled``), forward and backward, at the step's batch shape: the median of
    ``args.iters`` timings after ``args.warmup`` (CUDA events; host time on the CPU). The last
    step's overlapped update (``train.overlap_update``, a side stream on CUDA) finishes first: it
    writes the parameters these blocks read, and its time is the step's, not the attention's."""
    from ray_moe.model.rope import rope_tables

    engine.settle()
    model, spec = engine.model, engine.model.spec
    device = next(model.parameters()).device
    dtype = model.embed_tokens.weight.dtype
    B, L = max(1, args.tokens // args.seq_len), args.seq_len
    x = torch.randn(B, L, spec.hidden_size, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(L, spec.rotary_dim, spec.rope_theta, device, dtype, spec.yarn)

    def once() -> None:
        for layer in model.layers:
            y = layer.regions.attention(layer, x, cos, sin) if compiled else layer.attention_half(x, cos, sin)
            y.backward(torch.ones_like(y))

    ms = _median_ms(once, device, args.warmup, args.iters)
    model.zero_grad(set_to_none=True)
    return ms


def _median_ms(once: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """The median milliseconds of ``iters`` calls of ``once`` after ``max(warmup, 1)`` untimed ones
    (CUDA events; host time on the CPU)."""
    for _ in range(max(warmup, 1)):
        once()
    times = []
    for _ in range(iters):
        m = Marks(device)
        m.mark("start")
        once()
        m.mark("once")
        times.append(m.ms()["once"])
    return statistics.median(times)


def instrumented_step(engine: Any) -> dict[str, float]:
    """One ``Engine.train_step``, timed per phase (:data:`PHASES`, milliseconds) at the markers
    the engine calls."""
    m = Marks(engine.device)
    engine.train_step(mark=m.mark)
    return m.ms()


def ray_moe_rows(args: argparse.Namespace, layers: int, compiled: bool = False,
                 variant: Variant = ("", ())) -> dict[str, Any]:
    """ray_moe's row at ``layers`` layers; ``compiled``: with ``model.compile=blocks``; ``variant``:
    (name, its config overrides), the name appended to the row's model name."""
    from ray_moe.comm.local import LocalTransport
    from ray_moe.worker.engine import Engine

    device = pick_device(args.device)
    name, overrides = variant
    cfg = engine_config(args, layers, overrides).with_overrides([f"model.compile={'blocks' if compiled else 'none'}"])
    resolved = cfg.resolve_arch()
    engine = Engine(cfg, one_rank(device), LocalTransport(), device, resolved)
    spec = resolved.spec
    first = warm_up(engine.train_step, device, args.warmup, compiled)
    base = reset_peak(device)
    phases = [instrumented_step(engine) for _ in range(args.iters)]
    steps = [1e3 * engine.train_step()["time"]["step"] for _ in range(args.iters)]
    model = " ".join(filter(None, ("ray_moe", "compiled" if compiled else "", name)))
    row = _step_row(model, layers, _median_rows(phases), statistics.median(steps), args, spec)
    row.update(peak_gib=peak_gib(device), in_use_gib=base / 2**30, loss_impl=engine.loss_impl,
               optimizer_impl=engine.optimizer.impl,
               activation_checkpointing=engine.config.model.activation_checkpointing,
               expert_precision=engine.config.moe.expert_precision,
               params_replicated=sum(p.numel() for p in engine.replicated),
               params_expert=sum(p.numel() for p in engine.sharded), **first)
    row["params"] = row["params_replicated"] + row["params_expert"]
    if args.attention_share:
        row["attention ms"] = attention_ms(engine, args, compiled)
        row["attention share"] = row["attention ms"] / row["step ms"]
    del engine
    free(device)
    return row


def warm_up(step: Callable[[], Any], device: torch.device, warmup: int, compiled: bool) -> dict[str, float]:
    """``warmup`` calls of ``step`` (at least one when ``compiled``: the first step compiles, and is
    never timed with the rest); returns ``{"first step s": seconds}`` of the first one (compilation,
    the expert kernels' first launches and choice), empty without warmup."""
    n = max(warmup, 1 if compiled else 0)
    if n == 0:
        return {}
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(n - 1):
        step()
    return {"first step s": first}


def _step_row(name: str, layers: int, phases: dict[str, float], step_ms: float, args: argparse.Namespace,
              spec: Any) -> dict[str, Any]:
    tokens = max(1, args.tokens // args.seq_len) * args.seq_len
    flops = model_flops(spec, tokens, args.seq_len)
    return {"model": name, "layers": layers, **{f"{k} ms": v for k, v in phases.items()},
            "phases ms": sum(phases.values()), "step ms": step_ms, "tokens": tokens,
            "tokens/s": tokens / (step_ms / 1e3), "model TFLOP/s": flops / (step_ms / 1e3) / 1e12}


# ============================================================================ torchtitan
def titan_rows(args: argparse.Namespace, layers: int, compiled: bool = False) -> dict[str, Any]:
    """torchtitan's row at ``layers`` layers: its model of the family (:mod:`ray_moe.bench.titan`)
    built from the HF config ray_moe's row builds from (the preset, ``--experts``, ``--set
    model.hf...``), ``params`` its parameter count; ``compiled``: its per-block compile
    (:func:`~ray_moe.bench.titan.apply_compile`) and its compiled loss (``build_cross_entropy_loss``'s
    rule), after its activation checkpointing (``--titan-ac``). On the CPU its CUDA-only parts run
    through :func:`~ray_moe.bench.titan.cpu_fallbacks`."""
    from torchtitan.components.loss import cross_entropy_loss

    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    resolved = engine_config(args, layers).resolve_arch()
    spec = resolved.spec
    tt = titan.build(resolved.hf_config, args.seq_len, device, dtype)
    undo, loss_fn = None, cross_entropy_loss  # F.cross_entropy of the float32 logits, summed
    titan.apply_ac(tt, args.titan_ac, compiled)
    if compiled:
        undo, loss_fn = titan.apply_compile(tt), torch.compile(cross_entropy_loss, backend="inductor")
    opt = torch.optim.AdamW(tt.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    batch = max(1, args.tokens // args.seq_len)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, args.seq_len), generator=g).to(device)  # the byte corpus' range
    y = torch.randint(0, 256, (batch, args.seq_len), generator=g).to(device)

    def step(m: Marks | None = None) -> None:
        mark = m.mark if m else (lambda name: None)
        mark("start")
        h = tt.hidden(x)
        mark("forward")
        loss = loss_fn(tt.model.output(h), y) / y.numel()
        mark("lm head + loss")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        mark("backward")
        norm = torch.nn.utils.clip_grad_norm_(tt.model.parameters(), 1.0)
        float(norm)  # the host read ray_moe's step has too
        mark("grad sync")
        opt.step()
        mark("optimizer")

    extra: dict[str, Any] = {}
    try:
        with titan.cpu_fallbacks() if device.type == "cpu" else contextlib.nullcontext():
            first = warm_up(step, device, args.warmup, compiled)
            base = reset_peak(device)
            phases = []
            for _ in range(args.iters):
                m = Marks(device)
                step(m)
                phases.append(m.ms())
            steps = []
            for _ in range(args.iters):
                sync(device)
                t0 = time.perf_counter()
                step()
                sync(device)
                steps.append(1e3 * (time.perf_counter() - t0))
            peak = peak_gib(device)
            if args.attention_share:
                opt.zero_grad(set_to_none=True)
                extra["attention ms"] = titan_attention_ms(tt, x, args)
    finally:
        if undo is not None:
            undo()
    row = _step_row("torchtitan compiled" if compiled else "torchtitan", layers, _median_rows(phases),
                    statistics.median(steps), args, spec)
    row.update(peak_gib=peak, in_use_gib=base / 2**30, loss_impl="full logits (float32)",
               optimizer_impl="torch fused AdamW, bf16 params", activation_checkpointing=args.titan_ac, **first,
               params=tt.params(), **extra)
    if "attention ms" in row:
        row["attention share"] = row["attention ms"] / row["step ms"]
    notes = list(tt.notes) + (["its gpt-oss parallelize compiles no block: the loss only"]
                              if compiled and tt.family == "gpt_oss" else [])
    notes += ["flex attention dense on the CPU"] if device.type == "cpu" and tt.family == "gpt_oss" else []
    if notes:
        row["note"] = "; ".join(notes)
    return row  # its model and optimizer freed by the caller (_run_row), once this frame is gone


def titan_attention_ms(tt: Any, tokens: torch.Tensor, args: argparse.Namespace) -> float:
    """Milliseconds of every torchtitan block's attention half (``x + attention(attention_norm(x))``,
    compiled where its compile compiled it), forward and backward, at the step's batch shape
    ``tokens`` [B, L] (gpt-oss: with its masks of ``tokens``)."""
    weight = tt.model.tok_embeddings.weight  # [V, H]
    x = torch.randn(*tokens.shape, weight.shape[1], device=weight.device, dtype=weight.dtype, requires_grad=True)
    masks = tt.masks(tokens)

    def once() -> None:
        for layer in tt.model.layers.values():
            y = tt.attention_half(layer, x, masks)
            y.backward(torch.ones_like(y))

    ms = _median_ms(once, weight.device, args.warmup, args.iters)
    tt.model.zero_grad(set_to_none=True)
    return ms


# ============================================================================ variants
def parse_variants(text: str) -> list[Variant]:
    """``--variants "bf16=;fp8=moe.expert_precision=fp8"``: ``;``-separated ``NAME=OVERRIDES``,
    OVERRIDES the variant's ``section.key=value`` config overrides separated by spaces (none: the
    config as given). Raises ValueError naming the part that is wrong."""
    out: list[Variant] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, eq, rest = part.partition("=")
        name = name.strip()
        if not eq or not name or " " in name or name == "compiled":
            raise ValueError(f"variant {part!r} must look like NAME=section.key=value ... (NAME=: no overrides)")
        overrides = tuple(rest.split())
        bad = next((o for o in overrides if "=" not in o or o.startswith("=")), None)
        if bad is not None:
            raise ValueError(f"variant {name}: override {bad!r} must look like section.key=value")
        if name in (n for n, _ in out):
            raise ValueError(f"variant {name} is named twice")
        out.append((name, overrides))
    if len(out) < 2:
        raise ValueError(f"{text!r} names {len(out)} variant(s); give two or more, separated by ';'")
    return out


def abba(variants: list[Variant]) -> list[Variant]:
    """The order the variants are timed in: each once forward, then once backward (A B B A; A B C C
    B A), so that a drift over the run (clocks, heat) weighs on every variant alike."""
    return variants + variants[::-1] if len(variants) > 1 else list(variants)


def merge_visits(visits: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of a variant's visits (:func:`abba`): each ``... ms`` column the mean of the visits'
    medians, tokens/s and model TFLOP/s from that step time, ``peak_gib`` the largest, ``step
    spread`` (max − min) / mean of the visits' step times; a failed visit's row as it is."""
    failed = next((v for v in visits if "step ms" not in v), None)
    if failed is not None or len(visits) == 1:
        return failed or visits[0]
    row = dict(visits[0])
    for k, v in row.items():
        if k.endswith(" ms") and isinstance(v, float):
            row[k] = statistics.mean(visit[k] for visit in visits)
    if "attention ms" in row:
        row["attention share"] = row["attention ms"] / row["step ms"]
    steps = [v["step ms"] for v in visits]
    row["tokens/s"] = row["tokens"] / (row["step ms"] / 1e3)
    row["model TFLOP/s"] = visits[0]["model TFLOP/s"] * visits[0]["step ms"] / row["step ms"]
    peaks = [v["peak_gib"] for v in visits if v.get("peak_gib") is not None]  # None on the CPU
    row["peak_gib"] = max(peaks) if peaks else None
    row.update(visits=len(visits), **{"step spread": (max(steps) - min(steps)) / row["step ms"]})
    return row


def variant_ratio_columns(rows: list[dict], variants: list[Variant]) -> None:
    """``x FIRST`` on each ray_moe variant row, in place: its step ms over the first variant's row of
    the same kind (eager or compiled) and ``layers``; on the extrapolated rows also ``per layer x
    FIRST``."""
    first, names = variants[0][0], [n for n, _ in variants]
    ref = {(r["model"], str(r["layers"])): r for r in rows if "step ms" in r}
    for r in rows:
        name = next((n for n in names if r["model"].startswith("ray_moe") and r["model"].endswith(f" {n}")), None)
        base = ref.get((r["model"][: -len(name)] + first, str(r["layers"]))) if name else None
        if base is None or "step ms" not in r:
            continue
        r[f"x {first}"] = r["step ms"] / base["step ms"]
        if "per layer step ms" in r and "per layer step ms" in base:
            r[f"per layer x {first}"] = r["per layer step ms"] / base["per layer step ms"]


def outside_layer_rows(rows: list[dict]) -> list[dict]:
    """Per model with two or more layer counts a < b: each time column extrapolated to zero
    layers, ``(b·t_a − a·t_b) / (b − a)`` (the smallest and the largest count)."""
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == name and "step ms" in r), key=lambda r: r["layers"])
        if len(mine) < 2 or mine[0]["layers"] == mine[-1]["layers"]:
            continue
        lo, hi = mine[0], mine[-1]
        a, b = lo["layers"], hi["layers"]
        row: dict[str, Any] = {"model": name, "layers": f"0 (from {a} and {b})"}
        for k in lo:
            if k.endswith(" ms"):
                row[k] = (b * lo[k] - a * hi[k]) / (b - a)
        row["per layer step ms"] = (hi["step ms"] - lo["step ms"]) / (b - a)
        out.append(row)
    return out


def ratio_columns(rows: list[dict]) -> None:
    """Each timed row against torchtitan's of the same ``layers`` (a count, or the zero-layer
    extrapolation of the same two counts), in place: ``x titan compiled`` = step ms / torchtitan
    compiled's, ``x titan eager`` = step ms / torchtitan's; on the extrapolated rows also
    ``per layer x titan compiled`` / ``per layer x titan eager`` (the per-layer slopes' ratio)."""
    ref = {(r["model"], str(r["layers"])): r for r in rows if "step ms" in r}
    for r in rows:
        if "step ms" not in r:
            continue
        for name, col in (("torchtitan compiled", "x titan compiled"), ("torchtitan", "x titan eager")):
            t = ref.get((name, str(r["layers"])))
            if t is None:
                continue
            r[col] = r["step ms"] / t["step ms"]
            if "per layer step ms" in r and "per layer step ms" in t:
                r[f"per layer {col}"] = r["per layer step ms"] / t["per layer step ms"]


# ============================================================================ loss only
def _full_logits(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.t()).float(), t)


def loss_impls(device: torch.device) -> list[str]:
    """The loss variants that run on ``device``: chunked, fused, liger (where they run), full."""
    from ray_moe.model.loss import fused_available, liger_available

    impls = ["chunked"]
    if fused_available(device):
        impls.append("fused")
    if device.type == "cuda" and liger_available():
        impls.append("liger")
    return impls + ["full"]


def _time_ms(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=max(100, 50 * iters), return_mode="median"))
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def loss_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ray_moe.model.loss import lm_loss, resolve_loss_impl
    from ray_moe.validation import rel_err

    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    N, H, V = args.tokens, args.hidden, args.vocab
    g = torch.Generator().manual_seed(args.seed)
    h = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(device)
    t[:: max(2, N // 8)] = -100  # a few ignored rows (as padding would be)
    oracle = None
    if 4 * N * V * 4 + 8 * (N + V) * H < args.oracle_gib * 2**30:  # float32 logits, their gradient, inputs
        hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        loss = F.cross_entropy(hf @ wf.t(), t)
        oracle = (loss.detach(), *torch.autograd.grad(loss, (hf, wf)))
        del hf, wf, loss
    impls = [i for i in loss_impls(device) if i in args.impls.split(",")]
    rows = []
    for impl in impls:
        def run(impl: str = impl) -> tuple[torch.Tensor, ...]:
            h.grad = w.grad = None
            loss = _full_logits(h, w, t) if impl == "full" else lm_loss(h, w, t, impl=impl, chunk=args.chunk)
            loss.backward()
            return loss

        row: dict[str, Any] = {"impl": impl}
        try:
            base = reset_peak(device)
            loss = run()
            row["peak GiB above inputs"] = peak_gib(device, base)
            if oracle is not None:
                row["loss err"] = abs(float(loss.detach()) - float(oracle[0]))
                row["rel err dH"] = rel_err(h.grad.float(), oracle[1])
                row["rel err dW"] = rel_err(w.grad.float(), oracle[2])
            row["ms"] = _time_ms(run, device, args.iters)
        except torch.OutOfMemoryError:
            row["note"] = "out of memory"
        h.grad = w.grad = None
        free(device)
        rows.append(row)
    timed = [r for r in rows if "ms" in r]
    ref = next((r for r in timed if r["impl"] == "fused"), timed[0] if timed else None)
    gemm = 3 * 2.0 * N * H * V
    for r in timed:
        r["x fused" if ref["impl"] == "fused" else f"x {ref['impl']}"] = r["ms"] / ref["ms"]
        r["GEMM TFLOP/s"] = gemm / (r["ms"] / 1e3) / 1e12
    rows.append({"impl": f"auto → {resolve_loss_impl('auto', device)}"})
    return rows


# ============================================================================ CLI
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = usage.ArgumentParser(prog="ray-moe bench train", description=__doc__.splitlines()[0])
    p.add_argument("--loss-only", action="store_true", help="the LM head + loss alone (see the module docstring)")
    p.add_argument("--preset", default="qwen3-30b-a3b", help="model.hf_config: an HF preset, config.json or directory")
    p.add_argument("--layers", default="2,4", help="comma list of num_hidden_layers")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (loss-only: rows N)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048, help="loss-only: H")
    p.add_argument("--vocab", type=int, default=151936, help="loss-only: V")
    p.add_argument("--chunk", type=int, default=0, help="loss-only: rows per chunk (0: each impl's rule)")
    p.add_argument("--impls", default="chunked,fused,liger,full", help="loss-only: which variants")
    p.add_argument("--oracle-gib", type=float, default=48.0,
                   help="loss-only: compare with the float32 full-logits oracle when it needs less memory than this")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="auto", help="auto, cuda, cpu")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus size cap (data.max_bytes)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--titan", choices=["auto", "yes", "no"], default="auto",
                   help="torchtitan's Qwen3 beside ray_moe (auto: where it imports)")
    p.add_argument("--compile", action="store_true",
                   help="also ray_moe with model.compile=blocks (its blocks' dense parts compiled, the MoE eager)")
    p.add_argument("--titan-compile", action="store_true",
                   help="also torchtitan with its own per-block compile and compiled loss (apply_compile)")
    p.add_argument("--skip-eager", action="store_true",
                   help="with --compile / --titan-compile: only the compiled rows of that side (a shorter run)")
    p.add_argument("--titan-ac", choices=["none", "selective", "full"], default="none",
                   help="torchtitan's activation checkpointing (its apply_ac; selective is its default, "
                        "full matches model.activation_checkpointing=full)")
    p.add_argument("--experts", type=int, default=0,
                   help="cut the preset's routed experts to this many (0: as published), e.g. a DeepSeek-V3 "
                        "layer on one GPU; its expert groups follow (see expert_cut)")
    p.add_argument("--attention-share", action="store_true",
                   help="also time every block's attention half, forward and backward, alone: the 'attention "
                        "ms' column and its share of the step")
    p.add_argument("--variants", default=None, metavar="NAME=OVERRIDES;...",
                   help="ray_moe's rows once per named variant, timed in the same run in ABBA order, each with "
                        "its config overrides (space separated) and its step's ratio to the first's, e.g. "
                        "'bf16=;fp8=moe.expert_precision=fp8'")
    p.add_overrides("ray_moe's rows")
    p.add_argument("--json", default=None, help="write the rows and the setup here")
    args = p.parse_args(argv)
    if not all(n.strip().isdigit() and int(n) >= 1 for n in args.layers.split(",")):
        p.error(f"--layers={args.layers!r} must be a comma list of positive integers")
    if args.experts < 0:
        p.error(f"--experts={args.experts} must be >= 0")
    if args.titan_compile and args.titan == "no":
        p.error("--titan-compile compiles torchtitan's model; it needs --titan auto or yes")
    if args.skip_eager and not (args.compile or args.titan_compile):
        p.error("--skip-eager leaves the compiled rows only; it needs --compile or --titan-compile")
    try:
        args.variant_list = parse_variants(args.variants) if args.variants is not None else [("", ())]
    except ValueError as exc:
        p.error(f"--variants: {exc}")
    if args.loss_only and args.variants is not None:
        p.error("--variants times ray_moe's training step; --loss-only has none")
    return args


def _setup(args: argparse.Namespace, device: torch.device, titan: str | None) -> dict[str, Any]:
    setup = {"args": vars(args), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
             "torch": torch.__version__, "python": platform.python_version(), "torchtitan": titan or "imports"}
    try:
        import triton

        setup["triton"] = triton.__version__
    except ImportError:
        pass
    return setup


def main(argv: list[str]) -> int:
    """CLI entry: ``ray-moe bench train [--loss-only] [...] [--json out.json]``. Returns the exit code."""
    args = parse_args(argv)
    device = pick_device(args.device)
    error = missing_device("ray-moe bench train", device)
    if error:
        print(error, file=sys.stderr)
        return 2
    layer_counts = [int(n) for n in args.layers.split(",")]
    rows: list[dict] = []
    titan_error = None
    if args.loss_only:
        rows = loss_rows(args)
        _print_table(rows)
    else:
        family = _family(args.preset)
        titan_error = titan.import_error(family) if args.titan != "no" else "not asked for"
        if args.titan == "yes" and titan_error:
            why = (f"torchtitan's {family} model does not import ({titan_error}); build it with "
                   "scripts/make-titan-bundle.sh") if family in titan.FAMILIES else titan_error
            print(f"ray-moe bench train: error: --titan yes: {why}", file=sys.stderr)
            return 2
        error = _variant_error(args, layer_counts) if args.variants is not None else None
        if error:
            print(f"ray-moe bench train: error: {error}", file=sys.stderr)
            return 2
        print(f"torchtitan: {titan_error or 'imports'}", flush=True)
        kinds = _kinds(args.compile, args.skip_eager)
        titans = [] if titan_error else _kinds(args.titan_compile, args.skip_eager)
        for layers in layer_counts:
            for compiled in kinds:
                visits: dict[str, list[dict]] = {}
                for variant in abba(args.variant_list):
                    row = _run_row(args, device, layers, lambda v=variant: ray_moe_rows(args, layers, compiled, v),
                                   " ".join(filter(None, ("ray_moe", "compiled" if compiled else "", variant[0]))))
                    visits.setdefault(variant[0], []).append(row)
                rows += [merge_visits(v) for v in visits.values()]
                _write_json(args, device, titan_error, rows)
            for compiled in titans:
                rows.append(_run_row(args, device, layers, lambda: titan_rows(args, layers, compiled),
                                     "torchtitan compiled" if compiled else "torchtitan"))
                _write_json(args, device, titan_error, rows)
        rows += outside_layer_rows(rows)
        ratio_columns(rows)
        if args.variants is not None:
            variant_ratio_columns(rows, args.variant_list)
        print()
        _print_table(rows)
        _print_summary(rows, args.variant_list if args.variants is not None else [])
    _write_json(args, device, titan_error, rows)
    return 0


def _kinds(compiled: bool, skip_eager: bool) -> list[bool]:
    """Which rows of one side run: eager (False), compiled (True) with ``compiled``; ``skip_eager``
    drops the eager one where a compiled one runs."""
    return [True] if compiled and skip_eager else [False, True] if compiled else [False]


def _variant_error(args: argparse.Namespace, layer_counts: list[int]) -> str | None:
    """The first variant whose overrides make an invalid config, and why (one line), at the first
    layer count whose config without them is valid (a count that is not says so in its row)."""
    from ray_moe.config import ConfigError

    for layers in layer_counts:
        try:
            engine_config(args, layers)
        except ConfigError:
            continue
        for name, overrides in args.variant_list:
            try:
                engine_config(args, layers, overrides)
            except ConfigError as exc:
                return f"variant {name}: {exc}".replace("\n", " ")
        return None
    return None


def _run_row(args: argparse.Namespace, device: torch.device, layers: int, fn: Callable[[], dict],
             model: str) -> dict[str, Any]:
    """``fn()``'s row, printed as one line as it comes; a failure becomes a row with its note (one
    failing model must not lose the others' rows)."""
    try:
        row = fn()
    except Exception as exc:
        import traceback

        traceback.print_exc()
        row = {"model": model, "layers": layers,
               "note": f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}
    free(device)  # here, not in the handler: the traceback's frames hold the failed model until it ends
    _print_progress(row)
    return row


def _print_summary(rows: list[dict], variants: list[Variant]) -> None:
    """Per timed row: its step, its ratio to torchtitan's and (``--variants``) to the first variant's,
    its attention's share where timed; one line each."""
    print()
    first = f"x {variants[0][0]}" if variants else None
    for r in rows:
        if "step ms" not in r:
            continue
        items = [f"step {r['step ms']:.2f} ms"]
        items += [f"{c} {r[c]:.3f}" for c in (first, "x titan compiled", "x titan eager", "attention share",
                                               "per layer step ms") if c and c in r]
        print(f"{r['model']}, {r['layers']} layers: " + ", ".join(items), flush=True)


def _family(preset: str) -> str:
    from ray_moe.arch import family_of, load_hf_config

    return family_of(load_hf_config(preset))


def _write_json(args: argparse.Namespace, device: torch.device, titan: str | None, rows: list[dict]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": _setup(args, device, titan), "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
