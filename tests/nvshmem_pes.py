"""Several NVSHMEM PEs on the CPU: the transport's real exchange kernels under Triton's interpreter,
one process per rank, so multi-PE kernel changes can be checked without a GPU.

Each rank is a process with ``TRITON_INTERPRET=1`` and a gloo group. Symmetric memory is a file per
(allocation, rank) in a shared directory, mapped by every rank (``torch.from_file(shared=True)``);
a peer pointer is the same offset in this process's mapping of the peer's file, so the kernels'
peer stores and flag atomics (real hardware atomics in the interpreter) cross processes as they
cross GPUs over NVLink. ``--programs G`` > 1 runs each launch's G programs at once, a thread each
(:func:`run_programs_in_threads`; the interpreter alone runs them one after another, and the
dispatch's layout waits for every program of its rank). What it cannot show: races between the
warps of one program, and the GPU's memory ordering; a program here is one thread.

What each rank runs: the transport validators on every edge case (``ray_moe.validation.transport``:
dispatch, combine and both backwards against the routing's reference, two calls in a row through
the same buffer) with the first ``--tunings`` entry, and the cases that vary the rows per source
most (:data:`FEW_CASES`) with each further one (the exchange kernels' launch variants, e.g.
``Tuning.interleave``), then the EP layer against the single-process oracle
(``layer_parity``) with uneven token counts; with ``--remote kernel``, the remote path on a
transport of its own (``force_remote_path``: staging, host-issued puts and signals, emulated here by
copies into the peer's mapping; the receiving kernel's programs wait for the signals) on
:data:`FEW_CASES` twice and the layer; then the transport's device error record, then a combine rank 0 runs alone,
whose timed-out wait must be named in the error (peer, program, value wanted and seen).

Usage: ``python tests/nvshmem_pes.py [--world-size 2] [--programs 2] [--tunings JSON]`` starts the
ranks and prints ``OK`` or the failures (exit 1); ``--rank R --root DIR`` is one rank (started by
the former).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# what the suite runs (tests/unit/validation/test_multi_pe.py): two ranks of two programs each
# (concurrent, as on the GPU), the default tuning on every edge case and the interleaved exchange
# on FEW_CASES, then the remote path (staging and puts), its signals waited for by the receiving
# kernel
SUITE_ARGS = ("--world-size", "2", "--programs", "2", "--tunings", '[{}, {"block_r": 4, "interleave": true}]',
              "--remote", "kernel")
# and three ranks with the default tuning, whose combine sends in ring order from three ranks on
# (Tuning.rotate_peers): the order every rank's peers see differs only there, so the cases that
# vary the rows per source most suffice (every edge case runs at two ranks; ~19 s, 32 s of CPU)
SUITE_ARGS_W3 = ("--world-size", "3", "--programs", "2", "--tunings", "[{}]", "--few-cases")


class BackgroundRun:
    """This script with ``args`` in a process of its own, started now; :meth:`result` waits for it.
    The suite starts it early (a session fixture) so that it runs beside other tests."""

    def __init__(self, args: tuple[str, ...]) -> None:
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], cwd=ROOT,
                                     stdout=self.out, stderr=self.err, text=True)

    def result(self, timeout_s: float) -> tuple[int, str]:
        """(exit code, stdout + the tail of stderr); a run past ``timeout_s`` is killed (code -9)."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.out.seek(0)
        self.err.seek(0)
        return code, self.out.read() + self.err.read()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


FEW_CASES = (dict(routing="random"), dict(routing="empty_rank"), dict(tokens_per_rank=(0, 5)),
             dict(tokens_per_rank=(1, 40), top_k=4))


class FileRuntime:
    """:class:`ray_moe.comm.nvshmem.NVSHMEMRuntime`'s interface over files in ``root``: allocation i
    of rank r is the file ``seg{i}.r{r}`` (zero bytes, page-aligned when mapped); every rank
    allocates the same sizes in the same order, as NVSHMEM's symmetric heap requires."""

    def __init__(self, root: str, rank: int, world_size: int, timeout_s: float = 120.0) -> None:
        self.root, self.rank, self.world_size, self.timeout_s = root, rank, world_size, timeout_s
        self._mine: list[tuple[int, int, object]] = []  # (base address, bytes, tensor) per allocation
        self._peers: dict[tuple[int, int], object] = {}  # (allocation, pe) -> the peer's mapping here
        self.calls = {"put_signal": 0}  # the remote path's host-issued puts

    def _path(self, index: int, pe: int) -> str:
        return os.path.join(self.root, f"seg{index}.r{pe}")

    def alloc(self, nbytes: int):
        import torch

        path = self._path(len(self._mine), self.rank)
        with open(path + ".tmp", "wb") as f:
            f.truncate(nbytes)
        os.replace(path + ".tmp", path)  # peers map it only once it has its full size
        t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._mine.append((t.data_ptr(), nbytes, t))
        return t

    def free(self, t) -> None:  # mappings live until the process ends (addresses stay valid)
        pass

    def peer_ptr(self, addr: int, pe: int) -> int:
        import torch

        for index, (base, nbytes, _) in enumerate(self._mine):
            if base <= addr < base + nbytes:
                break
        else:
            return 0
        if pe == self.rank:
            return addr
        if (index, pe) not in self._peers:
            path, deadline = self._path(index, pe), time.monotonic() + self.timeout_s
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: rank {pe} never allocated symmetric block {index}")
                time.sleep(0.01)
            self._peers[index, pe] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return self._peers[index, pe].data_ptr() + (addr - base)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    # the remote path's host-issued operations, done at once ("on stream" here: the kernels before
    # them have finished, as the interpreter runs a launch to its end)
    def put_signal(self, dst: int, src: int, nbytes: int, sig: int, value: int, pe: int) -> None:
        self.calls["put_signal"] += 1
        ctypes.memmove(self.peer_ptr(dst, pe), src, nbytes)
        self.signal_add(sig, value, pe)

    def signal_add(self, sig: int, value: int, pe: int) -> None:
        word = ctypes.c_int64.from_address(self.peer_ptr(sig, pe))  # one writer per word at a time
        word.value += value

    def close(self) -> None:
        pass


def run_programs_in_threads() -> None:
    """Make Triton's interpreter run a launch's programs at once, a thread each, instead of one
    after another: the exchange kernels' programs wait for each other (the dispatch's layout for
    every program of its rank, a receiving program for its counterpart's progress), as the GPU's
    resident blocks do. The interpreter's program id becomes per thread. Test-only, and tied to
    this Triton's interpreter (``GridExecutor.__call__`` with its grid loop threaded)."""
    import inspect
    import threading

    import triton
    from triton.runtime import interpreter as it

    here = threading.local()
    type(it.interpreter_builder).grid_idx = property(
        lambda self: getattr(here, "idx", None), lambda self, v: setattr(here, "idx", v))
    sys.setswitchinterval(2e-4)  # spinning programs hand the GIL over often

    def call(self, *args_dev, **kwargs):
        argspec = inspect.getfullargspec(self.fn)
        kwargs = {k: v for k, v in kwargs.items() if k in argspec.args or k in argspec.kwonlyargs}
        args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
        for hook in self.pre_run_hooks:
            hook(*args_hst, **kwargs_hst)
        patch_scope = it._patch_lang(self.fn)
        try:
            args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
            args = {n: a if n in self.constexprs else it._implicit_cvt(a) for n, a in args.items()}
            grid = self.grid(args) if callable(self.grid) else self.grid
            grid = tuple(grid) + (1,) * (3 - len(grid))
            it.interpreter_builder.set_grid_dim(*grid)
            errors: list[BaseException] = []

            def program(xs: range) -> None:
                try:
                    for x in xs:
                        for y in range(grid[1]):
                            for z in range(grid[2]):
                                it.interpreter_builder.set_grid_idx(x, y, z)
                                self.fn(**args)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)

            # the exchange kernels (1-D grids) a thread per program; the experts' 2-D and 3-D
            # grids, whose programs never wait for each other, in one thread
            parts = [range(x, x + 1) for x in range(grid[0])] if grid[1] == grid[2] == 1 else [range(grid[0])]
            threads = [threading.Thread(target=program, args=(xs,), daemon=True) for xs in parts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise it.InterpreterError(repr(errors[0])) from errors[0]
        finally:
            patch_scope.restore()
        self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

    # A nested @triton.jit call patches triton.language while iterating its module's globals
    # (_patch_lang), and its first call grows those globals (rewrite → _compile_and_exec): two
    # programs doing both at once failed one CI run with "dictionary changed size during
    # iteration". Both are quick host steps; the lock serialises them, never the programs' waits.
    rewrite_lock = threading.Lock()

    def device_call(self, *args, **kwargs):
        with rewrite_lock:
            it._patch_lang(self.fn)
            fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise it.InterpreterError(repr(e)) from e

    assert triton.__version__.split(".")[0] == "3", "written against Triton 3's interpreter"
    assert "_patch_lang(self.fn)" in inspect.getsource(it.InterpretedFunction.__call__), \
        "InterpretedFunction.__call__ changed: re-check device_call against it"
    it.GridExecutor.__call__ = call
    it.InterpretedFunction.__call__ = device_call


def back_off_polls(first_after: int = 4, longest_s: float = 1e-3) -> None:
    """Make a program that polls a flag (``tl.atomic_add(ptr, 0)``) and keeps reading the same
    value sleep between its polls, from 10 µs doubling up to ``longest_s``. A GPU's spinning block
    costs nothing the other ranks need; here a spinning rank is a process taking one of the host's
    cores from the rank it waits for (the suite runs this beside the rest on two cores). The
    kernels' ``spin_limit`` still bounds every wait, in polls, so a wait that never ends takes up
    to ``spin_limit`` ms to report itself (the runs' ``--timeout-s`` may end it first). Test-only,
    tied to Triton 3's interpreter (``create_atomic_rmw``)."""
    import threading

    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as it

    here = threading.local()
    real = type(it.interpreter_builder).create_atomic_rmw

    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        out = real(self, rmwOp, ptr, val, mask, sem, scope)
        poll = rmwOp == ir.ATOMIC_OP.ADD and not np.any(val.data)
        key = (ptr.data.tobytes(), out.data.tobytes()) if poll else None
        if key is not None and key == getattr(here, "key", None):
            here.repeats += 1
            if here.repeats >= first_after:
                time.sleep(min(longest_s, 1e-5 * 2.0 ** min(here.repeats - first_after, 30)))
        else:
            here.key, here.repeats = key, 0
        return out

    type(it.interpreter_builder).create_atomic_rmw = create_atomic_rmw


def make_transport(runtime: FileRuntime, spin_limit: int, tuning: dict | None = None, programs: int = 1,
                   remote: str = "none"):
    """An :class:`~ray_moe.comm.nvshmem.NVSHMEMTransport` on the CPU over ``runtime``: ``programs``
    programs per launch (more than one needs :func:`run_programs_in_threads`), every peer through
    peer pointers, Triton's JIT for every launch (the interpreter's); every buffer it makes gets
    ``Tuning(**tuning)`` when given.
    ``remote``: ``none`` (peer pointers) or ``kernel`` (every peer through the remote path's staging
    and puts, ``force_remote_path``; the receiving kernel's programs wait for the put signals)."""
    import torch

    from ray_moe.comm.base import BufferSpec, Transport
    from ray_moe.comm.nvshmem import NVSHMEMTransport
    from ray_moe.comm.nvshmem_kernels import Tuning

    class InterpreterTransport(NVSHMEMTransport):
        def __init__(self) -> None:
            Transport.__init__(self, runtime.rank, runtime.world_size)
            self.device = torch.device("cpu")
            self.runtime = runtime
            self.force_remote = remote != "none"
            self.node_of_rank = [0] * runtime.world_size
            self.num_programs = self.comm_programs = programs
            self.buffer, self.spec = None, None
            self.spin_limit = spin_limit
            self.fast_launch = False
            self.reserve(BufferSpec(max_tokens=16, hidden=32, elem_bytes=4, max_top_k=8))

        def new_buffer(self, *args, **kwargs):
            buf = super().new_buffer(*args, **kwargs)
            if self.tuning:
                buf.tuning = Tuning(**self.tuning)
            return buf

        def use(self, tuning: dict | None) -> None:
            """Give this and every later buffer ``Tuning(**tuning)`` (None: the buffer's default)."""
            self.tuning = tuning
            geo = self.buffer.geo
            self.buffer.tuning = Tuning(**tuning) if tuning else Tuning.for_hidden(geo.hidden, geo.world_size)

    tr = InterpreterTransport.__new__(InterpreterTransport)
    tr.tuning = tuning
    tr.__init__()
    return tr


def rank_main(root: str, rank: int, world_size: int, spin_limit: int, tunings: list[dict],
              all_cases: bool = True, programs: int = 1, remote: tuple[str, ...] = (),
              fp8_wire: bool = False) -> list[str]:
    """One rank: the transport checks with each of ``tunings`` ({}: the buffers' default; every
    edge case with the first where ``all_cases``, else :data:`FEW_CASES`), the layer's with the
    first; with ``fp8_wire`` only FP8 rows on the wire instead (:func:`fp8_wire_checks`); the
    failures as lines."""
    import torch
    import torch.distributed as dist

    from ray_moe.validation.cases import EDGE_CASES, Case
    from ray_moe.validation.layer import layer_parity
    from ray_moe.validation.transport import check_combine, check_dispatch

    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    if programs > 1:
        run_programs_in_threads()
    back_off_polls()
    tr = make_transport(FileRuntime(root, rank, world_size), spin_limit, tunings[0] or None, programs)
    info = SimpleNamespace(rank=rank, world_size=world_size)  # what the validators read (no Ray import)
    worker = SimpleNamespace(transport=tr, rank_info=info, device=torch.device("cpu"))
    fails: list[str] = []

    def check(name: str, fn, case, tol: float) -> None:
        try:
            result = fn(worker, case)
        except Exception as exc:  # the other ranks then time out in their waits: stop here
            fails.append(f"rank {rank} {name}: {type(exc).__name__}: {exc}")
            raise
        errors = result.get("errors", result)
        bad = {k: v for k, v in errors.items() if not v <= tol}
        if bad:
            fails.append(f"rank {rank} {name}: {bad}")

    try:
        if fp8_wire:
            fails += fp8_wire_checks(worker, world_size)
            tunings, remote = [], ()
        for i, tuning in enumerate(tunings):
            tr.use(tuning or None)
            # every edge case with the first tuning; with the others, the ones that vary the
            # rows per source most (empty sources and ranks, skew), to keep the suite fast
            for extra in EDGE_CASES if i == 0 and all_cases else [e for e in EDGE_CASES if e in FEW_CASES]:
                case = Case(num_experts=4 * world_size).but(**extra)
                if case.applies_to(world_size) is None:
                    check(f"check_dispatch {extra} {tuning}", check_dispatch, case, 1e-6)
                    check(f"check_combine {extra} {tuning}", check_combine, case, 1e-6)
        if tunings:
            tr.use(tunings[0] or None)
            extra = dict(tokens_per_rank=(3, 17), top_k=3)  # uneven counts; the edge cases ran above
            check(f"layer_parity {extra}", layer_parity, Case(num_experts=4 * world_size, seed=3).but(**extra),
                  1e-5)
        for mode in remote:  # the remote path (staging, puts, signals) on a transport of its own
            peer_path, before = worker.transport, dict(tr.runtime.calls)
            worker.transport = make_transport(tr.runtime, spin_limit, None, programs, mode)
            try:
                for extra in [e for e in EDGE_CASES if e in FEW_CASES]:
                    case = Case(num_experts=4 * world_size).but(**extra)
                    if case.applies_to(world_size) is None:
                        for _ in range(2):  # twice: the signals of one call must not satisfy the next
                            check(f"check_dispatch {extra} remote={mode}", check_dispatch, case, 1e-6)
                            check(f"check_combine {extra} remote={mode}", check_combine, case, 1e-6)
                extra = dict(tokens_per_rank=(3, 17), top_k=3)
                check(f"layer_parity {extra} remote={mode}", layer_parity,
                      Case(num_experts=4 * world_size, seed=3).but(**extra), 1e-5)
                worker.transport.check()
                puts = tr.runtime.calls["put_signal"] - before["put_signal"]
                buf = worker.transport.buffer
                if not puts or not buf.any_remote:
                    fails.append(f"rank {rank} remote={mode}: {puts} puts, remote peers {buf.remote}")
            finally:
                worker.transport = peer_path
    except Exception as exc:
        if not fails:
            fails.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return fails
    try:
        tr.check()
    except Exception as exc:
        fails.append(f"rank {rank}: {exc}")
    else:
        fails += _timeout_is_named(tr, rank)
    dist.barrier()
    dist.destroy_process_group()
    return fails


def fp8_wire_checks(worker, world_size: int) -> list[str]:
    """FP8 rows on the wire through the exchange kernels (byte rows of H + 4·H/128, as words):
    the layer equals the FP8 layer without the wire to float32 round-off
    (:func:`tests.fp8_wire.fp8_wire_parity`), and the receive rows' bytes are
    (H + 4·H/128) / (2·H) of bf16's."""
    from ray_moe.validation.cases import Case
    from tests.fp8_wire import dispatch_bytes, fp8_wire_parity

    rank = worker.transport.rank
    case = Case(seed=2, top_k=2, hidden=128, expert_hidden=128, num_experts=2 * world_size,
                tokens_per_rank=(11, 6, 9), expert_precision="fp8")
    fails = []
    errs = fp8_wire_parity(worker, case)
    if not all(v <= 1e-5 for v in errs.values()):
        fails.append(f"rank {rank} fp8_wire_parity: {errs}")
    sizes, H = dispatch_bytes(worker, case), case.hidden
    if not sizes["bf16"] or sizes["fp8"] * 2 * H != sizes["bf16"] * (H + 4 * H // 128):
        fails.append(f"rank {rank} dispatch_bytes: {sizes}")
    return fails


def _timeout_is_named(tr, rank: int) -> list[str]:
    """Rank 0 runs a combine the others skip: its wait for their rows gives up after a few polls
    and the transport's check names the error, the peer, the program and the value it waited for
    (the buffer is unusable afterwards: the last check of the run)."""
    import torch

    g = torch.Generator().manual_seed(1)
    W, H = tr.world_size, tr.buffer.geo.hidden
    x = torch.randn(4, H, generator=g)
    dest_rank = torch.tensor([[(rank + 1) % W]] * 4, dtype=torch.int32)  # every row to the next rank
    recv_x, _, _, layout = tr.dispatch_forward(x, torch.ones(4, 1), dest_rank, torch.zeros(4, 1, dtype=torch.int32))
    tr.runtime.barrier()
    if rank != 0:
        return []
    tr.buffer.spin_limit = 50
    tr.combine_forward(recv_x, layout)
    try:
        tr.check()
    except Exception as exc:
        msg = str(exc)
        # the combine waits for rank W-1 (rank 0's rows went to rank 1, whose rows
        # did not come back); the words say which call it wanted and what it saw
        if f"error 4 involving rank {W - 1}" in msg and re.search(r"program \d+ wanted", msg) and "saw" in msg:
            return []
        return [f"rank 0: the timed-out combine's error does not name its wait: {msg}"]
    return ["rank 0: a combine whose peers never came did not time out"]


def launch(world_size: int, spin_limit: int, timeout_s: float, tunings: str = "[{}]",
           few_cases: bool = False, programs: int = 1, remote: str = "", fp8_wire: bool = False) -> list[str]:
    """Start ``world_size`` rank processes and collect their failures (a rank that dies or runs
    past ``timeout_s`` is a failure that says so)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="ray_moe_pes_") as root:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), "--root", root,
                                   "--world-size", str(world_size), "--spin-limit", str(spin_limit),
                                   "--tunings", tunings, "--programs", str(programs)]
                                  + (["--few-cases"] if few_cases else [])
                                  + (["--remote", remote] if remote else [])
                                  + (["--fp8-wire"] if fp8_wire else []),
                                  env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world_size)]
        # a rank that stops early leaves the others waiting on it: end them all soon after
        deadline, first_done = time.monotonic() + timeout_s, None
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if first_done is None and any(p.poll() is not None for p in procs):
                first_done = time.monotonic()
            if first_done is not None and time.monotonic() - first_done > 30:
                break
            time.sleep(0.05)
        fails = []
        for r, p in enumerate(procs):
            late = p.poll() is None
            if late:
                p.kill()
            out, err = p.communicate()
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if lines:
                fails += json.loads(lines[-1])["fails"]
            if late:
                fails.append(f"rank {r} was still running when it was stopped (another rank ended 30 s "
                             f"earlier, or {timeout_s:.0f} s passed)")
            elif p.returncode or not lines:
                fails.append(f"rank {r} exited with {p.returncode}: {err[-3000:]}")
    return fails


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--root", default=None)
    p.add_argument("--spin-limit", type=int, default=1 << 21)
    p.add_argument("--timeout-s", type=float, default=900.0)  # a loaded 2-core CI host ran the W=3 suite past 400 s
    p.add_argument("--tunings", default="[{}]",
                   help='the buffers\' Tunings to check, a JSON list ({}: the default), e.g. '
                        '\'[{}, {"block_r": 2, "interleave": true}]\'')
    p.add_argument("--few-cases", action="store_true", help="FEW_CASES with every tuning (the suite's budget)")
    p.add_argument("--programs", type=int, default=1,
                   help="programs per launch (G); more than one runs them in threads (run_programs_in_threads)")
    p.add_argument("--remote", default="",
                   help="then the remote path on FEW_CASES and the layer: kernel (the receiving kernel waits "
                        "for the put signals)")
    p.add_argument("--fp8-wire", action="store_true",
                   help="only FP8 rows on the wire: the FP8 layer's parity with and without it, the bytes moved")
    a = p.parse_args(argv)
    if a.rank is None:
        fails = launch(a.world_size, a.spin_limit, a.timeout_s, a.tunings, a.few_cases, a.programs, a.remote,
                       a.fp8_wire)
        print("OK" if not fails else "FAILED\n" + "\n".join(fails))
        return 1 if fails else 0
    fails = rank_main(a.root, a.rank, a.world_size, a.spin_limit, json.loads(a.tunings), not a.few_cases,
                      a.programs, tuple(m for m in a.remote.split(",") if m), a.fp8_wire)
    print(json.dumps({"fails": fails}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
