"""Small device helpers shared by the engine, the loss, the kernels, the benchmarks and the smoke test."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU, where work is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture_graph(fn: Callable[[], T], warmup: int = 2,
                  before_capture: Callable[[], None] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` captured in a CUDA graph after ``warmup`` eager calls on a side stream (Triton
    compiles, per-shape choices are measured and the allocator settles outside the capture, as CUDA
    graphs require). ``before_capture`` runs between (e.g. clearing gradients, so that the captured
    backward allocates them in the graph's pool). Returns the graph and what the captured call
    returned: its tensors are the graph's static outputs, refreshed by every ``replay()``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def add_mm_t(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (float32 [V, H]) += aᵀ @ b for a [c, V], b [c, H] in the model dtype, summed in float32:
    a float32-output GEMM where the device has one (CUDA, sm80+), else the chunk upcast (never a
    partial sum rounded to the model dtype). The LM losses' weight-gradient accumulation."""
    if acc.dtype == a.dtype:
        acc.addmm_(a.t(), b)
    elif (acc.is_cuda and hasattr(torch.ops.aten.addmm, "dtype_out")  # a feature test, not a version string
          and torch.cuda.get_device_capability(acc.device)[0] >= 8):
        torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
    else:  # no float32-output GEMM here: upcast the chunk rather than round each partial sum
        acc.addmm_(a.t().float(), b.float())
