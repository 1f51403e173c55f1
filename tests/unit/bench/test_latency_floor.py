"""The latency-floor kernels (ray_moe/bench/latency_floor.py) under Triton's interpreter: the
ping-pong between two processes sharing a file (a peer pointer is the same offset in this
process's mapping of it, as tests/nvshmem_pes.py does for NVSHMEM), its bounded wait without a
peer, and the grid-wide wait's device-side launch count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

_SCRIPT = r"""
import sys
import torch
from ray_moe.bench.latency_floor import ping_pong
path, rank, rounds, spin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
words = torch.from_file(path, shared=True, size=2, dtype=torch.int64)
local, peer = words[rank:rank + 1], words[1 - rank:2 - rank]
err = torch.zeros(1, dtype=torch.int32)
for call in range(2):
    ping_pong(local, peer.data_ptr(), err, base=call * rounds, rounds=rounds, first=rank == 0, spin_limit=spin)
print(int(local.item()), int(err.item()))
"""


def _env() -> dict:
    return dict(os.environ, TRITON_INTERPRET="1",
                PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))


def _ranks(tmp_path, ranks, rounds, spin):
    path = tmp_path / "words"
    path.write_bytes(bytes(16))
    script = tmp_path / "pp.py"
    script.write_text(_SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script), str(path), str(r), str(rounds), str(spin)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for r in ranks]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        outs.append(tuple(int(v) for v in out.split()))
    return outs


def test_ping_pong_bounces_between_two_processes(tmp_path):
    """Two calls of 3 round trips: each rank's word ends at 6 (the peer added to it once per
    round), and no wait timed out."""
    assert _ranks(tmp_path, (0, 1), rounds=3, spin=1 << 30) == [(6, 0), (6, 0)]


@pytest.mark.parametrize("rank", [0, 1])
def test_ping_pong_without_a_peer_gives_up_and_says_so(tmp_path, rank):
    """No peer: the wait ends after spin_limit polls with err set, and the rank sends nothing more."""
    (word, err), = _ranks(tmp_path, (rank,), rounds=3, spin=50)
    assert err == 1 and word == 0


_GRID_SCRIPT = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from ray_moe.bench.latency_floor import empty_kernel, grid_sync
flags, err = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
for _ in range(3):  # one program: the launch count it keeps is the only wait
    grid_sync(flags, err, spin_limit=50)
assert flags.tolist() == [3] and err.item() == 0, (flags, err)
late = torch.tensor([5, 0], dtype=torch.int32)  # program 1 never catches up with program 0 here
grid_sync(late, err, spin_limit=50)  # (the interpreter runs programs one after another)
assert err.item() == 1
out = torch.zeros(4, dtype=torch.int32)
empty_kernel(out)
assert out.tolist() == [1, 1, 1, 1]
print("grid sync ok")
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _GRID_SCRIPT)
def test_grid_sync_counts_launches_on_the_device(interpreter_scripts):
    """The grid-wide wait keeps each program's launch count on the device (a graph replays the
    launch unchanged) and gives up, saying so, when a program never catches up."""
    interpreter_scripts.assert_prints(_GRID_SCRIPT, "grid sync ok")


def test_the_floor_kernels_compile_for_hopper():
    from ray_moe.bench.latency_floor import _empty_kernel, _grid_sync_kernel, _ping_pong_kernel
    from tests.support import compile_for_sm90

    assert compile_for_sm90(_empty_kernel, {"out_ptr": "*i32"}, {}, num_warps=1)["cubin"]
    for first in (True, False):
        sig = {"local_ptr": "*i64", "peer_addr": "i64", "err_ptr": "*i32", "base": "i64", "rounds": "i32",
               "spin_limit": "i32", "FIRST": "constexpr"}
        assert compile_for_sm90(_ping_pong_kernel, sig, {"FIRST": first}, num_warps=1)["cubin"]
    sig = {"flags_ptr": "*i32", "err_ptr": "*i32", "spin_limit": "i32", "G": "constexpr", "G_PAD": "constexpr"}
    assert compile_for_sm90(_grid_sync_kernel, sig, {"G": 132, "G_PAD": 256}, num_warps=16)["cubin"]


def test_bench_comm_reports_each_part_as_the_slowest_ranks():
    from ray_moe.bench.comm import _floor_summary

    part = lambda d, one_way, errors=0: {"floor": {  # noqa: E731
        "graph_dispatch_s": d, "graph_combine_s": 2 * d, "graph_two_empty_s": 1e-6, "graph_two_grid_syncs_s": 3e-6,
        "one_way_s": one_way, "floor_errors": errors}}
    row = _floor_summary([part(10e-6, 1e-6), part(12e-6, None, 1)])
    assert row["floor_graph_dispatch_us"] == pytest.approx(12.0) and row["floor_graph_combine_us"] == pytest.approx(24.0)
    assert row["floor_one_way_us"] == pytest.approx(1.0) and row["floor_errors"] == 1  # (rank 2 bounced nothing)
    assert _floor_summary([{"T": 16384}]) == {}


def test_stage_times_fold_a_skipped_step_into_the_next():
    """bench comm's per-step reading of the exchange kernels' timer stamps: medians over the
    programs, a slot a variant does not stamp (0) folded into the next step, the start spread."""
    from ray_moe.bench.comm import stage_times

    names = ("start", "a", "b", "c")
    st = torch.tensor([[1000, 3000, 0, 9000], [2000, 3000, 0, 6000], [4000, 9000, 0, 12000]], dtype=torch.int64)
    out = stage_times(st, names)
    assert out["spread"] == pytest.approx(3.0)
    assert out["a"] == pytest.approx(2.0) and out["a max"] == pytest.approx(5.0)
    assert "b" not in out and out["c"] == pytest.approx(3.0) and out["c max"] == pytest.approx(6.0)
    assert out["total"] == pytest.approx(8.0)  # per program 8, 4, 8 µs
    assert stage_times(st[:0], names) == {}


def test_stage_times_keep_nanoseconds_of_a_wall_clock_timer():
    """%globaltimer counts ns since 1970 (~1.8e18): differences must be taken before float64,
    which only holds every 256th ns at that size."""
    from ray_moe.bench.comm import stage_times

    base = 1_790_000_000_000_000_000
    st = torch.tensor([[base, base + 100, base + 170], [base + 30, base + 130, base + 230]], dtype=torch.int64)
    out = stage_times(st, ("start", "a", "b"))
    assert out["a"] == pytest.approx(0.1) and out["spread"] == pytest.approx(0.03)
    assert out["b max"] == pytest.approx(0.1) and out["total"] == pytest.approx(0.17)  # (torch.median: the lower of two)
