"""Timing one MoE layer step (forward, backward, clone coherence) on every rank of a live group.

Shared by ``ray-moe bench layer --world-size W`` (EP rows: per-rank time of the layer, and of
the exchange on fewer SMs or (not) interleaved, against the single-GPU layer) and ``ray-moe bench balance --mode train`` (skewed routing, cloning off vs
on). The step is what training does per MoE layer: route → dispatch → experts → combine,
backward, clone gradients onto owners, owners' weights into clones.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ray_moe.comm.base import BufferSpec
from ray_moe.comm.local import LocalTransport
from ray_moe.config import torch_dtype
from ray_moe.device import synchronize
from ray_moe.model.moe import MoELayer, MoELayerSpec
from ray_moe.placement.clones import push_clone_weights, reduce_clone_grads
from ray_moe.placement.placement import Placement


@dataclass
class StepSpec:
    tokens: int = 4096  # T_local, tokens per rank
    d_model: int = 1024
    hidden: int = 512
    num_experts: int = 16
    top_k: int = 4
    dtype: str = "bfloat16"
    impl: str = "auto"
    iters: int = 10
    warmup: int = 3
    zipf_s: float = 0.0  # > 0: Zipf-skewed routing whose hottest experts live on rank 0
    placement: dict | None = None  # Placement.to_dict(); None = native
    clone_slots: int = 0
    local: bool = False  # run on this rank alone through the identity transport (W = 1)
    seed: int = 0
    comm_programs: int = 0  # NVSHMEM: a buffer with this many programs (SMs) for the run (0: the transport's)
    interleave: bool | None = None  # NVSHMEM: the buffer's Tuning.interleave for the run (None: its default)
    profile: bool = False  # after the timed steps, more under torch.profiler: their kernels' times
    profile_steps: int = 1  # steps profiled back to back (> 1: the steady state), reported per step
    trace_dir: str = ""  # with profile: keep each rank's Chrome trace there (<trace_name>_rank<r>.json.gz)
    trace_name: str = "ep"

    def fwd_flops(self) -> float:
        return 6.0 * self.tokens * self.top_k * self.d_model * self.hidden


def zipf_router_bias(num_experts: int, world_size: int, s: float) -> torch.Tensor:
    """float32 [E] logit bias: Zipf(s) over experts, rank 0's experts hottest."""
    ranks = torch.arange(num_experts, dtype=torch.float64)  # expert e is the (e+1)-th hottest
    return (-s * torch.log1p(ranks)).float()


def time_layer_step(worker: Any, spec: StepSpec | dict) -> dict[str, Any]:
    """Run on every rank (``group.execute``) or on one (``spec.local``). Returns this rank's
    median forward and forward+backward milliseconds and the loads it saw."""
    if isinstance(spec, dict):
        spec = StepSpec(**spec)
    device = worker.device
    if spec.local:
        transport, W, rank = LocalTransport(), 1, 0
    else:
        transport, W, rank = worker.transport, worker.rank_info.world_size, worker.rank_info.rank
    E, H = spec.num_experts, spec.d_model
    placement = (
        Placement.from_dict(spec.placement) if spec.placement else Placement.native(E, W, spec.clone_slots)
    )
    dtype = torch_dtype(spec.dtype)
    transport.reserve(BufferSpec(max_tokens=spec.tokens, hidden=H, elem_bytes=dtype.itemsize, max_top_k=spec.top_k))
    kept = own = None
    if spec.comm_programs and hasattr(transport, "new_buffer"):  # collective: every rank runs the same spec
        kept = transport.buffer
        own = transport.new_buffer(capacity=kept.capacity, hidden=H, elem_bytes=dtype.itemsize, kmax=kept.geo.kmax,
                                   num_programs=min(spec.comm_programs, transport.num_programs))
        transport.buffer = own
    tuned = getattr(transport, "buffer", None) if spec.interleave is not None else None
    if tuned is not None:
        from ray_moe.comm.nvshmem_kernels import Tuning

        kept_tuning = tuned.tuning
        tuned.tuning = Tuning(**{**vars(kept_tuning), "interleave": spec.interleave})
    try:
        return _time_layer_step(worker, spec, transport, W, rank, placement, dtype)
    finally:
        if tuned is not None:
            tuned.tuning = kept_tuning
        if own is not None:
            synchronize(device)
            if dist.is_initialized():
                dist.barrier()
            transport.buffer = kept
            own.close()


# torch's warning for one synchronising call in sync debug mode "warn" (its notice that the mode
# is a prototype also says "Synchronization", and was counted as a sync until 2026-11-26)
SYNC_WARNING = "called a synchronizing CUDA operation"
SYNC_COUNT_STEPS = 3  # steady steps run again under the sync debug mode to count host syncs
STEP_TIMEOUT_S = 1800.0  # one variant's timing on every rank (compiles included); a hang ends named


@contextlib.contextmanager
def _host_syncs(device: torch.device):
    """Yield a list that fills with one line per synchronising torch call made inside (CUDA:
    ``torch.cuda.set_sync_debug_mode("warn")``'s warnings, where in the code each came from)."""
    found: list[str] = []
    if device.type != "cuda":
        yield found
        return
    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(old)
    found += [f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}: {str(w.message)[:80]}" for w in caught
              if SYNC_WARNING in str(w.message)]


def _time_layer_step(worker: Any, spec: StepSpec, transport: Any, W: int, rank: int, placement: Placement,
                     dtype: torch.dtype) -> dict[str, Any]:
    device = worker.device
    E, H, I = spec.num_experts, spec.d_model, spec.hidden
    layer = MoELayer(MoELayerSpec(H, E, spec.top_k, I, dtype=dtype, expert_impl=spec.impl, seed=spec.seed),
                     transport, placement, device=device)
    g = torch.Generator().manual_seed(spec.seed * 7919 + rank)
    x = torch.randn(spec.tokens, H, generator=g).to(device=device, dtype=dtype)
    if spec.zipf_s > 0:
        with torch.no_grad():  # a constant feature times the bias row skews the logits
            x[:, 0] = 1.0
            layer.router[0] = zipf_router_bias(E, W, spec.zipf_s).to(device)
    # as in training (x is a hidden state): the experts' input-gradient GEMMs and the dispatch's
    # backward run
    x.requires_grad_()
    grad = torch.randn(spec.tokens, H, generator=g).to(device=device, dtype=dtype)
    distributed = not spec.local and W > 1 and dist.is_initialized()

    def barrier():
        if distributed:
            dist.barrier()

    fwd, bwd = [], []
    for i in range(spec.warmup + spec.iters):
        barrier()
        synchronize(device)
        t0 = time.perf_counter()
        out, _ = layer(x)
        synchronize(device)
        t1 = time.perf_counter()
        out.backward(grad)
        reduce_clone_grads(layer, placement)
        push_clone_weights(layer, placement)
        synchronize(device)
        t2 = time.perf_counter()
        layer.w13.grad = layer.w2.grad = layer.router.grad = x.grad = None
        if i >= spec.warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    # steady state, as training runs: the steps back to back, no synchronisation between the
    # forward and the backward or between steps (the loop above syncs after each phase and takes
    # each phase's max over ranks, which counts the ranks' skew at every phase boundary). Timed
    # without torch's sync debug mode, which then counts a few steps of its own.
    def steady_steps(n: int, marks: list | None = None) -> None:
        _train_steps(layer, x, grad, placement, n, marks)

    barrier()
    synchronize(device)
    cuda = device.type == "cuda"
    marks = [torch.cuda.Event(enable_timing=True)] if cuda else None  # one event per step boundary
    t0 = time.perf_counter()
    if cuda:
        marks[0].record()
    steady_steps(spec.iters, marks)
    issued = time.perf_counter()
    synchronize(device)
    steady_ms = (time.perf_counter() - t0) * 1e3 / max(1, spec.iters)
    barrier()
    with _host_syncs(device) as syncs:  # torch's sync debug mode: what made the host wait
        steady_steps(SYNC_COUNT_STEPS)
    synchronize(device)
    keep = (f"{spec.trace_dir}/{spec.trace_name}_rank{rank}.json.gz" if spec.trace_dir else None)
    kernels, timeline = (_profiled_step(steady_steps, device, spec.profile_steps, dist_transport=distributed,
                                        keep_trace=keep)
                         if spec.profile else (None, None))
    tokens, pairs = layer.pop_load()
    out = {
        "rank": rank, "world_size": W,
        "forward_ms": statistics.median(fwd),
        "backward_ms": statistics.median(bwd),
        "forward_backward_ms": statistics.median([a + b for a, b in zip(fwd, bwd)]),
        "steady_step_ms": steady_ms,
        # the same loop's GPU time (first to last event: busy and idle) and the host's time to
        # issue it: an issue time near the step's says the host, not the GPU, sets the pace
        "steady_device_ms": marks[0].elapsed_time(marks[-1]) / max(1, spec.iters) if cuda else steady_ms,
        # each steady step's GPU time, in order (does the loop slow down, or one step?)
        "steady_device_steps_ms": [round(a.elapsed_time(b), 3) for a, b in zip(marks, marks[1:])] if cuda else [],
        "steady_issue_ms": (issued - t0) * 1e3 / max(1, spec.iters),
        # synchronising torch calls per steady step (counted over SYNC_COUNT_STEPS more), and the first
        "host_syncs_per_step": len(syncs) / SYNC_COUNT_STEPS,
        "first_host_sync": syncs[0] if syncs else "",
        "expert_tokens": tokens.tolist(), "received_pairs": float(pairs),
        # what moe.expert_impl=auto chose per shape, and the candidates' times
        "expert_impl": _chosen_impls(layer, x),
        "expert_timings": {str(k): v for k, v in layer.expert_chooser.timings.items()},
        "spec": asdict(spec),
    }
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if kernels is not None:
        out["kernels"], out["timeline"] = kernels, timeline
    transport.check()
    return out


def _imbalance(pairs: list[float]) -> float:
    """max / mean of the ranks' received pairs (1.0 when balanced, or when none were counted)."""
    mean = sum(pairs) / len(pairs) if pairs else 0.0
    return max(pairs) / mean if mean > 0 else 1.0


def _chosen_impls(layer: Any, x: torch.Tensor) -> str:
    """The expert implementations the layer's chooser picked, e.g. ``triton+mm_wgrad``, or the one
    that ran where nothing was chosen (``moe.expert_impl`` set, or not the Triton kernels' GPU).
    ``x``: [T, H], the layer's input (its device and dtype decide ``auto``)."""
    from ray_moe.model.experts import resolve_impl

    names = sorted({c.name for c in layer.expert_chooser.choices.values()})
    return "/".join(names) or resolve_impl(layer.expert_impl, x)


MEDIAN_KEYS = ("forward_ms", "backward_ms", "steady_step_ms", "steady_device_ms", "steady_issue_ms")


def _median_over_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One result per rank from a variant's rounds (each a list over ranks): the timings of
    :data:`MEDIAN_KEYS` are their medians over the rounds, everything else (profiles, per-step
    lists) the first round's."""
    import statistics

    merged = []
    for rank, first in enumerate(rounds[0]):
        rec = dict(first)
        for key in MEDIAN_KEYS:
            if key in first:
                rec[key] = statistics.median(rnd[rank][key] for rnd in rounds)
        merged.append(rec)
    return merged


def _train_steps(layer: Any, x: torch.Tensor, grad: torch.Tensor, placement: Placement, n: int,
                 marks: list | None = None) -> None:
    """``n`` training steps of ``layer`` back to back, as training runs them (clone gradients
    reduced onto their owners, owners' weights pushed to the clones); ``marks``: a CUDA event is
    appended and recorded after each step."""
    for _ in range(n):
        out, _ = layer(x)
        out.backward(grad)
        reduce_clone_grads(layer, placement)
        push_clone_weights(layer, placement)
        layer.w13.grad = layer.w2.grad = layer.router.grad = x.grad = None
        if marks is not None:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()


def _profiled_step(run_steps: Any, device: torch.device, steps: int = 1, dist_transport: bool = False,
                   keep_trace: str | None = None) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """``run_steps(steps)`` (:func:`_train_steps` of the layer) under torch.profiler: per kernel
    name (on the CPU, per operator), [milliseconds per step, calls per step], device times where
    there is a GPU; and the device timeline's idle stretches
    (:func:`ray_moe.bench.timeline.timeline_gaps`, with ``steps``; none on the CPU).
    ``dist_transport``: the layer exchanges with other ranks (they start together). ``keep_trace``:
    a path (``.json.gz``) to keep the Chrome trace at, to read the streams' timeline offline."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from ray_moe.bench.timeline import keep_gzipped, load_trace, timeline_gaps

    cuda = device.type == "cuda"
    barrier = "nccl"  # kernels of the barrier below, left out of both results
    if dist_transport and not cuda:  # (on the CPU the profiler would record the barrier's operators)
        dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        # every rank's profiler is running before any rank starts: else a rank waits in its
        # dispatch for a peer still starting its profiler (240 ms of "dispatch" on H200 x2)
        if dist_transport and cuda:
            dist.barrier()
        synchronize(device)
        run_steps(steps)
        synchronize(device)
    kernels = {}
    for e in prof.key_averages():
        t = e.device_time_total if cuda else e.self_cpu_time_total
        if t > 0 and not e.key.startswith(barrier):
            kernels[e.key[:120]] = [t / 1e3 / steps, e.count / steps]
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        timeline = {**timeline_gaps(load_trace(path), skip=(barrier,)), "steps": steps}
        if keep_trace:
            keep_gzipped(path, keep_trace)
    finally:
        os.unlink(path)
    return kernels, timeline


def kernel_diff_rows(ep: dict[str, list[float]], ref: dict[str, list[float]], what: str,
                     top: int = 25) -> list[dict]:
    """Kernels of an EP step against a reference step (both from :func:`_profiled_step`): the
    ``top`` names by how much longer EP spends in them, then the totals."""
    names = sorted(set(ep) | set(ref), key=lambda n: -abs(ep.get(n, [0, 0])[0] - ref.get(n, [0, 0])[0]))
    rows = []
    for n in names[:top]:
        a, b = ep.get(n, [0.0, 0]), ref.get(n, [0.0, 0])
        rows.append({"section": f"ep profile: EP vs {what}", "what": n, "ep_ms": a[0], "ref_ms": b[0],
                     "delta_ms": a[0] - b[0], "ep_calls": a[1], "ref_calls": b[1]})
    tot_a, tot_b = sum(v[0] for v in ep.values()), sum(v[0] for v in ref.values())
    rows.append({"section": f"ep profile: EP vs {what}", "what": f"all {len(ep)} / {len(ref)} kernels",
                 "ep_ms": tot_a, "ref_ms": tot_b, "delta_ms": tot_a - tot_b})
    return rows


def tflops(spec: StepSpec, ms: float, backward: bool = False) -> float:
    flops = spec.fwd_flops() * (3 if backward else 1)  # backward is twice the forward
    return flops / (ms * 1e-3) / 1e12 if ms > 0 and math.isfinite(ms) else float("nan")


def ep_layer_rows(
    T: int, H: int, I: int, E: int, K: int, world_size: int, transport: str = "auto",
    address: str | None = None, dtype: str = "bfloat16", impl: str = "auto", iters: int = 10,
    device: str = "auto", force_remote_path: bool = False,
    comm_programs: tuple[int, ...] = (0,), group: Any = None, interleave: tuple[bool | None, ...] = (None,),
    profile: bool = False, profile_steps: int = 1, trace_dir: str | None = None, rounds: int = 1,
) -> list[dict]:
    """Expert-parallel rows: per-rank layer time at T/W tokens per rank, for every NVSHMEM program
    count G (0: the transport's) and ``interleave`` setting (NVSHMEM's Tuning.interleave), against one
    GPU running a rank's own compute (T/W tokens on E/W experts; exposed communication: EP minus
    that, also as a fraction of it), T/W tokens on all E experts, and
    all T tokens (scaling efficiency: one GPU's time / (W x EP time)); each phase synchronised
    (fwd, fwd+bwd: the max over ranks of each phase) and in steady state (``steady_step_ms``:
    steps back to back, the slowest rank). ``group``: an existing
    worker group of ``world_size`` ranks to run on (else one is started and closed here).
    ``profile``: also the kernels of one step of every EP variant (rank 0) against a rank's own
    compute, by how much longer EP spends in each (:func:`kernel_diff_rows`); ``trace_dir``: each
    profiled rank's Chrome trace kept there (``ep_p<G>_il<...>_rank<r>.json.gz``,
    read them with ``python -m ray_moe.bench.timeline``). ``rounds``: every variant runs that many
    times, every other round in reverse order, and each timing is its median over the rounds
    (profiles and traces come from the first round)."""

    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup

    if T % world_size:
        raise ValueError(f"T={T} is not divisible by world_size={world_size}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if profile_steps < 1:
        raise ValueError(f"profile_steps must be >= 1, got {profile_steps}")
    base = dict(d_model=H, hidden=I, num_experts=E, top_k=K, dtype=dtype, impl=impl, iters=iters)
    if group is None:
        cfg = Config.from_dict({
            # seq_len x batch_size/W sizes the NVSHMEM buffer: T/W tokens per rank.
            "model": {"d_model": H, "n_heads": 1, "dtype": dtype, "seq_len": T // world_size},
            "moe": {"num_experts": E, "top_k": K, "expert_hidden": I, "expert_impl": impl},
            "parallel": {"world_size": world_size, "transport": transport, "device": device,
                         "cpu_per_worker": 1 if device != "cpu" else 0.5,
                         "force_remote_path": force_remote_path},
            "train": {"batch_size": world_size},
        })
        ctx: Any = WorkerGroup(cfg)
    else:
        if group.world_size != world_size:
            raise ValueError(f"the group has {group.world_size} ranks, not {world_size}")
        ctx = contextlib.nullcontext(group)
    spec_ep, spec_full = StepSpec(tokens=T // world_size, **base), StepSpec(tokens=T, **base)
    own_ok = E % world_size == 0 and K <= E // world_size

    def references(g: Any, profile: bool) -> tuple[dict | None, dict]:
        """(a rank's own compute: its T/W tokens' K rows on its E/W experts, no exchange, or None
        where E/W experts cannot take K; one GPU running all T tokens), timed on rank 0's GPU."""
        own = None
        if own_ok:
            own = g.execute_on(0, time_layer_step, asdict(StepSpec(
                tokens=T // world_size, local=True, profile=profile, profile_steps=profile_steps,
                **{**base, "num_experts": E // world_size})), timeout=STEP_TIMEOUT_S)
        full = g.execute_on(0, time_layer_step, asdict(StepSpec(tokens=T, local=True, **base)),
                            timeout=STEP_TIMEOUT_S)
        return own, full

    with ctx as g:
        # The references run before and after the EP variants and count as their mean, so a
        # GPU whose clocks drift under sustained load cannot favour what runs first; the drift
        # is reported (H200 x2, 2026-11-26: -2.5 to +0.4 %, smaller than the EP variants' spread).
        own_before, full_before = references(g, False)
        variants = [(p, il) for p in comm_programs for il in interleave]
        by_round: dict[tuple, list[list[dict]]] = {v: [] for v in variants}
        for r in range(rounds):
            # odd rounds run the variants in reverse (A B B A ...): a GPU that slows as it heats
            # cannot favour whichever variant runs first (power-capped GEMMs drift by several %)
            for p, il in (variants if r % 2 == 0 else variants[::-1]):
                first = r == 0
                by_round[p, il].append(g.execute(time_layer_step, asdict(StepSpec(
                    tokens=T // world_size, comm_programs=p, interleave=il,
                    profile=profile and first, profile_steps=profile_steps,
                    trace_dir=(trace_dir or "") if first else "", trace_name=f"ep_p{p}_il{il}", **base)),
                    timeout=STEP_TIMEOUT_S))
        ep = {v: _median_over_rounds(res) for v, res in by_round.items()}
        local = g.execute_on(0, time_layer_step, asdict(StepSpec(tokens=T // world_size, local=True, **base)),
                             timeout=STEP_TIMEOUT_S)
        own_after, full_after = references(g, profile)
        transport_name = g.transport_name
    own = None if own_after is None else _mean_times(own_before, own_after)
    full = _mean_times(full_before, full_after)
    drift = (full_after["steady_step_ms"] - full_before["steady_step_ms"]) / full_before["steady_step_ms"]
    rows = []
    for (p, il), res in ep.items():
        f, b = max(r["forward_ms"] for r in res), max(r["backward_ms"] for r in res)
        what = "EP per rank (max over ranks)" + (f", {p} programs" if p else "")
        what += {None: "", True: ", interleaved", False: ", not interleaved"}[il]
        rows.append({"section": "ep", "what": what, "transport": transport_name, "interleave": il,
                     "comm_programs": p, "tokens": spec_ep.tokens, "fwd_ms": f,
                     "fwd_TFLOPs": tflops(spec_ep, f), "fwd+bwd_ms": f + b,
                     "fwd+bwd_TFLOPs": tflops(spec_ep, f + b, backward=True),
                     "steady_step_ms": max(r["steady_step_ms"] for r in res),
                     "steady_device_ms": max(r["steady_device_ms"] for r in res),
                     "steady_issue_ms": max(r["steady_issue_ms"] for r in res),
                     "steady_ms_per_rank": [round(r["steady_step_ms"], 3) for r in res],
                     "steady_ms_per_round": [round(max(rk["steady_step_ms"] for rk in ranks), 3)
                                             for ranks in by_round[p, il]],
                     "steady_device_steps_ms_per_rank": [r["steady_device_steps_ms"] for r in res],
                     "host_syncs_per_step": max(r["host_syncs_per_step"] for r in res),
                     # max over ranks / mean of the (token, expert) pairs each rank computed: the
                     # slowest rank's experts set the step (the reference, one GPU, has none)
                     "imbalance": _imbalance([r["received_pairs"] for r in res]),
                     "first_host_sync": next((r["first_host_sync"] for r in res if r["first_host_sync"]), ""),
                     "expert_impl": "/".join(sorted({r["expert_impl"] for r in res}))})
    refs = [("one GPU, T/W tokens", local, spec_ep), ("one GPU, all T tokens", full, spec_full)]
    if own is not None:
        refs.append(("one GPU, T/W tokens on E/W experts (a rank's compute)", own, spec_ep))
    for name, res, spec in refs:
        f, b = res["forward_ms"], res["backward_ms"]
        rows.append({"section": "ep", "what": name, "transport": "local", "tokens": spec.tokens, "fwd_ms": f,
                     "fwd_TFLOPs": tflops(spec, f), "fwd+bwd_ms": f + b,
                     "fwd+bwd_TFLOPs": tflops(spec, f + b, backward=True), "steady_step_ms": res["steady_step_ms"],
                     "steady_device_ms": res["steady_device_ms"], "steady_issue_ms": res["steady_issue_ms"],
                     "host_syncs_per_step": res.get("host_syncs_per_step", 0.0),
                     "first_host_sync": res.get("first_host_sync", ""), "expert_impl": res.get("expert_impl", "")})
    # Exposed communication is EP minus a rank's own compute without the exchange: T/W tokens on
    # E/W experts (the same rows per expert as EP, so the same GEMM shapes). "One GPU, T/W tokens"
    # (all E experts at half the rows each) runs less efficient GEMMs, which hid ~0.8 ms of the
    # exchange in this column before 2026-11-25.
    ref = own if own is not None else local
    lf, lfb = ref["forward_ms"], ref["forward_ms"] + ref["backward_ms"]
    ff, ffb = full["forward_ms"], full["forward_ms"] + full["backward_ms"]
    for r in rows[:len(ep)]:
        rows.append({
            "section": "ep", "what": "derived", "world_size": world_size,
            "comm_programs": r["comm_programs"], "interleave": r["interleave"],
            "scaling_eff_fwd": ff / (world_size * r["fwd_ms"]),
            "scaling_eff_fwd+bwd": ffb / (world_size * r["fwd+bwd_ms"]),
            "exposed_comm_fwd_ms": r["fwd_ms"] - lf,
            "exposed_comm_fwd+bwd_ms": r["fwd+bwd_ms"] - lfb,
            "exposed_comm_frac_fwd": (r["fwd_ms"] - lf) / lf,
            "exposed_comm_frac_fwd+bwd": (r["fwd+bwd_ms"] - lfb) / lfb,
            "scaling_if_hidden_fwd": ff / (world_size * lf),  # the scaling with the exchange fully hidden
            "scaling_if_hidden_fwd+bwd": ffb / (world_size * lfb),
            # steady state (steps back to back, the slowest rank): what a training run sees
            "scaling_eff_steady": full["steady_step_ms"] / (world_size * r["steady_step_ms"]),
            "exposed_comm_frac_steady": (r["steady_step_ms"] - ref["steady_step_ms"]) / ref["steady_step_ms"],
            # one GPU's all-T steady step after the EP variants against before them (> 0: slower after)
            "reference_drift": drift,
        })
    if profile and own_after is not None and "kernels" in own_after:
        rows += timeline_rows({"a rank's compute": own_after["timeline"]})
        for r, ranks in zip(rows, ep.values()):  # the first len(ep) rows are the variants'
            first = ranks[0]
            if "kernels" not in first:
                continue
            variant = r["what"].removeprefix("EP per rank (max over ranks)").removeprefix(", ") or "default"
            rows += kernel_diff_rows(first["kernels"], own_after["kernels"], f"a rank's compute (rank 0), {variant}")
            rows += timeline_rows({f"rank 0's EP step, {variant}": first["timeline"]})
            rows += exchange_rows(ranks, variant)
    return rows


EXCHANGE_KERNELS = ("_dispatch_kernel", "_combine_kernel")


def exchange_rows(results: list[dict], variant: str = "") -> list[dict]:
    """Per rank of one profiled variant, its exchange kernels' milliseconds per step: a rank whose
    exchanges take longer than its peer's waited in them for that peer (the same bytes move both
    ways), i.e. the peer was late."""
    rows = []
    for r in results:
        if "kernels" not in r:
            continue
        ex = {k: v for k, v in r["kernels"].items() if k.startswith(EXCHANGE_KERNELS)}
        rows.append({"section": "ep exchange per rank",
                     "what": f"rank {r['rank']}{', ' + variant if variant else ''}: exchange kernels, ms per step",
                     "ms": f"{sum(v[0] for v in ex.values()):.3f}",
                     "detail": ", ".join(f"{k} {v[0]:.3f} ({v[1]:g} calls)" for k, v in sorted(ex.items()))})
    return rows


STEP_TIMES = ("forward_ms", "backward_ms", "steady_step_ms", "steady_device_ms", "steady_issue_ms")


def _mean_times(before: dict, after: dict) -> dict:
    """The mean of two timings of one step (:func:`time_layer_step`'s ``*_ms`` entries; the
    later one's host synchronisations)."""
    return {**{k: (before[k] + after[k]) / 2 for k in STEP_TIMES},
            "host_syncs_per_step": after["host_syncs_per_step"], "first_host_sync": after["first_host_sync"],
            "expert_impl": after["expert_impl"]}


def timeline_rows(timelines: dict[str, dict]) -> list[dict]:
    """Rows of the ``ep timeline`` table: per profiled step its wall, busy and idle milliseconds,
    the time its kernels ran beside each other (which kernels most), then its longest idle
    stretches (:func:`ray_moe.bench.timeline.timeline_gaps`); per step where several ran."""
    rows = []
    for what, tl in timelines.items():
        n = tl.get("steps", 1)
        per = "" if n == 1 else f" per step of {n}"
        ms = 1e3 * n  # microseconds over n steps -> milliseconds per step
        rows.append({"section": "ep timeline", "what": f"{what}: wall / busy / idle ms{per}, gaps",
                     "ms": f"{tl['wall_us'] / ms:.3f} / {tl['busy_us'] / ms:.3f} / {tl['idle_us'] / ms:.3f}",
                     "detail": f"{tl['gaps']} gaps"})
        beside = ", ".join(f"{k[:32]} {us / ms:.3f}" for k, us in list(tl.get("beside", {}).items())[:4])
        rows.append({"section": "ep timeline", "what": f"{what}: kernels beside other kernels, ms{per}",
                     "ms": f"{tl.get('overlap_us', 0.0) / ms:.3f}", "detail": beside or "none"})
        for g in tl["top"]:
            late = "" if g["host_late_us"] is None else f", host launched {g['host_late_us']:.0f} us into it"
            sync = "".join(f", {k} {v:.0f} us" for k, v in g["sync"].items())
            rows.append({"section": "ep timeline", "what": f"{what}: idle at {g['at_us'] / 1e3:.3f} ms",
                         "ms": f"{g['gap_us'] / 1e3:.3f}",
                         "detail": f"{g['before'][:40]} -> {g['after'][:40]}{late}{sync}"})
    return rows
