"""timeline_gaps: idle stretches of a device timeline, from a hand-built Chrome trace."""

from __future__ import annotations

import json

from ray_moe.bench.timeline import load_trace, main, stream_listing, timeline_gaps


def _kernel(name, ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _runtime(name, ts, dur, corr=None):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur,
            "args": {} if corr is None else {"correlation": corr}}


def test_gaps_busy_and_their_causes(tmp_path):
    events = [
        _kernel("a", 100, 50, 1),            # [100, 150)
        _kernel("b", 120, 10, 2),            # inside a (another stream): no gap, no extra busy time
        _kernel("c", 400, 100, 3),           # idle 150 -> 400: the host launched c at 380
        _kernel("d", 503, 20, 4),            # 3 us: under min_gap_us, not a gap
        _kernel("e", 900, 10, 5),            # idle 523 -> 900 during a stream synchronisation
        _runtime("cudaLaunchKernel", 380, 5, 3),
        {**_runtime("cuLaunchKernelEx", 200, 5, 5), "cat": "cuda_driver"},  # e (a Triton kernel) launched
        # early: the device waited on something else
        _runtime("cudaStreamSynchronize", 600, 250),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    tl = timeline_gaps(load_trace(str(path)), top=5)
    assert tl["wall_us"] == 810 and tl["busy_us"] == 50 + 100 + 20 + 10
    assert tl["idle_us"] == 810 - 180 and tl["gaps"] == 2
    assert tl["overlap_us"] == 10 and tl["beside"] == {"a": 10, "b": 10}  # b ran inside a
    first, second = tl["top"]
    assert (first["gap_us"], first["before"], first["after"]) == (377, "d", "e")
    assert first["host_late_us"] == 200 - 523 and first["sync"] == {"cudaStreamSynchronize": 250.0}
    assert (second["gap_us"], second["at_us"], second["before"], second["after"]) == (250, 50, "a", "c")
    assert second["host_late_us"] == 230 and second["sync"] == {}


def test_the_timeline_starts_after_the_barrier():
    events = [_kernel("fill", 0, 5, 0), _kernel("ncclDevKernel_AllReduce", 100, 10, 1),
              _kernel("a", 500, 10, 2), _kernel("b", 600, 10, 3)]
    tl = timeline_gaps(events, skip=("nccl",))  # the barrier and the fill before it are left out
    assert tl["wall_us"] == 110 and tl["busy_us"] == 20 and [g["before"] for g in tl["top"]] == ["a"]
    assert timeline_gaps(events)["wall_us"] == 610


def test_no_kernels_is_an_empty_timeline():
    tl = timeline_gaps([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}])
    assert tl == {"wall_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "overlap_us": 0.0, "beside": {}, "gaps": 0,
                  "top": []}


def test_time_beside_counts_each_moment_once():
    # x [0, 100) beside y [10, 60) and z [40, 120): x is covered over [10, 100) = 90, y 50, z 60
    tl = timeline_gaps([_kernel("x", 0, 100, 1), _kernel("y", 10, 50, 2), _kernel("z", 40, 80, 3)])
    assert tl["busy_us"] == 120 and tl["overlap_us"] == 230 - 120
    assert tl["beside"] == {"x": 90, "z": 60, "y": 50}


def test_stream_listing_orders_kernels_with_their_streams(tmp_path, capsys):
    events = [{**_kernel("gemm", 2000, 1500, 2), "args": {"stream": 7}},
              {**_kernel("ncclDevKernel_AllReduce", 0, 10, 0), "args": {"stream": 7}},
              {**_kernel("_dispatch_kernel", 1000, 2000, 1), "args": {"stream": 13}}]
    lines = stream_listing(events)
    assert lines[1:] == ["   0.000    2.000   2.000     13  _dispatch_kernel",
                         "   1.000    2.500   1.500      7  gemm"]
    import gzip
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "_dispatch_kernel" in out and "wall 2.500 ms, busy 2.500, idle 0.000, beside other kernels 1.000" in out



def _listed_kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}


def test_listing_starts_after_the_last_nccl_kernel_unless_told_otherwise(tmp_path, capsys):
    """The default skips what ran before the layer bench's barrier (the last NCCL kernel); a
    training step's own reductions (a ZeRO step ends with an all-gather) need ``--after ''``,
    which lists every kernel."""
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        _listed_kernel("gemm_a", 0, 10), _listed_kernel("ncclDevKernel_AllGather", 20, 5), _listed_kernel("gemm_b", 30, 10)]}))
    assert main([str(trace)]) == 0
    default = capsys.readouterr().out
    assert "gemm_b" in default and "gemm_a" not in default and "ncclDev" not in default
    assert main([str(trace), "--after", ""]) == 0
    whole = capsys.readouterr().out
    assert all(k in whole for k in ("gemm_a", "ncclDevKernel_AllGather", "gemm_b"))
    assert "wall 0.040 ms" in whole
