"""WorkerGroup: a placement group of one EPWorker actor per GPU (or CPU slot), ranked and joined.

    group = WorkerGroup(config)           # connects to Ray (or starts a local cluster)
    group.call(EPWorker.ping)             # -> [0, 1, ...] in rank order (methods by reference)
    group.execute(fn, *args)              # fn(worker, *args) on every rank
    group.close()

The group owns the world size: ``parallel.world_size`` is what was asked for (the default of
``WorkerGroup(config, world_size=...)``); ``group.world_size`` is what runs, and every rank learns it
from the :class:`~ray_moe.topology.RankInfo` the group hands out. The config is never rewritten to
match. Likewise the transport: the group resolves ``parallel.transport`` (``auto``) and its knobs
once into a frozen :class:`~ray_moe.comm.base.TransportSpec` every rank builds from.

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
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_moe.arch import ResolvedArch
from ray_moe.comm import BufferSpec, TransportSpec, choose_transport
from ray_moe.config import Config, ConfigError, transport_device_error
from ray_moe.connect import ConnectError
from ray_moe.connect import connect as connect_checked
from ray_moe.driver.errors import GroupError, WorkerFailure
from ray_moe.mesh import MeshError, MeshSpec, resolve_mesh
from ray_moe.topology import RankInfo, assign_ranks
from ray_moe.worker.actor import EPWorker
from ray_moe.worker.engine import buffer_spec

log = logging.getLogger(__name__)
R = TypeVar("R")

# NVLink multicast stays off on shared hosts unless the user overrides these in the driver env.
MULTICAST_OFF = MappingProxyType(
    {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
)


def connect(address: str | None = None, timeout_s: float = 60.0, **init_kwargs: Any) -> bool:
    """:func:`ray_moe.connect.connect` (the address and token checked first, one line when they
    fail), its :class:`~ray_moe.connect.ConnectError` raised as the driver's GroupError."""
    try:
        return connect_checked(address, timeout_s, **init_kwargs)
    except ConnectError as exc:
        raise GroupError(str(exc)) from None


def use_gpu_for(config: Config) -> bool:
    """parallel.device: cpu | cuda | auto (cuda when the cluster has GPUs)."""
    if config.parallel.device == "cpu":
        return False
    if config.parallel.device == "cuda":
        return True
    return ray.cluster_resources().get("GPU", 0) >= 1


def resolve_transport(config: Config, use_gpu: bool) -> tuple[TransportSpec, str]:
    """(the transport every rank builds, why that one) for ``config.parallel`` on a group with or
    without GPUs; raises GroupError when an explicit transport cannot move the group's tensors."""
    p = config.parallel
    device = "cuda" if use_gpu else "cpu"
    how = f"parallel.device={p.device}" + (
        f" and the cluster {'has' if use_gpu else 'has no'} GPUs" if p.device == "auto" else "")
    error = transport_device_error(p.transport, device, how)
    if error:
        raise GroupError(error)
    name, why = choose_transport(p.transport, use_gpu)
    return TransportSpec(name, force_remote_path=p.force_remote_path, comm_programs=p.comm_programs,
                         spin_limit=p.nvshmem_spin_limit, fast_launch=p.fast_launch,
                         ranks_per_gpu=p.workers_per_gpu if use_gpu else 1), why


def transport_buffers(config: Config, world_size: int, arch: ResolvedArch) -> BufferSpec:
    """The transport's first buffers: what training ``config``'s architecture ``arch`` on
    ``world_size`` ranks passes to one dispatch (the resolved hidden size and top-k, not the byte
    model's ``model.d_model`` / ``moe.top_k``, which an HF architecture does not use), so that
    building the engine does not replace them."""
    return buffer_spec(config, world_size, arch.spec)


class WorkerGroup:
    """One EPWorker per bundle of a placement group, ranked by (node, GPU).

    Args:
        config: the group's configuration (validated; never modified here).
        address: Ray address to attach to (default: ``RAY_ADDRESS`` or a cluster started here).
        worker_env: environment variables for the workers, besides :data:`MULTICAST_OFF`.
        world_size: ranks to start (default ``parallel.world_size``); the config must divide over
            them (a ConfigError says why not).
        arch: the architecture resolved on the driver (:meth:`Config.resolve_arch`; default: resolved
            here, on the driver): its E is checked against the world size and its hidden size and
            top-k size the transport's first buffers (:func:`transport_buffers`).
    """

    def __init__(
        self,
        config: Config,
        address: str | None = None,
        worker_env: dict[str, str] | None = None,
        world_size: int | None = None,
        arch: ResolvedArch | None = None,
    ) -> None:
        self.world_size = config.parallel.world_size if world_size is None else world_size
        self.arch = arch if arch is not None else config.resolve_arch()
        error = config.world_size_error(self.world_size, "the group's world_size", self.arch.spec.num_experts)
        if error:
            raise ConfigError(error)
        connect(address, timeout_s=config.parallel.startup_timeout_s)
        self.config = config
        p = config.parallel
        self.use_gpu = use_gpu_for(config)
        self.transport_spec, why = resolve_transport(config, self.use_gpu)
        log.info("transport %s: %s", self.transport_spec.name, why)
        self._pg = None
        self.actors: list[Any] = []
        self.ranks: list[RankInfo] = []
        self.mesh: MeshSpec | None = None  # resolved once the placement group is placed
        bundle = {"CPU": p.cpu_per_worker} | ({"GPU": 1 / p.workers_per_gpu} if self.use_gpu else {})
        self._check_fits(bundle)
        try:
            self._start(bundle, worker_env or {})
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up
    def _check_fits(self, bundle: dict[str, float]) -> None:
        total = ray.cluster_resources()
        short = [f"{amount * self.world_size:g} {res} ({amount:g} per worker) but the Ray cluster has "
                 f"{total.get(res, 0):g} {res} in total" for res, amount in bundle.items()
                 if total.get(res, 0) < amount * self.world_size]
        if short:  # every shortfall at once (GPUs first: a GPU config on a CPU machine names its GPUs)
            short.sort(key=lambda text: " GPU " not in text)
            raise GroupError(f"parallel.world_size={self.world_size} needs " + "; and ".join(short)
                             + "; lower parallel.world_size or parallel.cpu_per_worker, or add nodes")

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
        self.mesh = self._resolve_mesh()  # before any worker starts: a bad mesh is a ConfigError
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
        address = self._get([self.actors[0].bootstrap_address.remote(p.collective_timeout_s)], p.startup_timeout_s,
                            "rendezvous")[0]
        nodes = [r.node_rank for r in self.ranks]
        if resolve_mesh(nodes, self.mesh.ep, self.use_gpu) != self.mesh:  # the workers sit where their bundles do
            raise GroupError(f"the workers' nodes {nodes} do not match their placement group's bundles")
        cfg = self.config.to_dict()
        self._get(
            [a.setup.remote(cfg, r, address, self.use_gpu, self.mesh) for a, r in zip(self.actors, self.ranks)],
            p.startup_timeout_s + p.collective_timeout_s,
            "setup",
        )
        uid = self._get(
            [self.actors[0].transport_bootstrap_id.remote(self.transport_spec.name)], p.startup_timeout_s, "bootstrap"
        )[0]
        buffers = transport_buffers(self.config, self.world_size, self.arch)
        names = self._get(
            [a.init_transport.remote(self.transport_spec, uid, buffers) for a in self.actors],
            p.startup_timeout_s + p.collective_timeout_s,
            "transport init",
        )
        log.info("worker group up: %d ranks on %d node(s) as %s, transport %s", self.world_size,
                 self.ranks[0].num_nodes, self.mesh, names[0])

    def _resolve_mesh(self) -> MeshSpec:
        """The rank mesh of the placed bundles (ranks in node order, as :func:`assign_ranks`
        orders the workers), from ``parallel.expert_parallel``; a ConfigError (one line) when the
        EP groups cannot lie as asked."""
        from ray.util import placement_group_table

        table = placement_group_table(self._pg).get("bundles_to_node_id") or {}
        ids = sorted(table.get(i, "") for i in range(self.world_size))
        order = sorted(set(ids))
        try:
            return resolve_mesh([order.index(n) for n in ids], self.config.parallel.expert_parallel,
                                self.use_gpu, self.arch.spec.num_experts)
        except MeshError as exc:
            raise ConfigError(str(exc)) from None

    def use_mesh(self, config: Config, arch: ResolvedArch) -> MeshSpec:
        """The rank mesh ``config`` asks for on this group's ranks (``parallel.expert_parallel``
        resolved against their nodes); a group started with another one switches to it: every
        rank remakes its EP and DP process groups and its transport (torch transports only: the
        NVSHMEM transport's peers are fixed when it starts). A bad mesh is a ConfigError."""
        try:
            mesh = resolve_mesh([r.node_rank for r in self.ranks], config.parallel.expert_parallel,
                                self.use_gpu, arch.spec.num_experts)
        except MeshError as exc:
            raise ConfigError(str(exc)) from None
        if mesh != self.mesh:
            if self.transport_spec.name == "nvshmem":
                raise ConfigError(f"parallel.expert_parallel={config.parallel.expert_parallel} asks for {mesh} but "
                                  f"this group's NVSHMEM transport was started as {self.mesh}; start a group "
                                  "with that parallel.expert_parallel")
            p = self.config.parallel
            self._get([a.set_mesh.remote(mesh) for a in self.actors], p.startup_timeout_s + p.collective_timeout_s,
                      "set_mesh")
            self.mesh = mesh
        return mesh

    # ------------------------------------------------------------------ calls
    def _get(self, refs: list, timeout: float | None, what: str, ranks: Sequence[int] | None = None) -> list:
        """Every rank's result in order (``ranks``: the rank of each ref, default every rank in
        order); the first failure raised as a :class:`WorkerFailure` after the other ranks'
        results are settled (fetched and dropped), so that Ray does not print their errors as
        "Unhandled error" tracebacks later."""
        try:
            return self._get_in_order(refs, timeout, what, ranks)
        except WorkerFailure as exc:  # a hang is not waited for again; raised errors arrive together
            _settle(refs, 0.0 if exc.cause == "timeout" else 5.0)
            raise

    def _get_in_order(self, refs: list, timeout: float | None, what: str,
                      ranks: Sequence[int] | None = None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        if ranks is None and len(refs) == len(self.ranks):
            ranks = range(len(refs))

        def where(i: int) -> tuple[int | None, dict, str]:
            info = self.ranks[ranks[i]] if ranks is not None else None
            if info is None:
                return None, {}, ""
            return (info.rank, {"node_id": info.node_id, "hostname": info.hostname, "ip": info.ip, "pid": info.pid},
                    f" (node {info.node_id[:8]}, {info.hostname}, pid {info.pid})")

        def died(i: int, exc: RayActorError) -> WorkerFailure:
            rank, place, at = where(i)
            reason = " ".join(str(exc).split())[:400]
            return WorkerFailure(f"{what}: the worker of rank {rank}{at} died: {reason}", rank, "died", place)

        results: list[Any] = []
        for i, ref in enumerate(refs):
            rank, place, at = where(i)
            # a worker that died while this rank waits (e.g. in a collective with ranks that wait for
            # it: on a rank mesh not every rank talks to every other) is named at once, not after the timeout
            while not ray.wait([ref], timeout=_poll(deadline))[0]:
                dead = _first_dead(refs[i + 1:])
                if dead is not None:
                    raise died(i + 1 + dead[0], dead[1]) from dead[1]
                if deadline is not None and time.monotonic() >= deadline:
                    raise WorkerFailure(f"{what}: rank {rank}{at} did not answer within {timeout:g}s",
                                        rank, "timeout", place) from None
            try:
                results.append(ray.get(ref, timeout=0))
            except RayActorError as exc:
                raise died(i, exc) from exc
            except RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                dead = self._dead_worker(what, f"rank {rank} then raised {type(cause).__name__}")
                if dead is not None:  # a peer's collective failed because another worker died
                    raise dead from exc
                raise WorkerFailure(f"{what}: rank {rank}{at} raised {type(cause).__name__}: {cause}",
                                    rank, "error", place) from exc
        return results

    def _dead_worker(self, what: str, consequence: str, timeout: float = 10.0) -> WorkerFailure | None:
        """The first rank whose actor is dead (a ping fails with RayActorError), as a failure that
        names it; None when every worker answers (or does not in time: a hang, not a death)."""
        refs = [a.ping.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for info, ref in zip(self.ranks, refs):
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                reason = " ".join(str(exc).split())[:300]
                return WorkerFailure(
                    f"{what}: the worker of rank {info.rank} (node {info.node_id[:8]}, {info.hostname}, pid "
                    f"{info.pid}) died ({consequence}): {reason}", info.rank, "died",
                    {"node_id": info.node_id, "hostname": info.hostname, "ip": info.ip, "pid": info.pid})
            except Exception:  # noqa: BLE001 - not answered yet, or answered: not dead
                continue
        return None

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

    def execute_on(self, rank: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
                   **kwargs: Any) -> Any:
        """Run ``fn(worker, *args, **kwargs)`` on rank ``rank`` alone (e.g. a one-GPU reference
        timed beside the group's runs); a failure or timeout is named as :meth:`execute` names it."""
        if not 0 <= rank < len(self.actors):
            raise ValueError(f"rank {rank} is not in this group of {len(self.actors)}")
        ref = self.actors[rank].execute.remote(fn, *args, **kwargs)
        return self._get([ref], timeout, getattr(fn, "__name__", "execute"), ranks=[rank])[0]

    def health_check(self, timeout: float = 10.0) -> None:
        """Raise WorkerFailure naming the first rank that is dead or does not answer in time."""
        self.call(EPWorker.ping, timeout=timeout)

    @property
    def transport_name(self) -> str:
        """The transport every rank runs (gloo | nccl | nvshmem)."""
        return self.transport_spec.name

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


def _poll(deadline: float | None, every_s: float = 2.0) -> float:
    """How long one wait of :meth:`WorkerGroup._get_in_order` lasts: ``every_s``, or what is left
    before ``deadline``."""
    return every_s if deadline is None else max(0.0, min(every_s, deadline - time.monotonic()))


def _first_dead(refs: list) -> tuple[int, RayActorError] | None:
    """(index, error) of the first of ``refs`` that has finished because its actor died; None if none has."""
    if not refs:
        return None
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    finished = set(done)
    for i, ref in enumerate(refs):
        if ref in finished:
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                return i, exc
            except Exception:  # noqa: BLE001 - an error raised by the rank: reported in rank order
                pass
    return None


def _settle(refs: list, wait_s: float = 5.0) -> None:
    """Fetch and drop the results of ``refs`` that arrive within ``wait_s`` (errors included): an
    error left unfetched is printed by Ray with its traceback when its reference is dropped."""
    try:
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
    except Exception:  # noqa: BLE001 - Ray shutting down: nothing to settle
        return
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - the failure that matters is already being raised
            pass


def _worker_method(method: Callable[..., Any]) -> str:
    """The name of an :class:`EPWorker` method given by reference; anything else is refused here,
    on the driver, before a call is sent."""
    name = getattr(method, "__name__", None)
    if name is None or getattr(EPWorker, name, None) is not method:
        raise TypeError(f"{method!r} is not a method of EPWorker; pass e.g. EPWorker.step "
                        "(or use WorkerGroup.execute for a function)")
    return name
