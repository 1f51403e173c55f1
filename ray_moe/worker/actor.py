"""EPWorker: the Ray actor that owns one GPU (or a CPU slot) of an expert-parallel group.

Life cycle, driven by :class:`ray_moe.group.WorkerGroup`:
``info()`` → (ranks assigned by the driver) → rank 0: ``bootstrap_address()`` → all:
``setup(config, rank_info, address)`` (torch.distributed) → ``init_transport(bootstrap_id)``
→ work (``execute``, training methods) → ``close()``.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from ray_moe.comm import make_transport, transport_bootstrap_id
from ray_moe.comm.base import Transport
from ray_moe.config import Config
from ray_moe.topology import RankInfo, WorkerInfo


class EPWorker:
    """One rank. Plain class; the group wraps it with ``ray.remote``."""

    def __init__(self) -> None:
        self.config: Config | None = None
        self.rank_info: RankInfo | None = None
        self.device = torch.device("cpu")
        self.transport: Transport | None = None
        self.engine: Any = None  # ray_moe.engine.Engine once training is set up

    # ------------------------------------------------------------------ bootstrap
    def info(self) -> WorkerInfo:
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

    def bootstrap_address(self) -> str:
        """rank 0: a TCP store address on this node for torch.distributed's rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def setup(self, config: dict, rank_info: RankInfo, init_method: str, use_gpu: bool) -> int:
        self.config = Config.from_plain(config)
        self.rank_info = rank_info
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
        backend = "nccl" if use_gpu else "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank_info.rank,
            world_size=rank_info.world_size,
            timeout=datetime.timedelta(seconds=self.config.parallel.collective_timeout_s),
            device_id=self.device if use_gpu else None,
        )
        return rank_info.rank

    def transport_bootstrap_id(self, name: str) -> bytes | None:
        """rank 0: the id every rank needs to initialise transport ``name`` (NVSHMEM's UID)."""
        return transport_bootstrap_id(name, self.device)

    def init_transport(self, name: str, bootstrap_id: bytes | None) -> str:
        assert self.config is not None and self.rank_info is not None
        self.transport = make_transport(name, self.config, self.rank_info, self.device, bootstrap_id)
        return self.transport.name

    # ------------------------------------------------------------------ work
    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(worker, *args, **kwargs)`` here (tests, validators, smoke checks)."""
        return fn(self, *args, **kwargs)

    def ping(self) -> int:
        return -1 if self.rank_info is None else self.rank_info.rank

    def call_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            raise RuntimeError("the training engine is not built yet; call build_engine first")
        return getattr(self.engine, method)(*args, **kwargs)

    def call_engine_step(self, poison: bool = False) -> dict:
        """One training step (``poison`` injects a NaN into this rank's loss, for tests)."""
        if self.engine is None:
            raise RuntimeError("the training engine is not built yet; call build_engine first")
        return self.engine.train_step(poison=poison)

    def build_engine(self) -> dict:
        from ray_moe.engine import Engine

        assert self.config is not None and self.rank_info is not None and self.transport is not None
        self.engine = Engine(self.config, self.rank_info, self.transport, self.device)
        return self.engine.describe()

    def save_shard(self, staging: str) -> dict:
        """Write this rank's checkpoint file into the staging directory; returns its entry."""
        from ray_moe.checkpoint import write_shard

        assert self.engine is not None and self.rank_info is not None
        return write_shard(staging, self.rank_info.rank, self.engine.shard_state())

    def load_checkpoint(self, path: str) -> int:
        """Check and load a checkpoint (any world size) into this rank's shard; returns its step."""
        from ray_moe.checkpoint import load_tensors, read_meta

        assert self.engine is not None
        meta = read_meta(path)
        self.engine.load_state(load_tensors(path, meta), meta["step"], meta["opt_steps"])
        return meta["step"]

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if dist.is_initialized():
            dist.destroy_process_group()
