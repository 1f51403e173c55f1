"""Where a profiled GPU step idles: the gaps between its kernels, from a Chrome trace.

``bench layer --ep-profile`` sums each kernel's time; an EP step's wall time also holds moments
when no kernel runs at all (the host late with a launch, a host synchronisation, a wait on
another stream). :func:`timeline_gaps` finds them in the trace torch.profiler exports: the union
of every kernel interval on the device, the idle stretches between them, and for each of the
longest: the kernels either side, whether the host launched the next kernel only after the device
went idle (host-bound), and any synchronising runtime call the host was in meanwhile.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

# runtime calls that block the host until the device (or a stream/event) is done
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaStreamWaitEvent", "cuStreamSynchronize", "cuCtxSynchronize",
              "cuEventSynchronize", "cuMemcpy")


def load_trace(path: str) -> list[dict]:
    """The events of a Chrome trace (``.json``, or ``.json.gz`` as ``bench layer --ep-trace-dir``
    keeps them)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def keep_gzipped(raw: str, path: str) -> str:
    """Copy the Chrome trace at ``raw`` (as torch.profiler exports it) to ``path`` gzipped, the
    form :func:`load_trace` reads and the benches keep (its directory made). Returns ``path``."""
    import os
    import shutil

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


def stream_listing(events: list[dict], skip: tuple[str, ...] = ("nccl",), width: int = 60) -> list[str]:
    """One line per kernel in start order, after the last kernel named with a ``skip`` prefix:
    start and end (ms from the first kernel), duration (ms), the stream it ran on, its name; so
    what ran beside what (an exchange on the comm stream beside the experts' GEMMs) reads off."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    marks = [k["ts"] + k["dur"] for k in kernels if k.get("name", "").startswith(skip)]
    if marks:
        kernels = [k for k in kernels if k["ts"] >= max(marks)]
    if not kernels:
        return []
    t0 = kernels[0]["ts"]
    lines = [f"{'start':>8} {'end':>8} {'ms':>7} {'stream':>6}  kernel"]
    for k in kernels:
        stream = k.get("args", {}).get("stream", k.get("tid", "?"))
        lines.append(f"{(k['ts'] - t0) / 1e3:8.3f} {(k['ts'] + k['dur'] - t0) / 1e3:8.3f} {k['dur'] / 1e3:7.3f} "
                     f"{stream!s:>6}  {k['name'][:width]}")
    return lines


def timeline_gaps(events: list[dict], top: int = 8, min_gap_us: float = 5.0,
                  skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Summary of a trace's device timeline (times in microseconds).

    Returns ``wall_us`` (first kernel start to last kernel end), ``busy_us`` (the union of kernel
    intervals), ``idle_us`` (wall - busy), ``overlap_us`` (the kernels' summed time less
    ``busy_us``: what ran beside other kernels, e.g. an exchange beside the experts),
    ``beside`` (per kernel name, its microseconds with some other kernel running, the largest
    first), ``gaps`` (count of idle stretches ≥ ``min_gap_us``)
    and ``top`` (the ``top`` longest: ``gap_us``, ``at_us`` from the first kernel, ``before`` and
    ``after`` kernel names, ``host_late_us``: how long after the gap began the host launched the
    kernel after it (> 0: the host was behind), ``sync``: synchronising runtime calls overlapping
    the gap, with their microseconds inside it). The timeline starts after the last kernel whose
    name starts with one of ``skip`` (a barrier before the step: it and what ran before it are
    left out)."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"),
                     key=lambda e: e["ts"])
    marks = [k["ts"] + k["dur"] for k in kernels if k.get("name", "").startswith(skip)]
    if marks:
        kernels = [k for k in kernels if k["ts"] >= max(marks)]
    empty = {"wall_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "overlap_us": 0.0, "beside": {}, "gaps": 0,
             "top": []}
    if not kernels:
        return empty
    # launches through the runtime (torch) and the driver (Triton's cuLaunchKernelEx)
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"]
    launch_at = {e["args"]["correlation"]: e["ts"] for e in runtime
                 if "correlation" in e.get("args", {})}
    syncs = [e for e in runtime if e.get("name", "").startswith(SYNC_CALLS)]
    t0 = kernels[0]["ts"]
    busy, end, last = 0.0, kernels[0]["ts"], kernels[0]
    gaps = []
    for k in kernels:
        if k["ts"] > end + min_gap_us:
            gaps.append((k["ts"] - end, end, last, k))
        if k["ts"] > end:
            busy += k["dur"]
        else:
            busy += max(0.0, k["ts"] + k["dur"] - end)
        if k["ts"] + k["dur"] >= end:
            end, last = k["ts"] + k["dur"], k
    out = {"wall_us": end - t0, "busy_us": busy, "idle_us": end - t0 - busy,
           "overlap_us": sum(k["dur"] for k in kernels) - busy, "beside": _time_beside(kernels),
           "gaps": len(gaps), "top": []}
    for gap, start, before, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        launched = launch_at.get(after.get("args", {}).get("correlation"))
        overlap = {}
        for s in syncs:
            inside = min(s["ts"] + s["dur"], start + gap) - max(s["ts"], start)
            if inside > 0:
                overlap[s["name"]] = overlap.get(s["name"], 0.0) + inside
        out["top"].append({
            "gap_us": gap, "at_us": start - t0, "before": before["name"], "after": after["name"],
            "host_late_us": None if launched is None else launched - start,
            "sync": {k: round(v, 1) for k, v in overlap.items()},
        })
    return out


def _time_beside(kernels: list[dict]) -> dict[str, float]:
    """Per kernel name, the microseconds its launches ran while another kernel ran too (kernels
    sorted by start; quadratic in the overlapping ones only)."""
    beside: dict[str, float] = {}
    for i, k in enumerate(kernels):
        start, stop = k["ts"], k["ts"] + k["dur"]
        cover = []  # the other kernels' parts inside [start, stop)
        for j, o in enumerate(kernels):
            if j != i and o["ts"] < stop and o["ts"] + o["dur"] > start:
                cover.append((max(o["ts"], start), min(o["ts"] + o["dur"], stop)))
            if o["ts"] >= stop:
                break
        covered, end = 0.0, start
        for a, b in sorted(cover):
            if b > end:
                covered += b - max(a, end)
                end = b
        if covered > 0:
            beside[k["name"]] = beside.get(k["name"], 0.0) + covered
    return dict(sorted(beside.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    """``python -m ray_moe.bench.timeline TRACE [...]``: each trace's kernels in start order, then
    its idle and overlap summary (:func:`timeline_gaps`)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ray_moe.bench.timeline", description=main.__doc__)
    p.add_argument("traces", nargs="+", help="Chrome traces (.json or .json.gz)")
    p.add_argument("--width", type=int, default=60, help="characters of each kernel name")
    p.add_argument("--after", default="nccl",
                   help="start after the last kernel whose name starts with this (default nccl: the barrier "
                        "before `bench layer --ep-profile`'s steps); '' lists every kernel (a training "
                        "step's own NCCL reductions, `bench overlap`)")
    args = p.parse_args(argv)
    skip = (args.after,) if args.after else ()
    for path in args.traces:
        try:
            events = load_trace(path)
        except (OSError, ValueError) as exc:
            p.exit(2, f"{path}: not a readable Chrome trace ({exc})\n")
        print(f"# {path}")
        print("\n".join(stream_listing(events, skip=skip, width=args.width)))
        gaps = timeline_gaps(events, skip=skip)
        print(f"wall {gaps['wall_us'] / 1e3:.3f} ms, busy {gaps['busy_us'] / 1e3:.3f}, idle {gaps['idle_us'] / 1e3:.3f}, "
              f"beside other kernels {gaps['overlap_us'] / 1e3:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
