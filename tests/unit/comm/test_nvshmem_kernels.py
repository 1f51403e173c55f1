"""The NVSHMEM transport's kernels, checked without a GPU: layout reference, region geometry,
sm_90 compilation with 16-byte row accesses, the layout prefix under Triton's interpreter."""

from __future__ import annotations

import sys

import pytest
import torch


def test_layout_reference_and_chunks():
    from tests.references import chunk_bounds, layout_reference

    dr = torch.tensor([[0, 1], [1, 1], [0, 0], [1, 0]], dtype=torch.int32)
    pos, counts = layout_reference(dr, 2)
    assert pos.tolist() == [[0, 0], [-1, 1], [1, -1], [2, 2]]
    assert counts.tolist() == [3, 3]
    assert chunk_bounds(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert chunk_bounds(0, 2) == [(0, 0), (0, 0)]


@pytest.mark.parametrize("kmax", [1, 8, 10, 13])
def test_geometry_sizes_regions_for_the_rounded_meta_width(kmax):
    """Row meta is laid out with KMAX rounded up to a multiple of 4 (16-byte aligned rows); the
    region must be sized with the same width or late rows would spill into the next region."""
    from ray_moe.comm.nvshmem_kernels import Geometry

    geo = Geometry(world_size=2, rank=0, capacity=1000, hidden=4096, elem_bytes=2, kmax=kmax, num_programs=132)
    assert geo.kmax % 4 == 0 and geo.kmax >= kmax
    assert geo.meta_bytes == 8 * geo.kmax
    assert geo.region_bytes >= geo.cm_bytes + geo.capacity * (geo.row_bytes + 8 * geo.kmax)
    assert geo.region_bytes % 256 == 0 and geo.cm_bytes % 256 == 0 and geo.row_bytes % 16 == 0


def test_default_tuning_interleaves_at_two_ranks_and_rotates_from_three():
    """Tuning.for_hidden: whole 4096-wide rows for wide rows; the interleaved exchange by default
    where it was timed faster (two ranks; slower at four), the combine's ring order from three."""
    from ray_moe.comm.nvshmem_kernels import Tuning

    assert Tuning.for_hidden(4096, 2).key() == (8, 4096, 16, False, True)
    assert Tuning.for_hidden(4096, 4).key() == (8, 4096, 16, True, False)  # rotated combine from W=3
    assert Tuning.for_hidden(1024, 3).rotate_peers and not Tuning.for_hidden(1024, 2).rotate_peers
    assert Tuning.for_hidden(1024, 2).key() == Tuning().key() and not Tuning().interleave


def test_nvshmem_module_imports_lazily():
    import ray_moe.comm.nvshmem as nv

    assert nv.NVSHMEMTransport.name == "nvshmem"
    with pytest.raises(nv.NVSHMEMError, match="nvshmem4py|bootstrap"):
        try:
            import nvshmem.core  # noqa: F401

            pytest.skip("nvshmem4py is installed here")
        except ImportError:
            nv.create_unique_id(torch.device("cpu"))


def test_kernels_compile_for_hopper_with_vector_row_access():
    """The Triton kernels compile for sm_90 without a GPU (catches syntax/type errors in CI), and
    every row of the exchange (local tensors, peer pointers, symmetric regions) moves with 16-byte
    vector accesses: scalar 2-byte accesses over NVLink made the first version latency-bound."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from ray_moe.comm import nvshmem_kernels as dc

    common = {"dst_tbl": "*i64", "pflag_tbl": "*i64", "pack_tbl": "*i64", "remote_tbl": "*i32",
              "recv_base": "i64", "flag_ptr": "*i64", "rsig_ptr": "*i64", "ack_ptr": "*i64",
              "ctr_ptr": "*i32", "err_ptr": "*i32", "me": "i32", "T_cap": "i32", "REGION": "i32",
              "spin_limit": "i32", "T": "i32", "pos_ptr": "*i32", "dest_rank_ptr": "*i32", "rmeta_ptr": "*i32"}
    geo = dict(W=2, W_PAD=2, H=256, K=2, K_PAD=2, KMAX=8, G=4, CM_BYTES=256, ROW_BYTES=512,
               BLOCK_R=8, BLOCK_H=128, ALIGNED=True)
    disp = {**common, "x_ptr": "*bf16", "dest_slot_ptr": "*i32", "weight_ptr": "*fp32", "smeta_ptr": "*i32",
            "scnt_ptr": "*i32", "sflag_ptr": "*i32", "out_x_ptr": "*bf16", "out_slot_ptr": "*i32",
            "out_w_ptr": "*fp32", "pprog_tbl": "*i64", "prog_ptr": "*i64", "done_ptr": "*i32", "stamp_ptr": "*i64"}
    comb = {**common, "src_ptr": "*bf16", "side_ptr": "*fp32", "out_ptr": "*bf16", "gw_ptr": "*fp32",
            "smeta_ptr": "*i32", "pprog_tbl": "*i64", "prog_ptr": "*i64", "done_ptr": "*i32", "stamp_ptr": "*i64"}

    def compile_ptx(fn, types, consts):
        sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
        # what Triton's launcher assumes of 16-byte-aligned tensor arguments
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

    try:
        ptx = {"dispatch": compile_ptx(dc._dispatch_kernel, disp,
                                       dict(geo, G_PAD=4, HAS_META=True, COMPUTE_LAYOUT=True, PHASE=3,
                                            INTERLEAVE=False, STAMPS=False))}
    except RuntimeError as exc:  # no ptxas or backend here
        if "ptxas" in str(exc).lower():
            pytest.skip(str(exc))
        raise
    # the copy-out interleaved with the sends (Tuning.interleave) keeps the same accesses, as do the
    # combine's variants below
    ptx["dispatch interleaved"] = compile_ptx(dc._dispatch_kernel, disp, dict(
        geo, G_PAD=4, HAS_META=True, COMPUTE_LAYOUT=True, PHASE=3, INTERLEAVE=True, STAMPS=False))
    for rotate in (False, True):  # the ring order of the combine's sends (Tuning.rotate_peers)
        for interleave in (False, True):
            ptx[f"combine rotate={rotate} interleave={interleave}"] = compile_ptx(
                dc._combine_kernel, comb, dict(geo, HAS_META=True, PHASE=3, ROTATE=rotate, INTERLEAVE=interleave,
                                               STAMPS=False))
    # the remote path's receive (phase 2): its programs wait for the put signals themselves
    ptx["dispatch receive"] = compile_ptx(dc._dispatch_kernel, disp, dict(
        geo, G_PAD=4, HAS_META=True, COMPUTE_LAYOUT=False, PHASE=2, INTERLEAVE=False, STAMPS=False))
    ptx["combine receive"] = compile_ptx(dc._combine_kernel, comb, dict(
        geo, HAS_META=True, PHASE=2, ROTATE=False, INTERLEAVE=False, STAMPS=False))
    # the timer stamps (bench comm's latency floor) read %globaltimer, and only when asked
    stamped = {"dispatch": compile_ptx(dc._dispatch_kernel, disp, dict(
        geo, G_PAD=4, HAS_META=True, COMPUTE_LAYOUT=True, PHASE=3, INTERLEAVE=False,
        STAMPS=True)), "combine": compile_ptx(dc._combine_kernel, comb, dict(
            geo, HAS_META=True, PHASE=3, ROTATE=False, INTERLEAVE=False, STAMPS=True))}
    plain = {"dispatch": ptx["dispatch"], "combine": ptx["combine rotate=False interleave=False"]}
    for kind, text in stamped.items():
        assert "%globaltimer" in text and "%globaltimer" not in plain[kind], kind
    # (a spin polls with system-scope acquire loads: the receiving programs wait for the put signal)
    for kind in ("dispatch", "combine"):
        assert re.search(r"ld\.global\.sys\.acquire", ptx[f"{kind} receive"]), kind
    for name, text in ptx.items():
        ops = re.findall(r"\b(?:ld|st)\.global[.\w]*", text)
        assert any(".v4." in op for op in ops), name
        assert not [op for op in ops if op.endswith(".b16")], f"{name}: 2-byte row accesses in the PTX"


_PREFIX_SCRIPT = """
import torch, triton, triton.language as tl
from ray_moe.comm.nvshmem_kernels import _exclusive_prefix

@triton.jit
def k(h_ptr, o_ptr, R: tl.constexpr, W: tl.constexpr):
    r = tl.arange(0, R)
    w = tl.arange(0, W)
    hit = tl.load(h_ptr + r[:, None] * W + w[None, :])
    tl.store(o_ptr + r[:, None] * W + w[None, :], _exclusive_prefix(hit, R))

for R in (1, 2, 8, 16):
    h = (torch.rand(R, 4) < 0.5).to(torch.int32)
    o = torch.full_like(h, -7)
    k[(1,)](h, o, R=R, W=4)
    assert torch.equal(o, (h.cumsum(0) - h).to(torch.int32)), (R, h, o)
print("prefix ok")
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _PREFIX_SCRIPT)
def test_exclusive_prefix_under_interpreter(interpreter_scripts):
    """The dispatch layout's per-destination row positions (a triangular sum standing in for
    tl.cumsum, which Triton 3.6 fails to lower there) equal torch's exclusive cumsum."""
    pytest.importorskip("triton")
    proc = interpreter_scripts.result(sys.executable, "-c", _PREFIX_SCRIPT)
    assert "prefix ok" in proc.stdout, proc.stderr[-2000:]


def test_launcher_checks_and_binds_once_per_key_then_launches_the_compiled_kernel():
    """The host-cost path: the first call of a key computes (and checks) the constant arguments and
    goes through the JIT; later calls of the key launch the compiled kernel with the arguments in
    signature order, only the per-call ones replaced; no key (a misaligned or empty tensor)
    always takes the JIT and the checks. Without direct launches, known keys skip the checks."""
    from ray_moe.comm.nvshmem_kernels import Launcher

    calls, checks = [], []

    class Compiled:
        function = object()

        def __getitem__(self, grid):
            return lambda *args: calls.append(("fast", grid, args))

    class Kernel:
        arg_names = ["a_ptr", "n", "B", "c"]

        def __getitem__(self, grid):
            def run(**kw):
                calls.append(("jit", grid, kw))
                return Compiled()
            return run

    def fixed():
        checks.append(1)
        return dict(B=8, c=5)

    fast = Launcher(fast=True)
    assert ("k",) not in fast._fixed
    # ``first`` (the exchanges' longer spin limit) applies to a key's first launch and keyless ones
    fast.launch(Kernel(), (4,), dict(a_ptr="x", n=2), fixed, 16, ("k",), first={"c": 50})
    assert ("k",) in fast._fixed
    fast.launch(Kernel(), (4,), dict(a_ptr="y", n=3), fixed, 16, ("k",), first={"c": 50})
    fast.launch(Kernel(), (4,), dict(a_ptr="z", n=4), fixed, 16, None, first={"c": 50})
    assert calls == [("jit", (4,), dict(B=8, c=50, a_ptr="x", n=2, num_warps=16)),
                     ("fast", (4, 1, 1), ("y", 3, 8, 5)),
                     ("jit", (4,), dict(B=8, c=50, a_ptr="z", n=4, num_warps=16))]
    assert fast.calls == {"jit": 2, "fast": 1} and len(checks) == 2
    assert fast._entries[("k",)][1] == (None, None, 8, 5)  # no per-call tensor kept alive
    slow, checks[:], calls[:] = Launcher(fast=False), [], []
    for n in range(3):
        slow.launch(Kernel(), (4,), dict(a_ptr="x", n=n), fixed, 16, ("k",), first={"c": 50})
    assert slow.calls == {"jit": 3, "fast": 0} and len(checks) == 1 and ("k",) in slow._fixed
    assert [kw["c"] for _, _, kw in calls] == [50, 5, 5]
    # a caller's own tensors bound for good (buffer-owned outputs): later calls fill in the rest only
    assert fast.bound(("unknown",), {}) is None and slow.bound(("k",), {}) is None and fast.bound(None, {}) is None
    out = torch.zeros(4)
    calls[:] = []
    bound = fast.bound(("k",), dict(a_ptr=out))
    bound.launch(dict(n=7))
    bound.launch(dict(n=9))
    assert calls == [("fast", (4, 1, 1), (out.data_ptr(), n, 8, 5)) for n in (7, 9)]
    assert fast.calls["fast"] == 3
    with pytest.raises(KeyError):  # a per-call argument left out fails loudly
        fast.bound(("k",), {}).launch(dict(n=1))



def test_direct_launch_calls_tritons_launcher_with_the_current_stream_unless_a_hook_is_set():
    """DirectLaunch: the compiled kernel's C launcher with the grid, the device's current stream and
    no launch metadata; with a launch hook set (a profiler) Triton's own path, so the hook fires;
    a Launcher passes every tensor argument as its address."""
    pytest.importorskip("triton")
    from ray_moe.comm import nvshmem_kernels as nk

    runs, fallbacks = [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            runs.append(args)

        def __getitem__(self, grid):
            return lambda *args: fallbacks.append((grid, args))

    direct = nk.DirectLaunch(Compiled(), (4, 1, 1), torch.device("cuda", 1), raw_stream=lambda i: 100 + i)
    direct(1, 2)
    assert runs == [(4, 1, 1, 101, "fn", "meta", None, None, None, 1, 2)] and fallbacks == []
    hooks = nk._launch_hooks()
    old = hooks.launch_enter_hook
    try:
        hook = lambda meta: None  # noqa: E731
        if hasattr(old, "add"):  # a HookChain (Triton > 3.6): always there, empty by default
            old.add(hook)
        else:
            hooks.launch_enter_hook = hook
        direct(3)
    finally:
        if hasattr(old, "remove"):
            old.remove(hook)
        hooks.launch_enter_hook = old
    assert fallbacks == [((4, 1, 1), (3,))] and len(runs) == 1

    class Kernel:
        arg_names = ["a_ptr", "n", "b_ptr"]

        def __getitem__(self, grid):
            return lambda **kw: Compiled()

    launcher = nk.Launcher(fast=True)  # no CUDA device: Triton's compiled[grid] path
    a, b = torch.zeros(4), torch.ones(4)
    for n in (1, 2):
        launcher.launch(Kernel(), (4,), dict(a_ptr=a, n=n), lambda: dict(b_ptr=b), 4, ("k",))
    assert fallbacks[-1] == ((4, 1, 1), (a.data_ptr(), 2, b.data_ptr()))


_W1_SCRIPT = r"""
import os, time
os.environ["TRITON_INTERPRET"] = "1"
import torch
from ray_moe.comm.base import BufferSpec, Transport
from ray_moe.comm.local import LocalTransport
from ray_moe.comm.nvshmem import NVSHMEMTransport, SymmetricBuffer
from ray_moe.model.moe import MoELayer, MoELayerSpec
from ray_moe.validation.errors import rel_err

class Runtime:  # symmetric memory of one PE: ordinary, 256-byte aligned CPU memory
    rank, world_size = 0, 1
    def alloc(self, nbytes):
        raw = torch.zeros(nbytes + 256, dtype=torch.uint8)
        off = (-raw.data_ptr()) % 256
        return raw[off:off + nbytes]
    def free(self, t): pass
    def barrier(self): pass

class OnePE(NVSHMEMTransport):
    def __init__(self, spec):
        Transport.__init__(self, 0, 1)
        self.spec = spec
        self.buffer = SymmetricBuffer(Runtime(), spec.max_tokens, spec.hidden, spec.elem_bytes, 8, 1, [False])

tr = OnePE(BufferSpec(max_tokens=24, hidden=32, elem_bytes=4, max_top_k=4))
buf = tr.buffer
g = torch.Generator().manual_seed(0)
T, K = 20, 3
x = torch.randn(T, 32, generator=g)
dr = torch.zeros(T, K, dtype=torch.int32)
ds = torch.randint(-1, 4, (T, K), generator=g, dtype=torch.int32).clamp_min(0)
w = torch.rand(T, K, generator=g)
bad = []
C = buf.capacity
rx, rs, rw, lay = tr.dispatch_forward(x, w, dr, ds)
if rx.shape != (C, 32) or lay.capacity != C:
    bad.append(f"capacity {C}: rows {tuple(rx.shape)}, layout {lay.capacity}")
if not (torch.equal(rx[:T], x) and torch.equal(rs[:T], ds) and torch.equal(rw[:T], w)
        and bool((rs[T:] == -1).all()) and bool((rw[T:] == 0).all()) and bool((rx[T:] == 0).all())):
    bad.append("received rows")
if not torch.equal(tr.combine_forward(rx * 2, lay), x * 2):
    bad.append("combine")
gx, gw = tr.dispatch_backward(rx * 3, rw * 5, lay)
if not (torch.equal(gx, x * 3) and torch.allclose(gw, w * 5)):
    bad.append("dispatch backward")
gp = tr.combine_backward(x * 7, lay)
if not (torch.equal(gp[:T], x * 7) and bool((gp[T:] == 0).all())):
    bad.append("combine backward")
over = C + 6
try:
    tr.dispatch_forward(torch.randn(over, 32, generator=g), torch.rand(over, K, generator=g),
                        torch.zeros(over, K, dtype=torch.int32), torch.zeros(over, K, dtype=torch.int32))
    bad.append(f"{over} tokens passed a buffer of capacity {C}")
except ValueError as exc:
    assert f"capacity of {C}" in str(exc), exc
# checks and binding once per call shape: a repeated shape is known, a misaligned tensor is not
known = len(buf.launcher._fixed)
tr.dispatch_forward(x.clone(), w.clone(), dr.clone(), ds.clone())
if len(buf.launcher._fixed) != known:
    bad.append("a repeated call shape made a new launch key")
if buf._key("dispatch", C, x[1:], dr[1:]) is not None:
    bad.append("a misaligned tensor got a launch key")
# the layer over this transport equals the layer over the local transport
res = []
for transport in (LocalTransport(), tr):
    layer = MoELayer(MoELayerSpec(32, 4, 2, 16, seed=5), transport)
    xi = x.clone().requires_grad_()
    out, _ = layer(xi)
    out.backward(torch.ones_like(out))
    res.append([out, xi.grad, layer.router.grad, layer.w13.grad, layer.w2.grad, layer.received_pairs])
errs = [rel_err(a, b) for a, b in zip(*res)]
if not all(e <= 1e-6 for e in errs):
    bad.append(f"the layer over one PE: {errs}")
if int(buf.err[0]):
    bad.append(f"device error flag {buf.err.tolist()}")
print("BAD" if bad else "OK", bad)
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _W1_SCRIPT)
def test_symmetric_buffer_on_one_pe_under_the_interpreter(interpreter_scripts):
    """The NVSHMEM buffer's host side with its real kernels (Triton's interpreter, one PE, one
    program): the buffer's capacity (rows, padding, all four operations), its bound, the launch keys,
    and the layer over it equal to the layer over the local transport."""
    pytest.importorskip("triton")
    proc = interpreter_scripts.result(sys.executable, "-c", _W1_SCRIPT)
    assert proc.stdout.startswith("OK"), (proc.stdout + proc.stderr)[-3000:]


@pytest.fixture(scope="module", autouse=True)
def _start_the_multi_pe_run(multi_pe_run):
    """Start tests/unit/validation/test_multi_pe.py's background run now, beside this lane's tests."""
