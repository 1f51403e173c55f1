"""``ray-moe bench comm``: NVSHMEM dispatch/combine against the NCCL textbook exchange.

For every T_local (default 128, 4096, 16384; H=4096, K=8, E=64, bf16, uniform random routing)
each rank measures, in the same run:

- NVSHMEM dispatch, combine and dispatch+combine (back-to-back calls timed with CUDA events,
  per call), for each launch variant (``--variants``); the fastest variant is reported. Also a
  CUDA graph of one dispatch+combine, replayed (launch overhead removed).
- the textbook EP exchange through NCCL ``all_to_all_single``: one row per (token, k), split
  sizes exchanged by a small all-to-all and read on the host, rows and (slot, weight) meta sent;
  combine sends the K rows back and sums them weighted. Layout exchange included.
- the peer-copy ceilings: the same number of bytes into the peers' symmetric memory through
  their NVLink peer pointers, all ranks at once, by ``copy_`` (the copy engines, a stream per
  peer: ``ce_ceiling_GBps``) and by SM stores to every peer from one grid
  (:mod:`ray_moe.bench.copy_ceiling`: ``sm_ceiling_GBps``), and by both at once, the copy
  engines taking part of the bytes (``hybrid_ceiling_GBps``); ``dispatch_vs_ceiling`` is against
  the highest.

"bytes" are what left this rank for other ranks (rank-dedup rows x (H x 2 + meta) for NVSHMEM,
(token, k) rows for NCCL); GB/s = bytes / time. The table shows the slowest rank's numbers.

- the FP8 dispatch (``moe.expert_precision: fp8``'s rows on the wire: H + 4·H/128 bytes a row):
  its time and bytes beside bf16's dispatch on the same buffer, in ABBA order (its own table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import MappingProxyType
from typing import Any

import torch

from ray_moe import usage


def _routing(T: int, E: int, K: int, W: int, seed: int, device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    n = E // W
    w = torch.rand(T, K, generator=g) + 0.1
    w = w / w.sum(1, keepdim=True)
    return ((ids // n).to(torch.int32).to(device), (ids % n).to(torch.int32).to(device), w.to(device))


def _time(fn, iters: int, warmup: int = 2) -> float:
    """Seconds per call of fn, median over 3 runs of `iters` back-to-back calls (all ranks aligned)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        runs.append(a.elapsed_time(b) / 1e3 / iters)
    return statistics.median(runs)


class NCCLTextbook:
    """The textbook EP exchange: per-(token, k) rows, host-synced split sizes, all_to_all_single."""

    def __init__(self, W: int) -> None:
        self.W = W

    def dispatch(self, x, dest_rank, dest_slot, weight):
        import torch.distributed as dist

        T, K = dest_rank.shape
        flat = dest_rank.reshape(-1).long()
        order = flat.argsort(stable=True)
        send = torch.bincount(flat, minlength=self.W)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        sc, rc = send.tolist(), recv.tolist()  # host sync: the textbook way
        rows = x[order // K]
        meta = torch.stack([dest_slot.reshape(-1)[order].float(), weight.reshape(-1)[order]], 1)
        rx = x.new_empty(sum(rc), x.shape[1])
        dist.all_to_all_single(rx, rows, rc, sc)
        rmeta = meta.new_empty(sum(rc), 2)
        dist.all_to_all_single(rmeta, meta, rc, sc)
        return rx, rmeta, (order, sc, rc, T, K)

    def combine(self, y, weight, state):
        import torch.distributed as dist

        order, sc, rc, T, K = state
        back = y.new_empty(T * K, y.shape[1])
        dist.all_to_all_single(back, y, sc, rc)
        w = weight.reshape(-1)[order].to(y.dtype).unsqueeze(1)
        return torch.zeros(T, y.shape[1], dtype=y.dtype, device=y.device).index_add_(0, order // K, back * w)


VARIANTS = MappingProxyType({
    "r8h1024w8": dict(block_r=8, block_h=1024, num_warps=8),
    "r4h2048w8": dict(block_r=4, block_h=2048, num_warps=8),
    "r16h512w8": dict(block_r=16, block_h=512, num_warps=8),
    "r8h1024w16": dict(block_r=8, block_h=1024, num_warps=16),
    "r2h4096w16": dict(block_r=2, block_h=4096, num_warps=16),
    "r4h4096w16": dict(block_r=4, block_h=4096, num_warps=16),
    "r2h4096w8": dict(block_r=2, block_h=4096, num_warps=8),
    "r1h4096w8": dict(block_r=1, block_h=4096, num_warps=8),
    "r8h4096w16": dict(block_r=8, block_h=4096, num_warps=16),
    # the combine's sends in ring order (Tuning.rotate_peers): for W >= 4, where the combine lagged
    "r8h4096w16rot": dict(block_r=8, block_h=4096, num_warps=16, rotate_peers=True),
    # the dispatch's copy-out interleaved with its sends (Tuning.interleave)
    "r8h4096w16il": dict(block_r=8, block_h=4096, num_warps=16, interleave=True),
    "r4h4096w16il": dict(block_r=4, block_h=4096, num_warps=16, interleave=True),
    # toward 0.9 of the copy ceiling (0.86 on H200 x2 with r8h4096w16il): fewer signals per row
    # (16 rows each), or more threads over the same 8 rows (fewer registers per thread)
    "r16h4096w16il": dict(block_r=16, block_h=4096, num_warps=16, interleave=True),
    "r8h4096w32il": dict(block_r=8, block_h=4096, num_warps=32, interleave=True),
    "r8h4096w16rotil": dict(block_r=8, block_h=4096, num_warps=16, rotate_peers=True, interleave=True),
})


def _fp8_dispatch(buf: Any, x, w, dr, ds, iters: int, rows_out: int) -> dict[str, Any]:
    """The dispatch with FP8 rows on the wire (``moe.expert_precision: fp8``: E4M3 rows and their
    1×128 scales, :func:`~ray_moe.kernels.fp8_quant.pack_rows`) beside bf16's, in ABBA order on
    the same buffer and routing: the dispatch alone, and with the quantisation before it; the
    bytes that leave this rank (rows × (row payload + meta)); whether the received bytes dequantise
    to the bf16 dispatch's rows within E4M3's error (``fp8_rel_err``)."""
    from ray_moe.kernels.fp8_quant import dequantize_rows, pack_rows, packed_views, wire_row_bytes

    H, K = x.shape[1], dr.shape[1]
    packed = pack_rows(x)
    times: dict[str, list[float]] = {"bf16": [], "fp8": [], "fp8_quant": []}
    fns = {"bf16": lambda: buf.dispatch(x, w, dr, ds), "fp8": lambda: buf.dispatch(packed, w, dr, ds),
           "fp8_quant": lambda: buf.dispatch(pack_rows(x), w, dr, ds)}
    for order in (("bf16", "fp8", "fp8_quant"), ("fp8_quant", "fp8", "bf16")):
        for name in order:
            times[name].append(_time(fns[name], iters))
    rx, rs, _, _ = buf.dispatch(x, w, dr, ds)
    rp = buf.dispatch(packed, w, dr, ds)[0]
    sent = rs.ge(0).any(1)  # the rows that arrived (padding rows hold nothing)
    deq = dequantize_rows(*packed_views(rp[sent], H))
    err = ((deq - rx[sent].float()).norm() / rx[sent].float().norm().clamp_min(1e-30)).item()
    return {"bf16_dispatch_s": statistics.median(times["bf16"]), "fp8_dispatch_s": statistics.median(times["fp8"]),
            "fp8_quant_dispatch_s": statistics.median(times["fp8_quant"]),
            "fp8_dispatch_bytes": rows_out * (wire_row_bytes(H) + 8 * K), "fp8_rel_err": err}


def _round_trip_error(buf: Any, x, w, dr, ds, to_rank) -> float:
    """Relative error of combine(dispatch(x)) with the received rows passed straight back: each
    token returns once per destination rank, so the result must be x * (its number of ranks).
    x bf16 [T, H]; w float32, dr/ds int32 [T, K]; to_rank bool [T, W]."""
    rx, _, _, lay = buf.dispatch(x, w, dr, ds)
    back = buf.combine(rx, lay)
    want = x.float() * to_rank.sum(1, keepdim=True)
    return float(((back.float() - want).norm() / want.norm().clamp_min(1e-30)).item())


def bench_worker(worker: Any, params: dict) -> list[dict]:
    """Runs on every rank; returns one record per T_local."""
    import torch.distributed as dist

    from ray_moe.comm.nvshmem_kernels import Tuning
    from ray_moe.device import capture_graph

    tr = worker.transport
    me, W, dev = tr.rank, tr.world_size, worker.device
    H, K, E = params["hidden"], params["top_k"], params["experts"]
    out = []
    nccl = NCCLTextbook(W)
    t_start = time.perf_counter()

    def progress(T: int, what: str) -> None:  # on the driver's console, so a stall shows where it is
        if me == 0:  # (a W=4 sweep compiles for minutes)
            print(f"bench comm [{time.perf_counter() - t_start:.0f} s]: T_local={T} {what}", flush=True)

    for T in params["tokens"]:
        iters = params["iters"] if T >= 4096 else params["iters"] * 5
        buf = tr.new_buffer(capacity=T, hidden=H, elem_bytes=2, kmax=max(8, K))
        x = torch.randn(T, H, dtype=torch.bfloat16, device=dev)
        dr, ds, w = _routing(T, E, K, W, 1000 * me + T, dev)
        to_rank = torch.zeros(T, W, dtype=torch.bool, device=dev)
        to_rank.scatter_(1, dr.long(), True)
        rows_out = int(to_rank.sum().item() - to_rank[:, me].sum().item())
        pairs_out = int((dr != me).sum().item())
        disp_bytes = rows_out * (H * 2 + 8 * K)
        comb_bytes = rows_out * H * 2
        rec: dict[str, Any] = {"rank": me, "T": T, "H": H, "K": K, "E": E, "W": W,
                               "dispatch_bytes": disp_bytes, "combine_bytes": comb_bytes,
                               "nccl_bytes": pairs_out * (H * 2 + 8), "variants": {}}
        names = params["variants"]
        for name in names:
            progress(T, f"variant {name}")
            buf.tuning = Tuning(**VARIANTS[name])
            state: dict[str, Any] = {}

            def disp():
                state["d"] = buf.dispatch(x, w, dr, ds)

            t_d = _time(disp, iters)
            rx, rs, rw, lay = state["d"]
            t_c = _time(lambda: buf.combine(rx, lay), iters)

            def pair():
                r = buf.dispatch(x, w, dr, ds)
                buf.combine(r[0], r[3])

            t_dc = _time(pair, iters)
            rec["variants"][name] = {"dispatch_s": t_d, "combine_s": t_c, "pair_s": t_dc,
                                     "round_trip_rel_err": _round_trip_error(buf, x, w, dr, ds, to_rank)}
        best = min(rec["variants"], key=lambda n: rec["variants"][n]["pair_s"])
        rec["best"] = best
        buf.tuning = Tuning(**VARIANTS[best])
        progress(T, f"{best}: owned outputs, CUDA graph")

        def owned_pair():  # as decoding runs it: the dispatch's outputs owned by the buffer
            r = buf.dispatch(x, w, dr, ds, reuse_outputs=True)
            buf.combine(r[0], r[3])

        rec["owned_pair_s"] = _time(owned_pair, iters)
        progress(T, "FP8 rows on the wire")
        rec.update(_fp8_dispatch(buf, x, w, dr, ds, iters, rows_out))
        # CUDA graph of one dispatch + combine
        try:
            def round_trip():
                r = buf.dispatch(x, w, dr, ds)
                return buf.combine(r[0], r[3])

            g, y = capture_graph(round_trip)
            rec["graph_pair_s"] = _time(g.replay, iters)
            del g, y
        except Exception as exc:  # report, keep benchmarking
            rec["graph_error"] = f"{type(exc).__name__}: {exc}"
        if T <= FLOOR_MAX_TOKENS:
            progress(T, "latency floor and timer stamps")
            rec["floor"] = _latency_floor(tr, buf, x, w, dr, ds, iters, names)
        elif params.get("stages"):
            progress(T, "timer stamps")  # where a large exchange's time goes (the small ones' always print)
            kept, rec["stages"] = buf.tuning, {}
            try:
                for name in names:
                    buf.tuning = Tuning(**VARIANTS[name])
                    rec["stages"][name] = _stages(buf, x, w, dr, ds, iters)
            except Exception as exc:  # report, keep benchmarking (as the latency floor's stamps do)
                rec["stages_error"] = f"{type(exc).__name__}: {exc}"
                print(f"rank {me}: stamped exchange failed: {rec['stages_error']}", flush=True)
            finally:
                buf.tuning = kept
        buf.check()
        # fewer SMs for the exchange (what an overlap with expert compute could afford)
        rec["programs"] = {}
        for G in params.get("programs", []):
            progress(T, f"{G} programs")
            small = tr.new_buffer(capacity=T, hidden=H, elem_bytes=2, kmax=max(8, K), num_programs=G)
            small.tuning = buf.tuning
            sd: dict[str, Any] = {}

            def small_disp():
                sd["d"] = small.dispatch(x, w, dr, ds)

            t_sd = _time(small_disp, iters)
            t_sc = _time(lambda: small.combine(sd["d"][0], sd["d"][3]), iters)
            rec["programs"][G] = {"dispatch_s": t_sd, "combine_s": t_sc,
                                  "round_trip_rel_err": _round_trip_error(small, x, w, dr, ds, to_rank)}
            try:  # the pair's GPU latency with G programs: what a small-T graph would gain
                def small_pair():
                    r = small.dispatch(x, w, dr, ds)
                    return small.combine(r[0], r[3])

                g, y = capture_graph(small_pair)
                rec["programs"][G]["graph_pair_s"] = _time(g.replay, iters)
                del g, y
            except Exception as exc:  # report, keep benchmarking
                rec["programs"][G]["graph_error"] = f"{type(exc).__name__}: {exc}"
            small.check()
            dist.barrier()
            torch.cuda.synchronize()
            small.close()
        # NCCL textbook exchange of the same routing
        st: dict[str, Any] = {}

        def nd():
            st["d"] = nccl.dispatch(x, dr, ds, w)

        rec["nccl_dispatch_s"] = _time(nd, max(2, iters // 2))
        rxn = st["d"][0]
        rec["nccl_combine_s"] = _time(lambda: nccl.combine(rxn, w, st["d"][2]), max(2, iters // 2))
        # peer-copy ceiling: the same dispatch bytes into the peers' symmetric memory, all at once
        import nvshmem.core as core

        src = torch.empty(max(disp_bytes, 1) // max(W - 1, 1), dtype=torch.uint8, device=dev).random_(0, 255)
        recv = buf.dch.recv
        views = [core.get_peer_tensor(recv, d) for d in range(W) if d != me and not buf.remote[d]]
        off = me * buf.geo.region_bytes
        n = min(src.numel(), buf.geo.region_bytes)
        if views:
            # one stream per peer, so the copies to every peer run at once as the dispatch's
            # writes do (one after another, W=4 read 216 GB/s against the dispatch's 278)
            main = torch.cuda.current_stream(dev)
            streams = [torch.cuda.Stream(dev) for _ in views]

            def copy():
                for v, s in zip(views, streams):
                    s.wait_stream(main)
                    with torch.cuda.stream(s):
                        v[off:off + n].copy_(src[:n])
                for s in streams:
                    main.wait_stream(s)

            rec["ceiling_s"] = _time(copy, iters)
            rec["ceiling_bytes"] = n * len(views)
            # the same bytes stored by SMs into every peer at once (the copy engines above bound
            # nothing at W=4: the dispatch outpaced them)
            from ray_moe.bench.copy_ceiling import destination_table, peer_copy

            n16 = n - n % 16
            targets = [v[off:off + n16] for v in views]
            table = destination_table(targets, dev)  # built once: its host-to-device copy waits
            rec["sm_ceiling_s"] = _time(lambda: peer_copy(src[:n16], targets, table=table), iters)
            rec["sm_ceiling_bytes"] = n16 * len(views)
            # both at once: the copy engines move the first part of the bytes while the SMs store
            # the rest, at the split that ends both together (so a hybrid exchange's bound, and
            # whether the NVLinks carry more than either alone)
            f = rec["sm_ceiling_s"] / (rec["sm_ceiling_s"] + rec["ceiling_s"])
            rec["hybrid_ceiling_s"], rec["hybrid_frac"] = min(
                (_time(_hybrid_copy(src, views, streams, main, off, n16, q), iters), q)
                for q in (round(f, 2), round(f - 0.1, 2), round(f + 0.1, 2)))
            rec["hybrid_ceiling_bytes"] = n16 * len(views)
        dist.barrier()
        torch.cuda.synchronize()
        buf.close()  # the next size allocates its own (collective)
        torch.cuda.empty_cache()
        out.append(rec)
    return out


def _hybrid_copy(src, views, streams, main, off: int, n: int, frac: float):
    """A copy of src[:n] into every peer view at byte ``off``: the first ``frac`` of the bytes by
    the copy engines (a stream per peer), the rest by SM stores (one grid), at once."""
    from ray_moe.bench.copy_ceiling import destination_table, peer_copy

    k = int(n * min(max(frac, 0.0), 1.0)) // 16 * 16
    rest = [v[off + k:off + n] for v in views]
    table = destination_table(rest, src.device) if n > k else None

    def run() -> None:
        for v, s in zip(views, streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                v[off:off + k].copy_(src[:k])
        if n > k:
            peer_copy(src[k:n], rest, table=table)
        for s in streams:
            main.wait_stream(s)

    return run


def _latency_floor(tr: Any, buf: Any, x, w, dr, ds, iters: int, variants: list[str]) -> dict[str, Any]:
    """A small pair's fixed parts (:mod:`ray_moe.bench.latency_floor`), seconds: the dispatch and
    the combine each replayed alone from a CUDA graph, two empty launches and two of the layout's
    grid-wide wait (G programs) from a graph, and the one-way latency of a signal between ranks 0
    and 1 (1000 round trips in one kernel; other ranks idle through it; None without a peer
    pointer). ``floor_errors``: 1 if a wait of these kernels timed out. ``stages``: per launch
    variant (:data:`VARIANTS`), where the kernels' time goes (:func:`_stages`). Every rank runs it."""
    from ray_moe.bench.latency_floor import empty_kernel, grid_sync, ping_pong
    from ray_moe.device import capture_graph

    dev, me = x.device, tr.rank
    out: dict[str, Any] = {}
    g, _ = capture_graph(lambda: buf.dispatch(x, w, dr, ds))
    out["graph_dispatch_s"] = _time(g.replay, iters)
    r = buf.dispatch(x, w, dr, ds)
    g2, _ = capture_graph(lambda: buf.combine(r[0], r[3]))
    out["graph_combine_s"] = _time(g2.replay, iters)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    word = torch.zeros(1, dtype=torch.int32, device=dev)
    g3, _ = capture_graph(lambda: (empty_kernel(word), empty_kernel(word)))
    out["graph_two_empty_s"] = _time(g3.replay, iters)
    flags = torch.zeros(buf.geo.num_programs, dtype=torch.int32, device=dev)
    g4, _ = capture_graph(lambda: (grid_sync(flags, err), grid_sync(flags, err)))
    out["graph_two_grid_syncs_s"] = _time(g4.replay, iters)
    del g, g2, g3, g4
    sym = tr.runtime.alloc(8)  # collective: one symmetric int64 word per rank
    local, rounds, calls = sym.view(torch.int64), 1000, [0]
    peer_addr = tr.runtime.peer_ptr(local.data_ptr(), 1 - me) if me < 2 else 0

    def bounce() -> None:
        if peer_addr:
            ping_pong(local, peer_addr, err, base=calls[0] * rounds, rounds=rounds, first=me == 0)
        calls[0] += 1

    t = _time(bounce, 3)
    out["one_way_s"] = t / (2 * rounds) if peer_addr else None
    tr.runtime.barrier()
    tr.runtime.free(sym)
    out["floor_errors"] = int(err.item())
    from ray_moe.comm.nvshmem_kernels import Tuning

    kept, out["stages"] = buf.tuning, {}
    for name in variants:
        buf.tuning = Tuning(**VARIANTS[name])
        try:
            out["stages"][name] = _stages(buf, x, w, dr, ds, iters)
        except Exception as exc:  # report, keep benchmarking (the stamps compile variants of their own)
            out["stages_error"] = f"{type(exc).__name__}: {exc}"
            print(f"rank {me}: stamped exchange failed: {out['stages_error']}", flush=True)
            break
    buf.tuning = kept
    return out


def _stages(buf: Any, x, w, dr, ds, iters: int) -> dict[str, dict[str, float]]:
    """Where a small exchange's time goes inside its kernels: the dispatch and the combine each
    replayed alone from a CUDA graph with every program's timer stamped at its steps
    (``SymmetricBuffer.stamps``; nvshmem_kernels.DISPATCH_STAMPS / COMBINE_STAMPS), the last
    replay's stamps read. Per step, µs since the step before (a step the variant skips, e.g. the
    interleaved dispatch's separate wait, is folded into the next): the median and the largest
    over the programs with tokens, and "spread": the last program's start after the first's."""
    from ray_moe.comm.nvshmem_kernels import COMBINE_STAMPS, DISPATCH_STAMPS, STAMP_SLOTS
    from ray_moe.device import capture_graph

    G, T = buf.geo.num_programs, x.shape[0]
    buf.stamps = torch.zeros(2, G, int(STAMP_SLOTS), dtype=torch.int64, device=x.device)
    try:
        g, _ = capture_graph(lambda: buf.dispatch(x, w, dr, ds))
        _time(g.replay, iters)
        dispatch = buf.stamps[0].cpu()
        r = buf.dispatch(x, w, dr, ds)
        g2, _ = capture_graph(lambda: buf.combine(r[0], r[3]))
        _time(g2.replay, iters)
        combine = buf.stamps[1].cpu()
    finally:
        buf.stamps = None
    active = min(G, -(-T // max(1, -(-T // G)))) if T else 0  # programs whose token chunk is not empty
    return {"dispatch": stage_times(dispatch[:active], DISPATCH_STAMPS),
            "combine": stage_times(combine[:active], COMBINE_STAMPS)}


def stage_times(stamps: torch.Tensor, names: tuple[str, ...]) -> dict[str, float]:
    """stamps int64 [P, slots] (ns, 0: not stamped) → {step: median µs, step + " max": largest µs,
    "spread": µs between the first and the last program's start, "total": median µs start to end}."""
    out: dict[str, float] = {}
    if stamps.numel() == 0:
        return out
    st = (stamps - stamps[:, 0].min()).double()  # int64 first: ~1.8e18 ns in float64 is rounded to 256 ns
    out["spread"] = float(st[:, 0].max() - st[:, 0].min()) / 1e3
    prev = st[:, 0]
    for i, name in enumerate(names[1:], start=1):
        if not bool((stamps[:, i] > 0).all()):  # (a raw 0: a slot this variant does not stamp)
            continue
        cur = st[:, i]
        d = (cur - prev) / 1e3
        out[name], out[name + " max"] = float(d.median()), float(d.max())
        prev = cur
    out["total"] = float((prev - st[:, 0]).median()) / 1e3
    return out


def host_cost_worker(worker: Any, params: dict) -> list[dict]:
    """Runs on every rank (any W, also 1): dispatch+combine per call at each T_local, eager with
    the Launcher's direct launches off (every call through Triton's JIT, the launch path before
    the launch cache) and on (``owned``: also the dispatch's outputs owned by the buffer, as
    decoding runs it), and replayed from a CUDA graph. ``host_us``: wall time of issuing
    ``iters`` pairs without synchronising, per pair (the host cost where it exceeds the GPU's)."""
    import torch.distributed as dist

    from ray_moe.comm.nvshmem_kernels import Launcher, Tuning
    from ray_moe.device import capture_graph

    tr = worker.transport
    me, W, dev = tr.rank, tr.world_size, worker.device
    H, K, E = params["hidden"], params["top_k"], params["experts"]
    out = []
    for T in params["tokens"]:
        iters = params["iters"] * (5 if T < 4096 else 1)
        buf = tr.new_buffer(capacity=T, hidden=H, elem_bytes=2, kmax=max(8, K))
        buf.tuning = Tuning.for_hidden(H, W)
        x = torch.randn(T, H, dtype=torch.bfloat16, device=dev)
        dr, ds, w = _routing(T, E, K, W, 1000 * me + T, dev)

        def pair(reuse: bool = False):
            r = buf.dispatch(x, w, dr, ds, reuse_outputs=reuse)
            return buf.combine(r[0], r[3])

        rec: dict[str, Any] = {"rank": me, "W": W, "T": T, "fast_launch_works": bool(tr.fast_launch)}
        # jit: every call through Triton's JIT; fast: direct launches; owned: direct launches and
        # the dispatch's outputs owned by the buffer (reuse_outputs, as decoding runs it)
        for name, fast, reuse in (("jit", False, False), ("fast", True, False), ("owned", True, True)):
            if fast and not tr.fast_launch:
                continue
            buf.launcher = Launcher(fast=fast, device=dev)
            rec[f"{name}_pair_us"] = _time(lambda: pair(reuse), iters) * 1e6
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                pair(reuse)
            rec[f"{name}_host_us"] = (time.perf_counter() - t0) / iters * 1e6
            torch.cuda.synchronize()
            rec[f"{name}_launches"] = dict(buf.launcher.calls)
        if params.get("profile"):
            rec.update(_host_profile(buf, pair, x, w, dr, ds, iters))
        g, y = capture_graph(pair)
        rec["graph_pair_us"] = _time(g.replay, iters) * 1e6
        to_rank = torch.zeros(T, W, dtype=torch.bool, device=dev).scatter_(1, dr.long(), True)
        rec["round_trip_rel_err"] = _round_trip_error(buf, x, w, dr, ds, to_rank)
        del g, y
        buf.check()
        dist.barrier()
        torch.cuda.synchronize()
        buf.close()
        out.append(rec)
    return out


def _host_profile(buf: Any, pair: Any, x: torch.Tensor, w: torch.Tensor, dr: torch.Tensor, ds: torch.Tensor,
                  iters: int) -> dict:
    """Where the host time of one eager dispatch+combine goes: wall microseconds per call (no
    synchronisation) of the parts on their own, and cProfile's top functions over ``iters`` pairs
    with the dispatch's outputs owned by the buffer."""
    import cProfile
    import io
    import pstats

    def host_us(fn, n: int = iters) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return us

    T, dev = x.shape[0], x.device
    r = buf.dispatch(x, w, dr, ds)
    parts = {
        "dispatch": lambda: buf.dispatch(x, w, dr, ds),
        "owned dispatch": lambda: buf.dispatch(x, w, dr, ds, reuse_outputs=True),
        "combine": lambda: buf.combine(r[0], r[3]),
        "torch.empty": lambda: torch.empty(T, 8, dtype=torch.int32, device=dev),
        "six torch.empty": lambda: [torch.empty(T, 8, dtype=torch.int32, device=dev) for _ in range(6)],
        "key": lambda: buf._key("dispatch", T, x, dr, ds, w),
    }
    out = {f"host_{k}_us": host_us(fn) for k, fn in parts.items()}
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        pair(True)  # the owned pair: what is left once the dispatch allocates nothing
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    out["profile"] = text.getvalue()[-6000:]
    return out


FLOOR_MAX_TOKENS = 1024  # the latency floor is timed beside the pair up to this T_local
FLOOR_KEYS = ("graph_dispatch", "graph_combine", "graph_two_empty", "graph_two_grid_syncs", "one_way")


def _floor_summary(recs: list[dict]) -> dict[str, Any]:
    """The latency floor's parts in µs, each the slowest rank's (empty where not measured)."""
    floors = [r["floor"] for r in recs if "floor" in r]
    if not floors:
        return {}
    out: dict[str, Any] = {}
    for key in FLOOR_KEYS:
        values = [f[f"{key}_s"] for f in floors if f.get(f"{key}_s") is not None]
        out[f"floor_{key}_us"] = max(values) * 1e6 if values else None
    out["floor_errors"] = max(f["floor_errors"] for f in floors)
    return out


def _fp8_summary(recs: list[dict]) -> dict[str, Any]:
    """The FP8 wire dispatch's row of one T_local (slowest rank), beside bf16's of the same run."""
    if "fp8_dispatch_s" not in recs[0]:
        return {}
    worst = lambda key: max(r[key] for r in recs)  # noqa: E731
    bf, f8 = worst("bf16_dispatch_s"), worst("fp8_dispatch_s")
    return {"bf16_dispatch_us": bf * 1e6, "fp8_dispatch_us": f8 * 1e6,
            "fp8_quant_dispatch_us": worst("fp8_quant_dispatch_s") * 1e6,
            "bf16_dispatch_MB": worst("dispatch_bytes") / 1e6, "fp8_dispatch_MB": worst("fp8_dispatch_bytes") / 1e6,
            "fp8_bytes_ratio": worst("fp8_dispatch_bytes") / max(1, worst("dispatch_bytes")),
            "fp8_speedup": bf / f8, "fp8_rel_err": worst("fp8_rel_err")}


def _summarise(per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    for i, rec0 in enumerate(per_rank[0]):
        recs = [r[i] for r in per_rank]
        worst = lambda key: max(r.get(key, float("nan")) for r in recs)  # noqa: E731
        best = rec0["best"]
        v = lambda key: max(r["variants"][best][key] for r in recs)  # noqa: E731
        d, c, dc = v("dispatch_s"), v("combine_s"), v("pair_s")
        nd, nc = worst("nccl_dispatch_s"), worst("nccl_combine_s")
        dbytes = max(r["dispatch_bytes"] for r in recs)
        cbytes = max(r["combine_bytes"] for r in recs)
        ceilings = {}
        for kind in ("ceiling", "sm_ceiling", "hybrid_ceiling"):  # copy engines, SMs, both (slowest rank)
            t = max(r.get(f"{kind}_s", float("nan")) for r in recs)
            ceilings[kind] = max(r.get(f"{kind}_bytes", 0) for r in recs) / t / 1e9 if t == t else float("nan")
        cbw = max((b for b in ceilings.values() if b == b), default=float("nan"))  # the higher bounds
        rows.append({
            "T_local": rec0["T"], "variant": best,
            "dispatch_us": d * 1e6, "combine_us": c * 1e6, "pair_us": dc * 1e6,
            "owned_pair_us": worst("owned_pair_s") * 1e6, "graph_pair_us": worst("graph_pair_s") * 1e6,
            "dispatch_MB": dbytes / 1e6, "dispatch_GBps": dbytes / d / 1e9, "combine_GBps": cbytes / c / 1e9,
            "nccl_dispatch_us": nd * 1e6, "nccl_combine_us": nc * 1e6,
            "speedup_vs_nccl": (nd + nc) / dc, "ceiling_GBps": cbw,
            "ce_ceiling_GBps": ceilings["ceiling"], "sm_ceiling_GBps": ceilings["sm_ceiling"],
            "hybrid_ceiling_GBps": ceilings["hybrid_ceiling"], "hybrid_frac": rec0.get("hybrid_frac"),
            "dispatch_vs_ceiling": (dbytes / d / 1e9) / cbw if cbw == cbw else float("nan"),
            "graph_error": rec0.get("graph_error"),
            **_fp8_summary(recs),
            **_floor_summary(recs),
            "round_trip_rel_err": max(v.get("round_trip_rel_err", 0.0) for r in recs
                                      for v in [*r["variants"].values(), *r.get("programs", {}).values()]),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = usage.ArgumentParser(prog="ray-moe bench comm", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="128,4096,16384", help="T_local values, comma-separated")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--world-size", type=int, default=0, help="0: every GPU of the cluster")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", default="all", help=f"comma-separated of {', '.join(VARIANTS)} or all")
    p.add_argument("--force-remote", action="store_true", help="every peer through NVSHMEM puts")
    p.add_argument("--programs", default="", help="also time the best variant with these G (SMs), e.g. 16,32,64")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a local cluster)")
    p.add_argument("--host-cost", action="store_true",
                   help="only the host cost per call: eager dispatch+combine through Triton's JIT and through the"
                        " launch cache, and a CUDA-graph replay (any world size, also 1)")
    p.add_argument("--profile", action="store_true",
                   help="with --host-cost: time the parts of a call on their own and print cProfile's top functions")
    p.add_argument("--stages", action="store_true",
                   help=f"also above T_local={FLOOR_MAX_TOKENS}: where each variant's kernel time goes "
                        "(every program's timer stamped at its steps; always printed at small T)")
    p.add_argument("--json", default=None, help="write results here")
    a = p.parse_args(argv)
    for flag, value in (("--tokens", a.tokens), ("--programs", a.programs or "1")):
        if not all(v.strip().isdigit() and int(v) >= 1 for v in value.split(",")):
            p.error(f"{flag}={value!r} must be a comma list of positive integers")
    for flag in ("hidden", "top_k", "experts", "iters"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.top_k > a.experts:
        p.error(f"--top-k {a.top_k} is larger than --experts {a.experts}")
    unknown = [] if a.variants == "all" else [v for v in a.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)} or all")

    import ray
    from tabulate import tabulate

    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup, connect

    connect(a.address)
    W = a.world_size or int(ray.cluster_resources().get("GPU", 0))
    if a.host_cost:
        return _host_cost_main(a, W)
    if W < 2:
        print(f"bench comm needs at least 2 GPUs in the Ray cluster, found {W}")
        return 2
    tokens = [int(t) for t in a.tokens.split(",")]
    variants = list(VARIANTS) if a.variants == "all" else a.variants.split(",")
    cfg = Config.from_dict({
        "model": {"d_model": a.hidden, "n_heads": 1, "seq_len": max(tokens), "dtype": "bfloat16"},
        "moe": {"num_experts": a.experts, "top_k": a.top_k},
        "train": {"batch_size": W},  # global batch: one sequence of max(tokens) per rank
        "parallel": {"world_size": W, "device": "cuda", "transport": "nvshmem",
                     "force_remote_path": a.force_remote,
                     "startup_timeout_s": 180},
    })
    params = {"tokens": tokens, "hidden": a.hidden, "top_k": a.top_k, "experts": a.experts,
              "iters": a.iters, "variants": variants,
              "programs": [int(g) for g in a.programs.split(",") if g], "stages": a.stages}
    with WorkerGroup(cfg) as group:
        devices = group.execute(lambda w: torch.cuda.get_device_name(w.device), timeout=120)
        per_rank = group.execute(bench_worker, params, timeout=1800)
    rows = _summarise(per_rank)
    cols = ["T_local", "variant", "dispatch_us", "combine_us", "pair_us", "owned_pair_us", "graph_pair_us", "dispatch_MB",
            "dispatch_GBps", "combine_GBps", "nccl_dispatch_us", "nccl_combine_us", "speedup_vs_nccl",
            "ce_ceiling_GBps", "sm_ceiling_GBps", "hybrid_ceiling_GBps", "dispatch_vs_ceiling", "round_trip_rel_err"]
    print(f"W={W} on {devices[0]}, H={a.hidden} K={a.top_k} E={a.experts} bf16"
          f"{' force_remote_path' if a.force_remote else ''}")
    print(tabulate([[f"{r[c]:.1e}" if c == "round_trip_rel_err" else r[c] for c in cols] for r in rows],
                   headers=cols, floatfmt=".1f"))
    fp8_cols = ["T_local", "bf16_dispatch_us", "fp8_dispatch_us", "fp8_quant_dispatch_us", "bf16_dispatch_MB",
                "fp8_dispatch_MB", "fp8_bytes_ratio", "fp8_speedup", "fp8_rel_err"]
    if rows and "fp8_dispatch_us" in rows[0]:
        print("\nFP8 rows on the wire (moe.expert_precision: fp8; E4M3 rows + 1x128 scales) beside bf16, "
              "same buffer, ABBA medians (fp8_quant: with the quantisation before the dispatch):")
        print(tabulate([[r[c] for c in fp8_cols] for r in rows], headers=fp8_cols, floatfmt=".3f"))
    progs = sorted({g for rank in per_rank for rec in rank for g in rec.get("programs", {})}, key=int)
    if progs:
        table = []
        for i, rec0 in enumerate(per_rank[0]):
            for g in progs:
                d = max(rank[i]["programs"][g]["dispatch_s"] for rank in per_rank)
                c = max(rank[i]["programs"][g]["combine_s"] for rank in per_rank)
                gp = max(rank[i]["programs"][g].get("graph_pair_s", float("nan")) for rank in per_rank)
                table.append([rec0["T"], g, d * 1e6, c * 1e6, gp * 1e6, rec0["dispatch_bytes"] / d / 1e9,
                              rec0["combine_bytes"] / c / 1e9])
        print("\nwith G programs (SMs) instead of all, variant as above:")
        print(tabulate(table, headers=["T_local", "G", "dispatch_us", "combine_us", "graph_pair_us",
                                       "dispatch_GBps", "combine_GBps"], floatfmt=".1f"))
    floor_rows = [[r["T_local"], r["graph_pair_us"], *(r[f"floor_{k}_us"] for k in FLOOR_KEYS)]
                  for r in rows if "floor_one_way_us" in r]
    if floor_rows:
        print("\nsmall T, replayed from CUDA graphs (µs): the pair, its two kernels alone, and its fixed parts "
              "(ray_moe.bench.latency_floor)")
        print(tabulate(floor_rows, headers=["T_local", "pair", "dispatch", "combine", "2 empty launches",
                                            "2 grid syncs", "one-way signal"],
                       floatfmt=".2f"))
    stage_recs = [(r, rank[i]) for i, r in enumerate(rows) for rank in per_rank
                  if rank[i].get("stages") or rank[i].get("floor", {}).get("stages")]
    if stage_recs:
        print("\nsteps inside the kernels alone, replayed from CUDA graphs (µs since the step before; median "
              "and largest over the programs with tokens)")
        for r, rec in stage_recs:
            for variant, stages in (rec.get("stages") or rec["floor"]["stages"]).items():
                for kind, st in stages.items():
                    print(f"T_local={r['T_local']} {variant} rank {rec['rank']} {kind}: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in st.items()))
    bad = [r["T_local"] for r in rows if not r["round_trip_rel_err"] <= 1e-2]
    bad += [r["T_local"] for r in rows if r.get("floor_errors")]
    if bad:
        print(f"ERROR: at T_local={bad} combine(dispatch(x)) != x * ranks (round_trip_rel_err > 1e-2) or a "
              "latency-floor kernel's wait timed out (floor_errors)")
    for r in rows:
        if r["graph_error"]:
            print(f"T={r['T_local']}: CUDA graph failed: {r['graph_error']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world_size": W, "device": devices[0], "force_remote": a.force_remote,
                       "summary": rows, "per_rank": per_rank}, f, indent=1)
    return 1 if bad else 0


def _host_cost_main(a: argparse.Namespace, W: int) -> int:
    from tabulate import tabulate

    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup

    if W < 1:
        print("bench comm --host-cost needs a GPU in the Ray cluster")
        return 2
    tokens = [int(t) for t in a.tokens.split(",")]
    cfg = Config.from_dict({
        "model": {"d_model": a.hidden, "n_heads": 1, "seq_len": max(tokens), "dtype": "bfloat16"},
        "moe": {"num_experts": a.experts, "top_k": a.top_k},
        "train": {"batch_size": W},
        "parallel": {"world_size": W, "device": "cuda", "transport": "nvshmem",
                     "force_remote_path": a.force_remote,
                     "startup_timeout_s": 180},
    })
    params = {"tokens": tokens, "hidden": a.hidden, "top_k": a.top_k, "experts": a.experts, "iters": a.iters,
              "profile": a.profile}
    with WorkerGroup(cfg) as group:
        device = group.execute(lambda w: torch.cuda.get_device_name(w.device), timeout=120)[0]
        per_rank = group.execute(host_cost_worker, params, timeout=900)
    cols = ["T", "jit_pair_us", "jit_host_us", "fast_pair_us", "fast_host_us", "owned_pair_us", "owned_host_us",
            "graph_pair_us", "round_trip_rel_err"]
    rows = []
    for i, rec0 in enumerate(per_rank[0]):
        rows.append({c: max(r[i].get(c, float("nan")) for r in per_rank) if c != "T" else rec0["T"] for c in cols})
    print(f"W={W} on {device}, H={a.hidden} K={a.top_k} E={a.experts} bf16; direct launch works: "
          f"{per_rank[0][0]['fast_launch_works'] if per_rank[0] else '?'} (slowest rank shown, microseconds per call)")
    print(tabulate([[r[c] for c in cols] for r in rows], headers=cols, floatfmt=".1f"))
    if a.profile:
        for rank in per_rank:
            for rec in rank:
                parts = {k[5:-3]: round(v, 1) for k, v in rec.items() if k.startswith("host_") and k != "host_us"}
                print(f"rank {rec['rank']} T={rec['T']} host microseconds per call: {parts}")
        print(per_rank[0][0].get("profile", ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world_size": W, "device": device, "summary": rows, "per_rank": per_rank}, f, indent=1)
    return 0 if all(r["round_trip_rel_err"] <= 1e-2 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
