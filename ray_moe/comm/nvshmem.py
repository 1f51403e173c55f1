"""NVSHMEM transport: UID bootstrap across Ray actors, one symmetric-memory Buffer per worker,
sync-free Triton dispatch/combine (:mod:`ray_moe.comm.nvshmem_kernels`).

Bootstrap: rank 0 calls :func:`create_unique_id` (128 bytes, broadcast by the driver through
Ray); every rank then builds :class:`NVSHMEMTransport`, which calls ``nvshmem.core.init`` with
that id and allocates one :class:`SymmetricBuffer`.

The buffer is sized from an explicit :class:`~ray_moe.comm.base.BufferSpec` for the worst case of
rank-dedup traffic: every source may send each of its ``T_cap = spec.max_tokens`` tokens to every
rank, so each rank receives at most ``W * T_cap`` rows. Every layer and step reuses it;
:meth:`NVSHMEMTransport.reserve` replaces it (collectively) when a larger spec arrives.

**Reuse hazard and how it is handled.** A layer's received rows are needed again in its
backward, after later layers have dispatched through the same buffer. The receive kernels
therefore *copy out* of symmetric memory into ordinary tensors (``recv_x``, the combine sums), as
DeepEP does; the copy-out of the rows of chunk p overlaps with the peers still sending later
chunks. The symmetric regions are then free: each receiving program acknowledges (a counter in
the sender's memory) once it has read its rows, and a sender waits for all acknowledgements of
call n-1 before it writes call n into a peer's region (back-pressure, bounded spin).

**Peer path** (same node, the default): rows are stored straight into the peer's region through
NVLink peer pointers (``nvshmem_ptr``) and arrival is signalled per (source, program) with
release/acquire atomics.

**Remote path** (peers on another node, or every peer with ``parallel.force_remote_path``): the
send kernel writes each peer's rows into a local staging region; the host then enqueues one
``nvshmemx_putmem_signal_on_stream`` per remote peer (the buffer's capacity of rows, signal += 1)
and, after the receive kernel, ``nvshmemx_signal_op_on_stream`` for the acknowledgement. No host
sync is needed: the put size is the buffer's capacity (the real row count lives on the device
only; :meth:`SymmetricBuffer.post_send`), which costs bandwidth when traffic is far below it;
the arrival counters are read in the kernel.

No module-level mutable state: NVSHMEM's own process state is owned by the transport that
initialised it (``close()`` finalizes it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import MappingProxyType
from collections.abc import Sequence
from typing import Any

import torch

from ray_moe.comm.base import BufferSpec, Layout, Transport, TransportSpec
from ray_moe.comm.nvshmem_kernels import (
    ERROR_WORDS,
    ChannelAddrs,
    Geometry,
    Launcher,
    Tuning,
    fast_launch_works,
    launch_combine,
    launch_dispatch,
)

log = logging.getLogger(__name__)

ERRORS = MappingProxyType({
    1: "the layout prefix timed out: not all programs of this rank were resident at once",
    2: "a peer did not acknowledge the previous exchange (it is behind, hung or crashed)",
    3: "rows of a dispatch did not arrive from a peer (it did not reach the same dispatch)",
    4: "rows of a combine did not arrive from a peer (it did not reach the same combine)",
})


def wait_record(rec: dict[str, int]) -> str:
    """The timed-out wait of an error record (:data:`ERROR_WORDS`) in words: which program, and
    the word's value wanted and last seen (an interleave progress word as call and rows)."""
    def word(hi: int, lo: int) -> str:
        if hi > 0:  # (call + 1) << 32 | rows
            return f"call {hi - 1} rows {lo & 0xFFFFFFFF}"
        return str(lo)
    if rec["code"] == 1:
        return f"program {rec['program']}"
    return (f"program {rec['program']} wanted {word(rec['wanted_hi'], rec['wanted_lo'])}, "
            f"saw {word(rec['seen_hi'], rec['seen_lo'])}")


# the most bytes of dispatch outputs a buffer keeps per call shape for ``reuse_outputs`` callers:
# decoding's small calls (T_local=128, H=4096, W=8 hold ~8.5 MiB); a larger call allocates anew
OWNED_OUTPUT_BYTES = 64 << 20


class NVSHMEMError(RuntimeError):
    """NVSHMEM could not be imported or initialised, or a device-side wait timed out."""


def _nvshmem_env() -> str:
    env = {k: v for k, v in os.environ.items() if k.startswith("NVSHMEM_")}
    return ", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "none"


def _import_nvshmem():
    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
    except Exception as exc:  # ImportError, or the host library failing to load
        raise NVSHMEMError(
            f"could not import nvshmem4py ({type(exc).__name__}: {exc}); tried `import nvshmem.core` "
            f"with NVSHMEM_* variables: {_nvshmem_env()}. Install it (pip install nvshmem4py-cu12/"
            "cu13 and nvidia-nvshmem) or fall back with parallel.transport=nccl"
        ) from exc
    return core, bindings


def create_unique_id(device: torch.device) -> bytes:
    """Rank 0: NVSHMEM's unique id (128 bytes) for UID bootstrap."""
    core, _ = _import_nvshmem()
    import numpy as np

    uid = core.get_unique_id()
    return uid._data.view(np.int8).tobytes()


def _uid_from_bytes(core, blob: bytes):
    import numpy as np

    uid = core.get_unique_id(empty=True)
    view = uid._data.view(np.int8)
    if view.nbytes != len(blob):
        raise NVSHMEMError(f"bootstrap id has {len(blob)} bytes, NVSHMEM expects {view.nbytes}")
    view[:] = np.frombuffer(blob, dtype=np.int8)
    return uid


class NVSHMEMRuntime:
    """Owns NVSHMEM's process state: init on construction, finalize on close (if it initialised)."""

    def __init__(self, device: torch.device, uid: bytes, rank: int, world_size: int,
                 peers: tuple[int, ...] | None = None) -> None:
        """NVSHMEM over all ``world_size`` PEs (global ``rank``); ``peers``: the PEs this
        runtime's users exchange with (an EP group of the rank mesh, default every PE). ``rank``
        and ``world_size`` as attributes are this PE's index among the peers and their number;
        every PE argument below is such an index, translated to the global PE here."""
        self.core, self.bindings = _import_nvshmem()
        self.peers = tuple(range(world_size)) if peers is None else tuple(peers)
        if rank not in self.peers:
            raise NVSHMEMError(f"PE {rank} is not among its peers {self.peers}")
        self.pe, self.n_pes = rank, world_size  # global
        self.rank, self.world_size, self.device = self.peers.index(rank), len(self.peers), device
        self.owns = False
        from cuda.core import Device

        torch.cuda.set_device(device)
        dev = Device(device.index if device.index is not None else torch.cuda.current_device())
        dev.set_current()
        try:
            already = int(self.core.init_status()) >= 2  # NVSHMEM_STATUS_IS_INITIALIZED or later
        except Exception:
            already = False
        if already:
            return  # another owner in this process initialised it and will finalize it
        try:
            self.core.init(device=dev, uid=_uid_from_bytes(self.core, uid), rank=rank,
                           nranks=world_size, initializer_method="uid")
        except Exception as exc:
            raise NVSHMEMError(
                f"nvshmem.core.init(uid, rank={rank}, nranks={world_size}) failed on "
                f"{torch.cuda.get_device_name(device)}: {type(exc).__name__}: {exc}. NVSHMEM_* "
                f"variables: {_nvshmem_env()}. Every rank must call it with the id from rank 0; "
                "fall back with parallel.transport=nccl"
            ) from exc
        self.owns = True

    def stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def barrier(self) -> None:
        """Host-side: this rank's queued GPU work is done and every rank has reached here.

        Through torch.distributed where the group has it: NVSHMEM's on-stream barrier, mixed with
        the host-side barriers inside ``nvshmem_malloc``/``free`` of a buffer replaced on a live
        transport, left rank 1 of two GPUs waiting forever while rank 0 went on (H100 x2,
        2026-11-25; never on one GPU with two PEs). Unlike ``barrier_all`` it does not quiet NVSHMEM's
        outstanding puts: before a buffer is freed ``nvshmem_free``'s own barrier does that."""
        import torch.distributed as dist

        torch.cuda.synchronize(self.device)
        if dist.is_initialized():
            dist.barrier()
        else:
            self.core.barrier_all(stream=torch.cuda.current_stream())
            torch.cuda.synchronize(self.device)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Zeroed symmetric bytes (collective: every rank allocates the same sizes in order)."""
        t = self.core.tensor((nbytes,), dtype=torch.uint8)
        t.zero_()
        return t

    def free(self, t: torch.Tensor) -> None:
        self.core.free_tensor(t)

    def peer_ptr(self, addr: int, pe: int) -> int:
        """Address of symmetric ``addr`` on peer ``pe`` (an index into :attr:`peers`) through
        load/store (0 when not reachable)."""
        return int(self.bindings.ptr(addr, self.peers[pe]))

    def put_signal(self, dst: int, src: int, nbytes: int, sig: int, value: int, pe: int) -> None:
        b = self.bindings
        b.putmem_signal_on_stream(dst, src, nbytes, sig, value, int(b.Signal_op.SIGNAL_ADD), self.peers[pe],
                                  self.stream())

    def signal_add(self, sig: int, value: int, pe: int) -> None:
        b = self.bindings
        b.signal_op_on_stream(sig, value, int(b.Signal_op.SIGNAL_ADD), self.peers[pe], self.stream())

    def close(self) -> None:
        if self.owns:
            self.core.finalize()
            self.owns = False


@dataclass
class NVSHMEMLayout(Layout):
    """Routing state of one dispatch.

    pos int32 [T, W] (row of each token at each destination, -1 none), smeta int32 [G, W, 4]
    (send chunk meta), rmeta int32 [W, G, 4] (received chunk meta), dest_rank int32 [T, K];
    capacity: C, the rows per source of this exchange (the received rows are [W*C, H]).
    owned: pos, smeta and rmeta are the buffer's own (a ``reuse_outputs`` dispatch), the same
    tensors for every such call of the shape.
    """

    num_tokens: int
    top_k: int
    pos: torch.Tensor
    smeta: torch.Tensor
    rmeta: torch.Tensor
    dest_rank: torch.Tensor
    capacity: int
    owned: bool = False


class _Channel:
    """Symmetric regions + words of one direction, and the device tables the kernels read."""

    def __init__(self, rt: NVSHMEMRuntime, geo: Geometry, remote: list[bool], staging: bool) -> None:
        W, G, me = geo.world_size, geo.num_programs, geo.rank
        self.geo, self.remote = geo, remote
        self.recv = rt.alloc(W * geo.region_bytes)
        self.stage = rt.alloc(W * geo.region_bytes) if staging else None
        self.words = rt.alloc(8 * (2 * W * G + 2 * W)).view(torch.int64)
        self.flag = self.words[: W * G]
        self.rsig = self.words[W * G: W * G + W]
        self.ack = self.words[W * G + W: W * G + 2 * W]
        self.prog = self.words[W * G + 2 * W: 2 * W * G + 2 * W]  # (call + 1) << 32 | rows sent (interleave)
        recv_base, words_base = self.recv.data_ptr(), self.words.data_ptr()
        for name, t in (("receive regions", self.recv), ("staging regions", self.stage)):
            if t is not None and t.data_ptr() % 256:  # the kernels' 16-byte vector accesses rely on it
                raise NVSHMEMError(f"rank {me}: symmetric {name} at {t.data_ptr():#x} are not 256-byte aligned")
        self.recv_base = recv_base
        self.rsig_base, self.ack_base = words_base + 8 * W * G, words_base + 8 * (W * G + W)
        prog_base = words_base + 8 * (W * G + 2 * W)
        dst, pflag, pack, pprog = [0] * W, [0] * W, [0] * W, [0] * W
        for d in range(W):
            if d == me:
                continue
            if remote[d]:
                dst[d] = self.stage.data_ptr() + d * geo.region_bytes
            else:
                dst[d] = rt.peer_ptr(recv_base + me * geo.region_bytes, d)
                pflag[d] = rt.peer_ptr(words_base + 8 * me * G, d)
                pack[d] = rt.peer_ptr(self.ack_base + 8 * me, d)
                pprog[d] = rt.peer_ptr(prog_base + 8 * me * G, d)
                if not (dst[d] and pflag[d] and pack[d] and pprog[d]):
                    raise NVSHMEMError(f"rank {me}: no peer pointer to rank {d}; use the remote path")
        dev = self.recv.device
        self.addrs = ChannelAddrs(
            dst_tbl=torch.tensor(dst, dtype=torch.int64, device=dev),
            pflag_tbl=torch.tensor(pflag, dtype=torch.int64, device=dev),
            pack_tbl=torch.tensor(pack, dtype=torch.int64, device=dev),
            remote_tbl=torch.tensor([int(r) for r in remote], dtype=torch.int32, device=dev),
            recv_base=recv_base, flag=self.flag, rsig=self.rsig, ack=self.ack,
            ctr=torch.zeros(G, dtype=torch.int32, device=dev),
            pprog_tbl=torch.tensor(pprog, dtype=torch.int64, device=dev), prog=self.prog,
            done=torch.zeros(W * G, dtype=torch.int32, device=dev),
        )

    def post_send(self, rt: NVSHMEMRuntime, capacity: int) -> None:
        """Remote peers: put each staged region into the peer's region for this rank, signal += 1.
        A call of ``capacity`` rows per source lays its region out for that many (chunk meta, then
        ``capacity`` rows, then their row meta: the kernels' ``T_cap``), so only that prefix moves."""
        geo, me = self.geo, self.geo.rank
        nbytes = min(geo.region_bytes, geo.cm_bytes + capacity * (geo.row_bytes + geo.meta_bytes))
        for d, far in enumerate(self.remote):
            if far and d != me:
                rt.put_signal(self.recv_base + me * geo.region_bytes,
                              self.stage.data_ptr() + d * geo.region_bytes,
                              nbytes, self.rsig_base + 8 * me, 1, d)

    def post_recv(self, rt: NVSHMEMRuntime) -> None:
        """Remote peers: acknowledge (G programs' worth) that their region was read."""
        geo, me = self.geo, self.geo.rank
        for s, far in enumerate(self.remote):
            if far and s != me:
                rt.signal_add(self.ack_base + 8 * me, geo.num_programs, s)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.recv, self.stage, self.words) if t is not None]


class SymmetricBuffer:
    """The symmetric memory of one worker and the dispatch/combine operations over it.

    Args:
        runtime: the initialised NVSHMEM runtime.
        capacity: T_cap, the most tokens a rank passes to one dispatch.
        hidden: H. elem_bytes: bytes per row element the buffer is sized for (2 bf16, 4 fp32).
        kmax: widest top-k the row meta can carry.
        num_programs: G, equal on every rank (≤ SMs).
        remote: per peer, True to use host-issued NVSHMEM puts instead of peer pointers (the same
            pairs on every rank: :meth:`NVSHMEMTransport.remote_peers` agrees on them).
        interleave_ok: whether :attr:`Tuning.interleave` may apply: no rank of the buffer has a
            remote peer (the same on every rank). At four ranks (two PEs on each of two GPUs) the
            interleaved exchange once timed out on the GPU (2026-11-25: a peer late at one dispatch
            in over a hundred, still compiling the variant); since a kernel variant's first launch
            waits FIRST_LAUNCH_SPIN_FACTOR times longer, its GPU tests pass there (2026-11-26), so
            it applies at any world size.
        spin_limit: polls before a device-side wait gives up and raises the error flag.
        fast_launch: launch repeated calls of a shape through Triton's compiled kernel directly
            (:class:`~ray_moe.comm.nvshmem_kernels.Launcher`); None: where
            :func:`~ray_moe.comm.nvshmem_kernels.fast_launch_works` says this Triton allows it.

    Creating and closing a buffer are collective (symmetric allocation).

    Host cost per call: each operation allocates its outputs (they go to autograd or the caller
    and must outlive later calls) and nothing else (combine_grad's unused received meta is a
    buffer-owned scratch), except a dispatch with ``reuse_outputs`` (no autograd: the buffer's own
    outputs per call shape); argument checks and Triton's argument binding run once per call
    shape (the Launcher's key).
    """

    def __init__(self, runtime: NVSHMEMRuntime, capacity: int, hidden: int, elem_bytes: int, kmax: int,
                 num_programs: int, remote: list[bool], spin_limit: int = 1 << 25,
                 tuning: Tuning | None = None, fast_launch: bool | None = None,
                 interleave_ok: bool = False) -> None:
        self.rt = runtime
        W, me = runtime.world_size, runtime.rank
        self.geo = Geometry(W, me, max(16, capacity), hidden, elem_bytes, kmax, num_programs)
        self.remote = [bool(r) and d != me for d, r in enumerate(remote)]
        staging = any(remote)
        self.dch = _Channel(runtime, self.geo, self.remote, staging)
        self.cch = _Channel(runtime, self.geo, self.remote, staging)
        dev = self.dch.recv.device
        G = num_programs
        self.scratch = (torch.zeros(G, W, dtype=torch.int32, device=dev),
                        torch.zeros(G, dtype=torch.int32, device=dev))
        self.err = torch.zeros(len(ERROR_WORDS), dtype=torch.int32, device=dev)  # see check()
        # combine_grad's received chunk meta: written by the kernel, never read (the layout's is)
        self.rmeta_scratch = torch.empty(W, G, 4, dtype=torch.int32, device=dev)
        self.spin_limit = spin_limit
        self.tuning = tuning or Tuning.for_hidden(hidden, W)
        self.any_remote = any(self.remote)
        self.interleave_ok = bool(interleave_ok) and not self.any_remote
        self.launcher = Launcher(fast=fast_launch_works(dev) if fast_launch is None else fast_launch, device=dev)
        # int64 [2, G, STAMP_SLOTS], contiguous, on the buffer's device: when set, every dispatch-like
        # (0) and combine-like (1) call writes each program's timer at its steps
        # (nvshmem_kernels.DISPATCH_STAMPS / COMBINE_STAMPS); bench comm's latency floor sets it
        self.stamps: torch.Tensor | None = None
        self._owned: dict[tuple, tuple] = {}  # call key -> dispatch outputs (dispatch's reuse_outputs)
        # the launches of owned calls with every owned tensor bound (_owned_fast_key -> BoundLaunch, ...)
        self._owned_dispatch: dict[tuple, tuple] = {}
        self._owned_combine: dict[tuple, Any] = {}
        runtime.barrier()

    @property
    def capacity(self) -> int:
        return self.geo.capacity

    @property
    def symmetric_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ch in (self.dch, self.cch) for t in ch.tensors())

    # ---------------------------------------------------------------- the four operations
    def dispatch(self, x: torch.Tensor, weight: torch.Tensor, dest_rank: torch.Tensor, dest_slot: torch.Tensor,
                 reuse_outputs: bool = False):
        """x [T, H]; weight float32, dest_rank/dest_slot int32 [T, K] →
        recv_x [W*C, H], recv_slot int32 [W*C, K], recv_w float32 [W*C, K], layout; C = the
        buffer's T_cap (rows per source, the same on every rank; T <= C).
        x may also be any row payload of at most the buffer's row bytes, e.g. uint8 [T, P] (FP8
        rows beside their scales, :func:`ray_moe.kernels.fp8_quant.pack_rows`): recv_x is then
        [W*C, P] of x's dtype; the layout is the same (the combine and backward use H).

        ``reuse_outputs``: return the buffer's own outputs for this call shape (allocated by its
        first such call, at most :data:`OWNED_OUTPUT_BYTES` of them), which the next such call
        overwrites, as DeepEP's low-latency mode returns views of its buffer: for callers that
        consume them first and keep none (decoding). The six allocations are most of a small
        dispatch's host time."""
        x, weight, dest_rank, dest_slot = self._dispatch_inputs(x, weight, dest_rank, dest_slot)
        cap = self.geo.capacity
        if x.dtype == torch.uint8 and _as_words(x, self.geo.elem_bytes).dtype != torch.uint8:
            # a byte payload (FP8 rows and their scales) travels as words of the buffer's width
            recv = self.dispatch(_as_words(x, self.geo.elem_bytes), weight, dest_rank, dest_slot, reuse_outputs)
            return (recv[0].view(torch.uint8),) + recv[1:]
        T, K = dest_rank.shape
        if reuse_outputs and self._owned_dispatch:
            fast = self._owned_dispatch.get(self._owned_fast_key(cap, x, K))
            ptrs = (x.data_ptr(), dest_rank.data_ptr(), dest_slot.data_ptr(), weight.data_ptr())
            if fast is not None and T and not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) % 16:
                launch, (pos, smeta, rmeta, recv_x, recv_slot, recv_w) = fast
                launch.launch({"x_ptr": ptrs[0], "dest_rank_ptr": ptrs[1], "dest_slot_ptr": ptrs[2],
                               "weight_ptr": ptrs[3], "T": T})
                return recv_x, recv_slot, recv_w, NVSHMEMLayout(T, K, pos, smeta, rmeta, dest_rank, cap, True)
        key = self._key("dispatch", cap, x, dest_rank, dest_slot, weight)
        outs = self._owned.get(key) if reuse_outputs and key is not None else None
        if outs is None:
            outs = self._dispatch_outputs(T, K, cap, x.dtype, x.device, x.shape[1])
            if reuse_outputs and key is not None and sum(t.nbytes for t in outs) <= OWNED_OUTPUT_BYTES:
                self._owned[key] = outs
        owned = reuse_outputs and self._owned.get(key) is outs
        pos, smeta, rmeta, recv_x, recv_slot, recv_w = outs
        kw = dict(dest_rank=dest_rank, dest_slot=dest_slot, weight=weight, out_slot=recv_slot, out_w=recv_w,
                  scratch=self.scratch, compute_layout=True)
        self._dispatch_like(x, pos, smeta, recv_x, rmeta, cap, key, kw)
        if owned and not self.any_remote:  # later calls of the shape: only the inputs change
            bound = self.launcher.bound(_with(key, 3), dict(
                pos_ptr=pos, smeta_ptr=smeta, scnt_ptr=self.scratch[0], sflag_ptr=self.scratch[1], out_x_ptr=recv_x,
                out_slot_ptr=recv_slot, out_w_ptr=recv_w, rmeta_ptr=rmeta))
            if bound is not None:
                self._owned_dispatch[self._owned_fast_key(cap, x, K)] = (bound, outs)
        return recv_x, recv_slot, recv_w, NVSHMEMLayout(T, K, pos, smeta, rmeta, dest_rank, cap, owned)

    def _dispatch_inputs(self, x, weight, dest_rank, dest_slot):
        """A dispatch's inputs as the kernels take them (x contiguous, dest_rank/dest_slot int32,
        weight float32)."""
        return (_contiguous(x), _contiguous(weight, torch.float32), _contiguous(dest_rank, torch.int32),
                _contiguous(dest_slot, torch.int32))

    def _owned_fast_key(self, cap: int, x: torch.Tensor, K: int) -> tuple:
        """What an owned call's bound launch depends on besides the buffer: the call's shapes and
        the tuning (the other inputs are int32/float32 [T, K], contiguous, as dispatch makes them)."""
        return cap, x.shape, x.dtype, K, self.tuning.key(), None if self.stamps is None else self.stamps.data_ptr()

    def _dispatch_outputs(self, T: int, K: int, cap: int, dtype: torch.dtype, dev: torch.device, width: int) -> tuple:
        """New outputs of a dispatch: pos, smeta, rmeta (the layout) and recv_x [W*cap, width],
        recv_slot, recv_w."""
        W, G, R = self.geo.world_size, self.geo.num_programs, self.geo.world_size * cap
        return (torch.empty(T, W, dtype=torch.int32, device=dev),
                torch.empty(G, W, 4, dtype=torch.int32, device=dev),
                torch.empty(W, G, 4, dtype=torch.int32, device=dev),
                torch.empty(R, width, dtype=dtype, device=dev),
                torch.empty(R, K, dtype=torch.int32, device=dev),
                torch.empty(R, K, dtype=torch.float32, device=dev))

    def combine(self, partial: torch.Tensor, layout: NVSHMEMLayout) -> torch.Tensor:
        """partial [W*C, H] → [T, H]: per token, the sum of its partial rows from every rank."""
        partial = _contiguous(partial)
        out = torch.empty(layout.num_tokens, self.geo.hidden, dtype=partial.dtype, device=partial.device)
        fast_key = None
        if layout.owned and not self.any_remote:  # an owned layout: its tensors stay, bind them
            fast_key = (layout.capacity, partial.shape, partial.dtype, layout.pos.data_ptr(), self.tuning.key(),
                        None if self.stamps is None else self.stamps.data_ptr())
            fast = self._owned_combine.get(fast_key)
            sp, op = partial.data_ptr(), out.data_ptr()
            if fast is not None and layout.num_tokens and not (sp | op) % 16:
                fast.launch({"src_ptr": sp, "side_ptr": sp, "out_ptr": op, "gw_ptr": op, "T": layout.num_tokens})
                return out
        key = self._key("combine", layout.capacity, partial, layout.pos, layout.smeta)
        self._combine_like(partial, layout, out, key, {})
        if fast_key is not None:
            bound = self.launcher.bound(_with(key, 3), dict(rmeta_ptr=layout.rmeta, pos_ptr=layout.pos,
                                                            dest_rank_ptr=layout.pos, smeta_ptr=layout.smeta))
            if bound is not None:
                self._owned_combine[fast_key] = bound
        return out

    def dispatch_grad(self, grad_recv_x: torch.Tensor, grad_recv_w: torch.Tensor, layout: NVSHMEMLayout):
        """Backward of dispatch: [W*C, H], float32 [W*C, K] → gx [T, H], gw float32 [T, K]."""
        T, K = layout.num_tokens, layout.top_k
        grad_recv_x, side = _contiguous(grad_recv_x), _contiguous(grad_recv_w, torch.float32)
        gx = torch.empty(T, self.geo.hidden, dtype=grad_recv_x.dtype, device=grad_recv_x.device)
        gw = torch.empty(T, K, dtype=torch.float32, device=grad_recv_x.device)
        key = self._key("dispatch_grad", layout.capacity, grad_recv_x, side, layout.pos, layout.dest_rank,
                        layout.smeta)
        self._combine_like(grad_recv_x, layout, gx, key, dict(side=side, dest_rank=layout.dest_rank, gw=gw))
        return gx, gw

    def combine_grad(self, grad_out: torch.Tensor, layout: NVSHMEMLayout) -> torch.Tensor:
        """Backward of combine: grad_out [T, H] → [W*C, H] (zero on padding rows)."""
        geo = self.geo
        grad_out = _contiguous(grad_out)
        out = torch.empty(geo.world_size * layout.capacity, geo.hidden, dtype=grad_out.dtype, device=grad_out.device)
        key = self._key("combine_grad", layout.capacity, grad_out, layout.pos)
        self._dispatch_like(grad_out, layout.pos, layout.smeta, out, self.rmeta_scratch, layout.capacity, key, {})
        return out

    # ---------------------------------------------------------------- plumbing
    def _key(self, op: str, capacity: int, *tensors: torch.Tensor) -> tuple | None:
        """The Launcher's key of one call: what its checks and Triton's specialisation depend on
        besides the buffer itself. None (check and bind every time) when a tensor is empty or not
        16-byte aligned (then Triton would specialise differently)."""
        for t in tensors:
            if t.numel() == 0 or t.data_ptr() % 16:
                return None
        return (op, capacity, self.spin_limit, self.tuning.key(),
                None if self.stamps is None else self.stamps.data_ptr(),
                *[(t.shape, t.dtype, t.is_cuda) for t in tensors])

    def _dispatch_like(self, x, pos, smeta, out_x, rmeta, capacity, key, kw) -> None:
        ch = self.dch
        kw = dict(kw, spin_limit=self.spin_limit, tuning=self.tuning, capacity=capacity, launcher=self.launcher,
                  interleave_ok=self.interleave_ok, stamps=None if self.stamps is None else self.stamps[0])
        args = (self.geo, ch.addrs, x, pos, smeta, out_x, rmeta, self.err)
        if not self.any_remote:
            launch_dispatch(*args, phase=3, key=_with(key, 3), **kw)
            return
        launch_dispatch(*args, phase=1, key=_with(key, 1), **kw)
        ch.post_send(self.rt, capacity)
        launch_dispatch(*args, phase=2, key=_with(key, 2), **kw)
        ch.post_recv(self.rt)

    def _combine_like(self, src, layout: NVSHMEMLayout, out, key, kw) -> None:
        ch = self.cch
        args = (self.geo, ch.addrs, src, layout.rmeta, layout.pos, out, self.err)
        kw = dict(kw, spin_limit=self.spin_limit, tuning=self.tuning, capacity=layout.capacity,
                  launcher=self.launcher, smeta=layout.smeta, interleave_ok=self.interleave_ok,
                  stamps=None if self.stamps is None else self.stamps[1])
        if not self.any_remote:
            launch_combine(*args, phase=3, key=_with(key, 3), **kw)
            return
        launch_combine(*args, phase=1, key=_with(key, 1), **kw)
        ch.post_send(self.rt, layout.capacity)
        launch_combine(*args, phase=2, key=_with(key, 2), **kw)
        ch.post_recv(self.rt)

    # ---------------------------------------------------------------- health
    def check(self) -> None:
        """Raise NVSHMEMError if a device-side wait timed out (host sync: call outside the hot path)."""
        rec = dict(zip(ERROR_WORDS, (int(v) for v in self.err.tolist())))
        if rec["code"]:
            raise NVSHMEMError(
                f"rank {self.geo.rank}: NVSHMEM transport error {rec['code']} involving rank {rec['peer']}: "
                f"{ERRORS.get(rec['code'], 'unknown')}. Every rank must run the same sequence of "
                f"dispatch/combine calls; the data of the failed exchange are invalid ({wait_record(rec)})"
            )

    def close(self) -> None:
        """Free the symmetric memory (collective)."""
        for ch in (self.dch, self.cch):
            for t in ch.tensors():
                self.rt.free(t)
        self.dch = self.cch = None  # type: ignore[assignment]


def _as_words(rows: torch.Tensor, max_bytes: int) -> torch.Tensor:
    """uint8 rows [T, P] viewed as the widest integer words (4, 2 or 1 bytes, at most the buffer's
    element size) that divide P: the exchange kernels copy words, so a byte payload moves in tiles
    of the model dtype's width."""
    for dtype in (torch.int32, torch.int16):
        size = torch.empty((), dtype=dtype).element_size()
        if size <= max_bytes and rows.shape[1] % size == 0:
            return rows.view(dtype)
    return rows


def _contiguous(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` in ``dtype`` (default its own) and contiguous, itself where it already is (the checks
    cost a tenth of the no-op ``.to``/``.contiguous`` calls on the small-batch host path)."""
    if dtype is not None and t.dtype is not dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _with(key: tuple | None, phase: int) -> tuple | None:
    return None if key is None else key + (phase,)


def _num_programs(device: torch.device, ranks_per_gpu: int = 1) -> int:
    """G: SMs of the smallest GPU of the group (an all-reduce at start-up), at most 132, divided
    among the ``ranks_per_gpu`` ranks that share a GPU: every program of every rank's spinning
    exchange kernel must be resident at once (under CUDA MPS the ranks' kernels share the SMs)."""
    import torch.distributed as dist

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    g = torch.tensor([max(1, min(sms, 132) // ranks_per_gpu)], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(g, op=dist.ReduceOp.MIN)
    return int(g.item())


def _gather_node_ranks(rank_info: Any, device: torch.device) -> list[int]:
    """node_rank of every rank (an all-gather at start-up; the rank's own alone without a group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [rank_info.node_rank] * rank_info.world_size
    mine = torch.tensor([rank_info.node_rank], dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(rank_info.world_size)]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


class NVSHMEMTransport(Transport):
    """Transport over one :class:`SymmetricBuffer`; no host synchronisation in any primitive.

    ``settings`` (:class:`~ray_moe.comm.base.TransportSpec`, the same on every rank):
    ``comm_programs`` is G, the programs (SMs) the exchange kernels of the transport's buffer run
    on (0: every SM); it shapes the symmetric buffer. ``fast_launch=False`` turns the
    Launcher's direct launches off (every call through Triton's JIT); ``spin_limit`` bounds every
    device-side wait.
    ``ranks_per_gpu`` (``parallel.workers_per_gpu``, a test mode) ranks share this GPU: its SMs are
    divided among them.
    """

    name = "nvshmem"
    owns_dispatch_outputs = True
    group: Any = None  # the peers' torch.distributed process group (None: the world's)

    def __init__(self, rank_info: Any, device: torch.device, bootstrap_id: bytes | None, spec: BufferSpec,
                 settings: TransportSpec | None = None, peers: Sequence[int] | None = None,
                 group: Any = None) -> None:
        settings = settings or TransportSpec("nvshmem")
        peers = tuple(range(rank_info.world_size)) if peers is None else tuple(peers)
        super().__init__(peers.index(rank_info.rank), len(peers), peers)
        self.group = group  # the peers' torch.distributed group (None: the world, peers = every rank)
        if bootstrap_id is None:
            raise NVSHMEMError("the NVSHMEM transport needs rank 0's unique id (bootstrap_id is None)")
        if device.type != "cuda":
            raise NVSHMEMError(f"the NVSHMEM transport needs a CUDA device, got {device}")
        self.device = device
        self.runtime = NVSHMEMRuntime(device, bootstrap_id, rank_info.rank, rank_info.world_size, peers)
        self.force_remote = settings.force_remote_path
        world_nodes = _gather_node_ranks(rank_info, device)
        self.node_of_rank = [world_nodes[r] for r in peers]  # per peer (transport rank)
        self.num_programs = _num_programs(device, settings.ranks_per_gpu)
        self.comm_programs = min(settings.comm_programs, self.num_programs) or self.num_programs
        self.buffer: SymmetricBuffer | None = None
        self.spec: BufferSpec | None = None
        self.spin_limit = settings.spin_limit
        self.fast_launch = settings.fast_launch and fast_launch_works(device)
        if self.force_remote:
            self.name = "nvshmem-remote"
        self.reserve(spec)

    def reserve(self, spec: BufferSpec) -> None:
        """Make the buffer hold ``spec`` (collective). A buffer serves one row width: a new hidden
        size replaces it, keeping the larger of the old and new row count, meta width and element
        size, so a later caller of the previous size still fits unless its width differs."""
        if self.spec is not None and self.spec.covers(spec):
            return
        if self.spec is not None:
            spec = BufferSpec(max_tokens=max(spec.max_tokens, self.spec.max_tokens), hidden=spec.hidden,
                              elem_bytes=max(spec.elem_bytes, self.spec.elem_bytes),
                              max_top_k=max(spec.max_top_k, self.spec.max_top_k))
        if self.buffer is not None:
            self.runtime.barrier()
            self.buffer.close()
            self.buffer = None
        self.buffer = self.new_buffer(capacity=spec.max_tokens, hidden=spec.hidden,
                                      elem_bytes=spec.elem_bytes, kmax=max(8, spec.max_top_k),
                                      num_programs=self.comm_programs)
        self.spec = spec
        log.info("rank %d: NVSHMEM buffer of %.1f MiB (capacity %d rows/rank, remote peers %s)",
                 self.rank, self.buffer.symmetric_bytes / 2**20, self.buffer.capacity,
                 [d for d, r in enumerate(self.buffer.remote) if r])

    def remote_peers(self) -> tuple[list[bool], bool]:
        """Per peer: reach it with puts when force_remote_path is set, when it is on another Ray
        node (even one on the same host), or when NVSHMEM gives no peer pointer to it, either way
        (the pair is remote on both ranks, which must agree on the protocol); and whether no pair
        of the group is remote (:attr:`Tuning.interleave` needs that). Collective."""
        import torch.distributed as dist

        W, me = self.world_size, self.rank
        if self.force_remote:
            mine = [d != me for d in range(W)]
        else:
            probe = self.runtime.alloc(256)  # collective, same on every rank
            try:
                mine = [d != me and (self.node_of_rank[d] != self.node_of_rank[me]
                                     or self.runtime.peer_ptr(probe.data_ptr(), d) == 0) for d in range(W)]
            finally:
                self.runtime.free(probe)
        pairs = torch.zeros(W, W, dtype=torch.int32, device=self.device)
        pairs[me] = torch.tensor(mine, dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(pairs, group=self.group)  # over the peers only: the matrix is theirs
        pairs = pairs.tolist()  # once per buffer, not on the hot path
        return [d != me and bool(pairs[me][d] or pairs[d][me]) for d in range(W)], not any(map(any, pairs))

    def new_buffer(self, capacity: int, hidden: int, elem_bytes: int = 2, kmax: int = 8,
                   tuning: Tuning | None = None, spin_limit: int | None = None,
                   num_programs: int | None = None) -> SymmetricBuffer:
        """A further buffer (collective); the benchmark makes one per size. ``num_programs``: G,
        the same on every rank, at most the SMs (default: all of them, ``self.num_programs``)."""
        G = num_programs or self.num_programs
        if not 1 <= G <= self.num_programs:
            raise ValueError(f"num_programs must be in [1, {self.num_programs}] (SMs), got {G}")
        remote, none_remote = self.remote_peers()
        return SymmetricBuffer(self.runtime, capacity, hidden, elem_bytes, kmax, G,
                               remote, spin_limit=spin_limit or self.spin_limit, tuning=tuning,
                               fast_launch=self.fast_launch, interleave_ok=none_remote)

    # ---------------------------------------------------------------- Transport
    def dispatch_forward(self, x, weight, dest_rank, dest_slot, reuse_outputs=False):
        recv = self.buffer.dispatch(x, weight, dest_rank, dest_slot, reuse_outputs=reuse_outputs)
        # the rows the receive side holds (W·C of them: the exchange's fixed capacity), host-known
        self.dispatched_bytes += recv[0].numel() * recv[0].element_size()
        return recv

    def dispatch_backward(self, grad_recv_x, grad_recv_weight, layout):
        return self.buffer.dispatch_grad(grad_recv_x, grad_recv_weight, layout)

    def combine_forward(self, partial, layout):
        return self.buffer.combine(partial, layout)

    def combine_backward(self, grad_out, layout):
        return self.buffer.combine_grad(grad_out, layout)

    def check(self) -> None:
        """Raise if a device-side wait timed out (host sync; call at step end or in validators)."""
        if self.buffer is not None:
            self.buffer.check()

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["node_of_peer"] = list(self.node_of_rank)
        if self.buffer is not None:
            d.update(capacity=self.buffer.capacity, symmetric_mib=round(self.buffer.symmetric_bytes / 2**20, 1),
                     remote_peers=[i for i, r in enumerate(self.buffer.remote) if r],
                     num_programs=self.buffer.geo.num_programs,
                     fast_launch=self.buffer.launcher.fast)
        return d

    def close(self) -> None:
        if self.buffer is not None:
            try:
                self.runtime.barrier()
                self.buffer.close()
            finally:
                self.buffer = None
        self.runtime.close()
