"""Helpers shared by the test modules."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import yaml

from ray_moe.config import Config
from ray_moe.topology import RankInfo


def small_config(tmp_path, world_size=2, **over) -> Config:
    raw = {
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 48, "aux_loss_coef": 0.0},
        "parallel": {"world_size": world_size, "device": "cpu", "cpu_per_worker": 0.5, "startup_timeout_s": 240},
        "data": {"max_bytes": 300_000},
        "train": {"steps": 6, "batch_size": 8, "lr": 3e-3, "warmup_steps": 2, "eval_batches": 2,
                  "run_dir": str(tmp_path / "run"), "plots": False, "resume": False},
    }
    cfg = Config.from_dict(raw)
    return cfg.with_overrides([f"{k}={v}" for k, v in over.items()])


def write_config(path: Path, cfg: Config) -> None:
    """``cfg`` as a YAML file for ``ray-moe train --config path``."""
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def single_rank(world_size: int = 1, rank: int = 0) -> RankInfo:
    """The RankInfo of a rank that runs without a group (the single-process reference)."""
    return RankInfo(rank, world_size, "local", 0, 1, rank, world_size, "127.0.0.1", "local", 0, -1)



def gpu_ranks(max_gpus: int | None = None) -> tuple[int, int]:
    """(world size, ranks per GPU) for a GPU test's group: ``min(max_gpus, GPUs in the Ray cluster)``
    GPUs, each shared by ``RAY_MOE_PES_PER_GPU`` ranks (default 1; >1 runs several NVSHMEM PEs on
    one GPU, best under CUDA MPS: ``scripts/device_ep.sh``). ``max_gpus`` defaults to
    ``RAY_MOE_TEST_GPUS`` (2 if unset: the tests' timings were set at W=2; 4 or 8 on a larger
    machine). Skips the test without a GPU."""
    import os

    import pytest
    import ray

    from ray_moe.driver.group import connect

    connect()
    if max_gpus is None:
        max_gpus = int(os.environ.get("RAY_MOE_TEST_GPUS", "2"))
    gpus = min(max_gpus, int(ray.cluster_resources().get("GPU", 0)))
    if gpus < 1:
        pytest.skip("needs a GPU in the Ray cluster")
    per_gpu = int(os.environ.get("RAY_MOE_PES_PER_GPU", "1"))
    return gpus * per_gpu, per_gpu


def build(cfg: Config, transport, device="cpu"):
    """``cfg``'s model on one process: the architecture resolved here (the driver's job), then built."""
    from ray_moe.model.build import build_model

    return build_model(cfg, cfg.resolve_arch(), transport, device)


def engine(cfg: Config, device="cpu", transport=None, rank_info=None):
    """A one-process :class:`~ray_moe.worker.engine.Engine` of ``cfg`` (its architecture resolved here)."""
    import torch

    from ray_moe.comm.local import LocalTransport
    from ray_moe.worker.engine import Engine

    return Engine(cfg, rank_info or single_rank(), transport or LocalTransport(), torch.device(device),
                  cfg.resolve_arch())


def compile_for_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int, **options: Any) -> dict:
    """``fn`` (a ``@triton.jit`` kernel) compiled for an H100 (sm_90) here, without a GPU, as the
    device would compile it (Triton ships ptxas): the interpreter accepts code the compiler rejects.
    ``signature``: Triton's argument types (``"*bf16"``, ``"i64"``, ``"constexpr"``); ``options``:
    more compile options (``num_stages``, ``maxnreg``). Returns the compiled artefacts
    (``asm["cubin"]``, ``asm["ptx"]``); skips without Triton."""
    return _compile_sm90(fn, signature, constexprs, num_warps=num_warps, **options).asm


def _compile_sm90(fn, signature: dict[str, str], constexprs: dict, divisible: tuple[str, ...] = (), **options: Any):
    import pytest

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _divisible_by_16(value: Any) -> bool:
    """What Triton's JIT specialises an argument on: a pointer 16-byte aligned, an integer a
    multiple of 16 (it then vectorises loads and stores through them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


H100_SHARED_BYTES = 232448  # shared memory one program may use on an H100 (227 KiB)


@contextlib.contextmanager
def launches_compiled_for_sm90():
    """Inside, every ``kernel[grid](*args, **kwargs)`` launch compiles ``kernel`` for sm_90 (as
    :func:`compile_for_sm90`) with the launch's own argument types, constexprs, warps, stages and
    register cap, specialised as the JIT does on 16-divisible pointers and integers, and runs
    nothing: the launchers' CUDA arguments (tiles, descriptors, options) checked without a GPU. Yields the list the compiled kernels are appended to, as (kernel name,
    Triton's CompiledKernel: ``asm``, ``metadata.shared``)."""
    from unittest import mock

    from triton.runtime.jit import JITFunction, mangle_type

    compiled: list[tuple[str, Any]] = []

    def getitem(kernel, grid):
        def launch(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
            bound = {**dict(zip(kernel.arg_names, args)), **kwargs}
            unknown = set(bound) - set(kernel.arg_names)
            if len(args) > len(kernel.arg_names) or unknown:
                raise TypeError(f"{kernel.fn.__name__}: {len(args)} positional arguments for "
                                f"{len(kernel.arg_names)} parameters; unknown keywords {sorted(unknown)}")
            missing = [p.name for p in kernel.params if p.name not in bound and not p.has_default]
            if missing:
                raise TypeError(f"{kernel.fn.__name__}: missing arguments {missing}")
            values = {p.name: bound[p.name] if p.name in bound else p.default for p in kernel.params}
            constexprs = {p.name: values[p.name] for p in kernel.params if p.is_constexpr}
            signature = {p.name: "constexpr" if p.is_constexpr else mangle_type(values[p.name])
                         for p in kernel.params}
            divisible = tuple(p.name for p in kernel.params if not p.is_constexpr and _divisible_by_16(values[p.name]))
            compiled.append((kernel.fn.__name__, _compile_sm90(kernel, signature, constexprs, divisible, **options)))

        return launch

    with mock.patch.object(JITFunction, "__getitem__", getitem):
        yield compiled


def clone_grads_three_ways(worker) -> dict:
    """One forward and backward of the engine's next batch, its clone gradients reduced three ways:
    after backward in place (:func:`reduce_clone_grads`, the reference), and by the engine's
    :class:`CloneGradReduction` launched from backward's hooks with float32 and with rounded sums.
    Returns each way's expert gradients (float32) and how many layers backward launched itself."""
    from ray_moe.placement.clones import reduce_clone_grads

    e = worker.engine
    e.settle()  # (an overlapped update still in flight)
    layers = e.model.moe_layers()
    assert any(layer.placement.clones() for layer in layers)  # the re-plans placed clones
    x, y = e.batch("train", e.step)
    out = {}
    for way in ("reference", "float32", "rounded"):
        ce, aux = e.loss(x, y)
        e.optimizer.zero_grad()
        if way != "reference":
            e.clone_grads.rounded = way == "rounded"
            e.clone_grads.max_in_flight = 1  # rounded: the last layer's sums added during backward
            e.clone_grads.begin()
        (ce + aux).backward()
        if way == "reference":  # every slot's gradient in float32, the clones' added in place
            whole = [[p.grad.float() for p in (layer.w13, layer.w2)] for layer in layers]
            for layer, grads in zip(layers, whole):
                reduce_clone_grads(layer, layer.placement, grads)
            n = layers[0].placement.experts_per_rank
            out[way] = [g[:n].clone() for grads in whole for g in grads]
        else:
            e.clone_grads.launch_rest()
        if way == "rounded":
            e.clone_grads.add_received(lambda p: p.grad)
        e.optimizer.gather_grads()
        if way == "float32":
            e.clone_grads.add_received(e.optimizer.grad)
        if way != "reference":  # the native slots (the master gradients': clone slots have none)
            n = layers[0].placement.experts_per_rank
            out[way] = [e.optimizer.grad(p)[:n].float().clone() for layer in layers for p in (layer.w13, layer.w2)]
        out[f"{way}_launched"] = 0 if way == "reference" else e.clone_grads.launched_in_backward
        e.optimizer.drop_grads()
    e.clone_grads.rounded, e.clone_grads.max_in_flight = False, 2
    return out


def check_clone_grads_three_ways(out: dict, layers: int, exact: bool) -> None:
    """:func:`clone_grads_three_ways`' result: ``layers`` launched by backward itself, float32
    sums equal to the reference and rounded ones within one bf16 rounding of it. ``exact`` (CPU):
    elementwise, float32 bit for bit; else (GPU kernels, whose sums may run in another order each
    time) each slot's gradient within 2^-7 of the reference's norm, which a clone's contribution
    lost or added twice would exceed."""
    import torch

    assert out["float32_launched"] == out["rounded_launched"] == layers, out  # (0: all after backward)
    for ref, f32, rounded in zip(out["reference"], out["float32"], out["rounded"], strict=True):
        if exact:
            assert torch.equal(f32, ref)
            torch.testing.assert_close(rounded, ref, rtol=2 ** -8, atol=1e-30)
            continue
        for got in (f32, rounded):
            err = (got - ref).flatten(1).norm(dim=1)
            assert bool((err <= 2 ** -7 * ref.flatten(1).norm(dim=1) + 1e-12).all()), (err, ref.flatten(1).norm(dim=1))
    if exact:
        assert any(not torch.equal(r, ref) for r, ref in zip(out["rounded"], out["reference"]))


def run_all(group: Any, base: Any = None, tol: float | None = None) -> list[str]:
    """Every edge case through check_dispatch and check_combine on a group (``base``: the
    :class:`~ray_moe.validation.Case` they vary, default ``Case()``); returns failures."""
    from ray_moe.validation import EDGE_CASES, Case
    from ray_moe.validation.transport import check_combine, check_dispatch

    failures = []
    mesh = getattr(group, "mesh", None)
    ranks = mesh.ep if mesh is not None else group.world_size  # the ranks of one exchange
    for extra in EDGE_CASES:
        case = (base or Case()).but(**extra)
        if case.applies_to(ranks) is not None:
            continue
        t = tol if tol is not None else (1e-6 if case.dtype == "float32" else 1e-2)
        for fn in (check_dispatch, check_combine):
            for rank, res in enumerate(group.execute(fn, case, timeout=300)):
                bad = {k: v for k, v in res["errors"].items() if not v <= t}
                if bad:
                    failures.append(f"{fn.__name__} rank {rank} case {extra}: {bad}")
    return failures
