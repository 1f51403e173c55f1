"""What one Ray node can do, asked from a task pinned to it: imports, torch, CUDA, GPUs, peer access.

:func:`probe_node` imports nothing from ``ray_moe`` at module level and is shipped to the node
*by value* (see :func:`shipped_by_value`), so it still runs on a node whose ``ray_moe`` is missing
or broken and reports that as a result instead of failing to deserialize.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator


def probe_node(peer_copy_bytes: int = 1 << 20) -> dict[str, Any]:
    """Run on the node (with every GPU of the node assigned). Never raises: errors are values."""
    import importlib
    import os
    import platform
    import socket

    out: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    try:
        module = importlib.import_module("ray_moe")
        importlib.import_module("ray_moe.worker")  # the actor's module and what it pulls in
        out["ray_moe_path"] = os.path.dirname(module.__file__ or "")
        try:
            from importlib.metadata import version

            out["ray_moe"] = version("ray-moe")
        except Exception:  # noqa: BLE001 - a source checkout without metadata
            out["ray_moe"] = "unknown"
    except BaseException as exc:  # noqa: BLE001 - an import may even raise SystemExit
        out["import_error"] = f"{type(exc).__name__}: {exc}"
    out.update(probe_gpus(torch, peer_copy_bytes))
    return out


def probe_gpus(torch: Any, peer_copy_bytes: int) -> dict[str, Any]:
    """Per GPU: name, memory, a matmul checked against the CPU; per pair: peer access and a copy."""
    out: dict[str, Any] = {"cuda_available": bool(torch.cuda.is_available()), "gpus": [], "peers": []}
    if not out["cuda_available"]:
        return out
    try:
        out["driver"] = driver_version(torch)
        n = torch.cuda.device_count()
    except Exception as exc:  # noqa: BLE001
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"
        return out
    a = torch.randn(256, 256)
    ref = a @ a
    for i in range(n):
        gpu: dict[str, Any] = {"index": i}
        try:
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            gpu |= {"name": props.name, "capability": f"{props.major}.{props.minor}",
                    "memory_total_gib": total / 2**30, "memory_free_gib": free / 2**30}
            d = a.to(f"cuda:{i}")
            err = ((d @ d).cpu() - ref).abs().max().item() / ref.abs().max().item()
            gpu["matmul_rel_err"] = err
            if not err < 1e-2:
                gpu["error"] = f"matmul on the GPU differs from the CPU (rel. error {err:.3g})"
        except Exception as exc:  # noqa: BLE001
            gpu["error"] = f"{type(exc).__name__}: {exc}"
        out["gpus"].append(gpu)
    for i in range(n):
        for j in range(n):
            if i != j:
                out["peers"].append(peer_check(torch, i, j, peer_copy_bytes))
    return out


def peer_check(torch: Any, src: int, dst: int, nbytes: int) -> dict[str, Any]:
    """Can GPU ``src`` access ``dst`` directly, and does a copy between them arrive intact?"""
    res: dict[str, Any] = {"src": src, "dst": dst}
    try:
        res["can_access"] = bool(torch.cuda.can_device_access_peer(src, dst))
        x = torch.arange(nbytes // 4, dtype=torch.int32, device=f"cuda:{src}")
        y = x.to(f"cuda:{dst}")
        torch.cuda.synchronize(dst)
        res["copy_ok"] = bool(torch.equal(y.cpu(), x.cpu()))
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    return res


def driver_version(torch: Any) -> str:
    """The CUDA driver version as 'major.minor' (from the driver API through torch), or 'unknown'."""
    getter = getattr(torch._C, "_cuda_getDriverVersion", None)
    if getter is None:
        return "unknown"
    v = int(getter())
    return f"{v // 1000}.{(v % 1000) // 10}"


@contextlib.contextmanager
def shipped_by_value() -> Iterator[None]:
    """While open, functions of this module are pickled by value (so nodes need not import it)."""
    import ray.cloudpickle as cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(module)
