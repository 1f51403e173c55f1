"""WorkerGroup: a placement group of one EPWorker actor per GPU (or CPU slot), ranked and joined.

    group = WorkerGroup(config)           # connects to Ray (or starts a local cluster)
    group.call(EPWorker.ping)             # -> [0, 1, ...] in rank order (methods by reference)
    group.execute(fn, *args)              # fn(worker, *args) on every rank
    group.close()

The group owns the world size: ``parallel.world_size`` is what was asked for; ``group.world_size``
is what runs, and every rank learns it from the :class:`~ray_moe.topology.RankInfo` the group hands out.

Ranks are ordered by node, then GPU. Rendezvous: rank 0 creates the bootstrap id (a TCP store
address for torch.distributed; NVSHMEM's unique id for the NVSHMEM transport), the driver
broadcasts it through Ray, every rank initialises. Nothing here is module-level state.
"""

from __future__ import annotations

import logging
import os
import time
from types import MappingProxyType
from typing import Any, Callable, Sequence, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_moe.comm import choose_transport
from ray_moe.config import Config
from ray_moe.topology import RankInfo, assign_ranks
from ray_moe.worker.actor import EPWorker

log = logging.getLogger(__name__)
R = TypeVar("R")

# NVLink multicast stays off on shared hosts unless the user overrides these in the driver env.
MULTICAST_OFF = MappingProxyType(
    {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
)


class GroupError(RuntimeError):
    """The worker group could not be started or a worker failed; the message names the cause."""


class WorkerFailure(GroupError):
    """A worker died or did not answer in time.

    Attributes: rank (or None if unknown) and cause ('died' | 'timeout' | 'error').
    """

    def __init__(self, message: str, rank: int | None, cause: str):
        super().__init__(message)
        self.rank, self.cause = rank, cause


def connect(address: str | None = None, **init_kwargs: Any) -> None:
    """Attach to a running Ray cluster (``address``, or ``RAY_ADDRESS``) or start a local one."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    ray.init(address=address, log_to_driver=True, **init_kwargs)


def use_gpu_for(config: Config) -> bool:
    """parallel.device: cpu | cuda | auto (cuda when the cluster has GPUs)."""
    if config.parallel.device == "cpu":
        return False
    if config.parallel.device == "cuda":
        return True
    return ray.cluster_resources().get("GPU", 0) >= 1


class WorkerGroup:
    """One EPWorker per bundle of a placement group, ranked by (node, GPU)."""

    def __init__(
        self,
        config: Config,
        address: str | None = None,
        worker_env: dict[str, str] | None = None,
    ) -> None:
        connect(address)
        self.config = config
        p = config.parallel
        self.world_size = p.world_size
        self.use_gpu = use_gpu_for(config)
        try:
            self.transport_name, why = choose_transport(p.transport, self.use_gpu)
        except ValueError as exc:
            raise GroupError(str(exc)) from None
        log.info("transport %s: %s", self.transport_name, why)
        self.transport_reason = why
        self._pg = None
        self.actors: list[Any] = []
        self.ranks: list[RankInfo] = []
        bundle = {"CPU": p.cpu_per_worker} | ({"GPU": 1} if self.use_gpu else {})
        self._check_fits(bundle)
        try:
            self._start(bundle, worker_env or {})
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up
    def _check_fits(self, bundle: dict[str, float]) -> None:
        total = ray.cluster_resources()
        for res, amount in bundle.items():
            need = amount * self.world_size
            if total.get(res, 0) < need:
                raise GroupError(
                    f"parallel.world_size={self.world_size} needs {need:g} {res} "
                    f"({amount:g} per worker) but the Ray cluster has {total.get(res, 0):g} {res} "
                    "in total; lower parallel.world_size or parallel.cpu_per_worker, or add nodes"
                )

    def _start(self, bundle: dict[str, float], worker_env: dict[str, str]) -> None:
        p = self.config.parallel
        self._pg = placement_group([dict(bundle)] * self.world_size, strategy=p.placement_strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=p.startup_timeout_s)
        if not ready:
            avail = ray.available_resources()
            raise GroupError(
                f"placement group of {self.world_size} x {bundle} ({p.placement_strategy}) was not "
                f"placed within parallel.startup_timeout_s={p.startup_timeout_s:g}s; available now: "
                f"{ {k: v for k, v in avail.items() if k in ('CPU', 'GPU')} } across "
                f"{len([n for n in ray.nodes() if n['Alive']])} node(s)"
            )
        env = {k: os.environ.get(k, v) for k, v in MULTICAST_OFF.items()}
        env["OMP_NUM_THREADS"] = str(max(1, int(p.cpu_per_worker)))
        env.update(worker_env)
        actor_cls = ray.remote(EPWorker)
        actors = [
            actor_cls.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env},
                max_concurrency=2,  # health checks answer while a step runs
            ).remote()
            for i in range(self.world_size)
        ]
        self.actors = actors
        infos = self._get([a.info.remote() for a in actors], p.startup_timeout_s, "start")
        ranks = assign_ranks(infos)
        order = sorted(range(len(actors)), key=lambda i: ranks[i].rank)
        self.actors = [actors[i] for i in order]
        self.ranks = [ranks[i] for i in order]
        address = self._get([self.actors[0].bootstrap_address.remote()], p.startup_timeout_s, "rendezvous")[0]
        cfg = self.config.to_dict()
        self._get(
            [a.setup.remote(cfg, r, address, self.use_gpu) for a, r in zip(self.actors, self.ranks)],
            p.startup_timeout_s + p.collective_timeout_s,
            "setup",
        )
        uid = self._get(
            [self.actors[0].transport_bootstrap_id.remote(self.transport_name)], p.startup_timeout_s, "bootstrap"
        )[0]
        names = self._get(
            [a.init_transport.remote(self.transport_name, uid) for a in self.actors],
            p.startup_timeout_s + p.collective_timeout_s,
            "transport init",
        )
        log.info("worker group up: %d ranks on %d node(s), transport %s", self.world_size,
                 self.ranks[0].num_nodes, names[0])

    # ------------------------------------------------------------------ calls
    def _get(self, refs: list, timeout: float | None, what: str) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list[Any] = []
        for i, ref in enumerate(refs):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(ray.get(ref, timeout=left))
            except GetTimeoutError:
                rank = self.ranks[i].rank if len(refs) == len(self.ranks) else None
                raise WorkerFailure(
                    f"{what}: rank {rank} did not answer within {timeout:g}s", rank, "timeout"
                ) from None
            except RayActorError as exc:
                rank = self.ranks[i].rank if len(refs) == len(self.ranks) else None
                raise WorkerFailure(f"{what}: worker of rank {rank} died: {exc}", rank, "died") from exc
            except RayTaskError as exc:
                rank = self.ranks[i].rank if len(refs) == len(self.ranks) else None
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise WorkerFailure(f"{what}: rank {rank} raised {type(cause).__name__}: {cause}",
                                    rank, "error") from exc
        return results

    def call(self, method: Callable[..., R], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[R]:
        """Call ``method`` (an :class:`EPWorker` method, e.g. ``EPWorker.step``) on every worker
        with the same arguments; results in rank order."""
        name = _worker_method(method)
        refs = [getattr(a, name).remote(*args, **kwargs) for a in self.actors]
        return self._get(refs, timeout, name)

    def call_each(self, method: Callable[..., R], args_per_rank: Sequence[tuple],
                  timeout: float | None = None) -> list[R]:
        """Call ``method`` on every worker with its own arguments (``args_per_rank[rank]``)."""
        if len(args_per_rank) != len(self.actors):
            raise ValueError(f"got arguments for {len(args_per_rank)} ranks; the group has {len(self.actors)}")
        name = _worker_method(method)
        refs = [getattr(a, name).remote(*args) for a, args in zip(self.actors, args_per_rank)]
        return self._get(refs, timeout, name)

    def execute(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run ``fn(worker, *args, **kwargs)`` on every rank; results in rank order."""
        refs = [a.execute.remote(fn, *args, **kwargs) for a in self.actors]
        return self._get(refs, timeout, getattr(fn, "__name__", "execute"))

    def health_check(self, timeout: float = 10.0) -> None:
        """Raise WorkerFailure naming the first rank that is dead or does not answer in time."""
        self.call(EPWorker.ping, timeout=timeout)

    @property
    def num_nodes(self) -> int:
        return self.ranks[0].num_nodes if self.ranks else 0

    def close(self) -> None:
        """Close transports, kill actors, remove the placement group. Idempotent."""
        if self.actors:
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=10)
            except Exception:  # a dead or hung worker must not block teardown
                pass
            for a in self.actors:
                try:
                    ray.kill(a)
                except Exception:
                    pass
            self.actors = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _worker_method(method: Callable[..., Any]) -> str:
    """The name of an :class:`EPWorker` method given by reference; anything else is refused here,
    on the driver, before a call is sent."""
    name = getattr(method, "__name__", None)
    if name is None or getattr(EPWorker, name, None) is not method:
        raise TypeError(f"{method!r} is not a method of EPWorker; pass e.g. EPWorker.step "
                        "(or use WorkerGroup.execute for a function)")
    return name
