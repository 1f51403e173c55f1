"""EPWorker: the Ray actor that owns one GPU (or a CPU slot) of an expert-parallel group.

Life cycle, driven by :class:`ray_moe.driver.group.WorkerGroup`:
``info()`` → (ranks assigned by the driver) → rank 0: ``bootstrap_address()`` → all:
``setup(config, rank_info, address)`` (torch.distributed) → rank 0: ``transport_bootstrap_id()``
→ all: ``init_transport(transport_spec, bootstrap_id, buffers)`` → ``build_engine(config)`` → training calls
(``step``, ``eval_sum``, ``set_placements``, ``save_shard``, ``load_checkpoint``, ...) → ``close()``.

What the driver resolved arrives frozen and is not derived again here: the rank and the world
size in :class:`~ray_moe.topology.RankInfo` (the group's, whatever ``parallel.world_size`` asked
for), the transport in :class:`~ray_moe.comm.base.TransportSpec`.

The driver calls these methods by reference (``group.call(EPWorker.step, ...)``), never by name:
a method that does not exist fails on the driver, before anything is sent.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from ray_moe.comm import make_transport, transport_bootstrap_id
from ray_moe.arch import ResolvedArch
from ray_moe.comm.base import BufferSpec, Transport, TransportSpec
from ray_moe.config import Config
from ray_moe.mesh import MeshSpec
from ray_moe.topology import RankInfo, WorkerInfo
from ray_moe.worker.engine import Engine, ModelReport
from ray_moe.worker.mesh_groups import MeshGroups


class EPWorker:
    """One rank. Plain class; the group wraps it with ``ray.remote``."""

    def __init__(self) -> None:
        self.config: Config | None = None
        self.rank_info: RankInfo | None = None
        self.device = torch.device("cpu")
        self.transport: Transport | None = None
        self.mesh: MeshSpec | None = None
        self.groups: MeshGroups | None = None  # this rank's EP and DP process groups
        self._engine: Engine | None = None
        self._store: dist.TCPStore | None = None  # the rendezvous store (rank 0: its server)

    # ------------------------------------------------------------------ bootstrap
    def info(self) -> WorkerInfo:
        """Where this actor runs (node, IP, host, pid, GPUs), before it has a rank."""
        import ray

        ctx = ray.get_runtime_context()
        gpu_ids = tuple(int(g) for g in ray.get_gpu_ids())
        return WorkerInfo(
            node_id=ctx.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            gpu_ids=gpu_ids,
        )

    def bootstrap_address(self, timeout_s: float) -> str:
        """rank 0: start torch.distributed's rendezvous store on this node and return its address
        (``tcp://ip:port``). The store listens on a port the OS picks as it binds (port 0), so no
        other process can take the port between choosing and listening; it lives as long as this
        worker. ``timeout_s``: how long a store operation may wait."""
        import ray

        ip = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(ip, 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        return f"tcp://{ip}:{self._store.port}"

    def setup(self, config: dict, rank_info: RankInfo, address: str, use_gpu: bool,
              mesh: MeshSpec | None = None) -> int:
        """Join torch.distributed as ``rank_info.rank`` of ``rank_info.world_size`` through the store
        at ``address`` (rank 0's :meth:`bootstrap_address`) and make the mesh's process groups
        (``mesh``: the driver's; default whole-world EP); returns the rank."""
        self.config = Config.from_plain(config)
        self.rank_info = rank_info
        self.mesh = mesh or MeshSpec.whole(rank_info.world_size)
        if self.mesh.world != rank_info.world_size:
            raise ValueError(f"mesh of {self.mesh.world} ranks for a group of {rank_info.world_size}")
        torch.set_num_threads(max(1, int(self.config.parallel.cpu_per_worker)))
        if use_gpu:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"rank {rank_info.rank} on {rank_info.hostname} was given a GPU by Ray "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}) but "
                    "torch.cuda.is_available() is False"
                )
            self.device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES per actor
            torch.cuda.set_device(self.device)
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); ranks sharing a GPU
        # (parallel.workers_per_gpu > 1, a test mode) join over gloo, which stages CUDA tensors on the host.
        nccl = use_gpu and self.config.parallel.workers_per_gpu == 1
        backend = "nccl" if nccl else "gloo"
        timeout = datetime.timedelta(seconds=self.config.parallel.collective_timeout_s)
        if self._store is None:  # every rank but 0 joins the store rank 0 started
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            self._store = dist.TCPStore(host, int(port), None, False, timeout)
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore("ray_moe", self._store),
            rank=rank_info.rank,
            world_size=rank_info.world_size,
            timeout=timeout,
            device_id=self.device if nccl else None,
        )
        self.groups = MeshGroups.create(self.mesh, rank_info.rank)
        return rank_info.rank

    def transport_bootstrap_id(self, name: str) -> bytes | None:
        """rank 0: the id every rank needs to initialise transport ``name`` (NVSHMEM's UID)."""
        return transport_bootstrap_id(name, self.device)

    def init_transport(self, spec: TransportSpec, bootstrap_id: bytes | None, buffers: BufferSpec) -> str:
        """Build the transport the group resolved (collective), its buffers sized by ``buffers``
        (the group's, from the architecture resolved on the driver)."""
        _, rank_info = self._setup_done()
        self.transport = make_transport(spec, rank_info, self.device, buffers, bootstrap_id,
                                        peers=self.mesh.peers(rank_info.rank), group=self.groups.ep)
        return self.transport.name

    def set_mesh(self, mesh: MeshSpec) -> None:
        """Switch to rank mesh ``mesh`` (collective): the engine is dropped, the EP and DP process
        groups and the transport (a torch one) are made again for it."""
        _, rank_info = self._setup_done()
        if mesh == self.mesh:
            return
        if mesh.world != rank_info.world_size:
            raise ValueError(f"mesh of {mesh.world} ranks for a group of {rank_info.world_size}")
        if self.transport is not None and self.transport.name == "nvshmem":
            raise ValueError("the NVSHMEM transport's peers are fixed when it starts")
        self._close_engine()
        if self.groups is not None:
            self.groups.destroy()
        self.mesh = mesh
        self.groups = MeshGroups.create(mesh, rank_info.rank)
        if self.transport is not None:
            from ray_moe.comm.torch_a2a import TorchA2ATransport

            self.transport.close()
            peers = mesh.peers(rank_info.rank)
            self.transport = TorchA2ATransport(peers.index(rank_info.rank), len(peers), self.groups.ep, peers)

    # ------------------------------------------------------------------ generic
    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(worker, *args, **kwargs)`` here (tests, validators, smoke checks)."""
        return fn(self, *args, **kwargs)

    def ping(self) -> int:
        """This rank (-1 before setup): the health check."""
        return -1 if self.rank_info is None else self.rank_info.rank

    # ------------------------------------------------------------------ training
    def build_engine(self, config: dict | None, arch: ResolvedArch) -> ModelReport:
        """Build the model shard, optimizer and data for ``config`` (None: the group's) and its
        architecture ``arch`` (resolved once, on the driver), growing the transport's buffers if
        this config needs more (collective). Returns what was built."""
        group_config, rank_info = self._setup_done()
        if self.transport is None:
            raise RuntimeError("the transport is not initialised; call init_transport first")
        cfg = Config.from_plain(config) if config is not None else group_config
        self._close_engine()  # free the previous engine's memory before building the next one
        self._engine = Engine(cfg, rank_info, self.transport, self.device, arch, mesh=self.mesh)
        return self._engine.describe()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the training engine is not built yet; call build_engine first")
        return self._engine

    def step(self, poison: bool = False) -> dict[str, Any]:
        """One training step; returns this rank's metrics (loss, times, expert loads, ...).
        ``poison`` makes this rank's loss NaN (fault injection for tests and smoke checks)."""
        return self.engine.train_step(poison=poison)

    def generate(self, prompt: list[int], max_new_tokens: int, temperature: float, seed: int) -> list[int]:
        """Continue ``prompt`` (token ids) by ``max_new_tokens`` sampled tokens (collective: every
        rank calls it with the same arguments); returns the new ids."""
        return self.engine.generate(prompt, max_new_tokens, temperature, seed)

    def eval_sum(self, start: int, stop: int, running: float = 0.0) -> float:
        """This rank's float64 running sum of the validation loss over batches [start, stop)
        (collective: every rank calls it with the same range; see ``Engine.eval_sum``)."""
        return self.engine.eval_sum(start, stop, running)

    def eval_mean(self, total: float, batches: int) -> float:
        """The validation loss from every rank's :meth:`eval_sum` total over ``batches`` batches
        (collective); the same value on every rank."""
        return self.engine.eval_mean(total, batches)

    def set_placements(self, placements: list[dict | None]) -> int:
        """New placement per MoE layer (None keeps a layer's); returns clone bytes received."""
        return self.engine.set_placements(placements)

    def placements(self) -> list[dict]:
        """The current placement of every MoE layer."""
        return self.engine.placements()

    def counters(self) -> dict[str, int]:
        """Steps taken, optimizer steps applied, steps skipped."""
        return self.engine.counters()

    # ------------------------------------------------------------------ checkpoints
    def save_shard(self, staging: str) -> dict[str, Any]:
        """Write this rank's checkpoint file into the staging directory; returns its meta entry."""
        from ray_moe.checkpoint import write_shard

        _, rank_info = self._setup_done()
        return write_shard(staging, rank_info.rank, self.engine.shard_state())

    def load_checkpoint(self, path: str) -> int:
        """Check and load a checkpoint (any world size) into this rank's shard; returns its step."""
        from ray_moe.checkpoint import load_tensors, read_meta

        meta = read_meta(path)
        self.engine.load_state(load_tensors(path, meta), meta["step"], meta["opt_steps"])
        return meta["step"]

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release the engine, the transport and the process group. Idempotent."""
        self._close_engine()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.groups is not None:
            self.groups.destroy()
            self.groups = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None

    def _setup_done(self) -> tuple[Config, RankInfo]:
        if self.config is None or self.rank_info is None:
            raise RuntimeError("the worker is not set up; call setup first")
        return self.config, self.rank_info
