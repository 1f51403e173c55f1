"""The owned small-batch exchange's bound launches (``Launcher.bound``): a later owned dispatch or
combine of a shape passes the compiled kernel exactly the arguments the plain direct launch would,
only without rebuilding them. Checked on the CPU with the kernels replaced by recorders (the
direct launch itself runs on the device: tests/gpu/test_nvshmem_gpu.py's decoding test)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch


class _Recorder:
    """Stands in for a Triton kernel: the JIT call records its keyword arguments, the compiled
    kernel's launches record their positional arguments (what Launcher and BoundLaunch pass)."""

    def __init__(self, real) -> None:
        self.arg_names = real.arg_names
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        rec = self

        class Compiled:
            function = object()

            def __getitem__(self, grid3):
                return lambda *args: rec.launches.append(args)

        def jit(**kw):
            rec.launches.append(tuple(kw.get(n) for n in rec.arg_names))
            return Compiled()
        return jit


def _ptrs(args: tuple) -> tuple:
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.fixture
def buffer(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    import torch.distributed as dist

    from ray_moe.comm import nvshmem_kernels as nk
    from tests.nvshmem_pes import FileRuntime, make_transport

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp_path, 'pg')}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        recorders = {"dispatch": _Recorder(nk._dispatch_kernel), "combine": _Recorder(nk._combine_kernel)}
        monkeypatch.setattr(nk, "_dispatch_kernel", recorders["dispatch"])
        monkeypatch.setattr(nk, "_combine_kernel", recorders["combine"])
        tr = make_transport(FileRuntime(str(tmp_path), 0, 1), 1 << 10)
        buf = tr.buffer
        buf.launcher = nk.Launcher(fast=True, device=torch.device("cpu"))
        yield buf, recorders
    finally:
        dist.destroy_process_group()


def test_owned_calls_launch_with_the_arguments_of_the_plain_direct_launch(buffer):
    buf, rec = buffer
    T, K, H = 8, 2, buf.geo.hidden
    g = torch.Generator().manual_seed(0)

    def inputs():
        x = torch.randn(T, H, generator=g)
        dr = torch.zeros(T, K, dtype=torch.int32)
        ds = torch.randint(0, 2, (T, K), generator=g, dtype=torch.int32)
        return x, torch.rand(T, K, generator=g), dr, ds

    first = inputs()
    buf.dispatch(*first, reuse_outputs=True)  # the shape's first call: JIT, then the launch is bound
    assert len(buf._owned_dispatch) == 1
    for _ in range(2):
        x, w, dr, ds = inputs()
        bound = dict(buf._owned_dispatch)
        buf._owned_dispatch.clear()  # the plain direct launch of the same call
        plain = buf.dispatch(x, w, dr, ds, reuse_outputs=True)
        want = _ptrs(rec["dispatch"].launches[-1])
        buf._owned_dispatch.update(bound)
        got_out = buf.dispatch(x, w, dr, ds, reuse_outputs=True)
        assert _ptrs(rec["dispatch"].launches[-1]) == want
        assert all(a is b for a, b in zip(plain[:3], got_out[:3])) and got_out[3].owned
    # the owned layout's combine: its own tensors bound, the rows and the new output filled in
    layout = got_out[3]
    partial = torch.randn(buf.geo.world_size * layout.capacity, H, generator=g)
    buf.combine(partial, layout)
    assert len(buf._owned_combine) == 1
    bound = dict(buf._owned_combine)
    buf._owned_combine.clear()
    out_plain = buf.combine(partial, layout)
    want = [("OUT" if a == out_plain.data_ptr() else a) for a in _ptrs(rec["combine"].launches[-1])]
    buf._owned_combine.update(bound)
    out = buf.combine(partial, layout)
    assert [("OUT" if a == out.data_ptr() else a) for a in _ptrs(rec["combine"].launches[-1])] == want
    assert "OUT" in want
    # calls that must not take a bound launch: outputs not owned, and another shape
    n = len(rec["dispatch"].launches)
    x, w, dr, ds = inputs()
    fresh = buf.dispatch(x, w, dr, ds)
    assert not fresh[3].owned and fresh[0] is not got_out[0] and len(rec["dispatch"].launches) == n + 1
    buf.dispatch(x[:4], w[:4], dr[:4], ds[:4], reuse_outputs=True)
    assert len(buf._owned_dispatch) == 2
