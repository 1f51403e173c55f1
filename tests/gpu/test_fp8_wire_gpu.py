"""FP8 rows on the wire over NVSHMEM on real GPUs (``moe.expert_precision: fp8``): the dispatch
sends E4M3 rows and their 1×128 scales (H + 4·H/128 bytes a row) through the exchange kernels and
the up-projection reads them as they arrive.

Two PEs on one GPU (``RAY_MOE_PES_PER_GPU=2``, under CUDA MPS: ``scripts/device_ep.sh pes2`` with
``PES_FILES=tests/gpu/test_fp8_wire_gpu.py``), or one rank per GPU on two. Needs sm_89 or newer
(FP8 tensor cores) and nvshmem4py; skipped otherwise.

Covers: the wire layer against the FP8 layer without it (float32 and bf16; the FP8 Triton
kernels and the exchange kernels' byte rows); the transport's dispatch bytes at (H + 4·H/128) /
(2·H) of bf16's; a CUDA graph of the wire layer's forward+backward replayed equal to eager; and
``bench comm``'s FP8 dispatch row (time and bytes beside bf16's, the rows arriving intact).
"""

from __future__ import annotations

import pytest
import torch

from ray_moe.validation import Case, rel_err
from tests.gpu.test_nvshmem_gpu import _make_group

pytestmark = pytest.mark.gpu

ROUND_OFF = {"float32": 1e-5, "bfloat16": 1e-3}  # bf16: the combine's and index sums' rounding order
H = 128


@pytest.fixture(scope="module")
def group():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 experts need a GPU with FP8 tensor cores (sm_89 or newer)")
    g = _make_group()
    if g.world_size < 2:
        g.close()
        pytest.skip("needs two ranks (RAY_MOE_PES_PER_GPU=2 on one GPU, or two GPUs)")
    yield g
    g.close()


def _case(dtype: str) -> Case:
    return Case(seed=2, top_k=2, hidden=H, expert_hidden=128, num_experts=8, tokens_per_rank=(37, 20, 29, 11),
                dtype=dtype, expert_precision="fp8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wire_layer_equals_the_fp8_layer(group, dtype):
    from tests.fp8_wire import fp8_wire_parity

    for rank, errs in enumerate(group.execute(fp8_wire_parity, _case(dtype), timeout=300)):
        assert errs and all(v <= ROUND_OFF[dtype] for v in errs.values()), (rank, errs)
    group.execute(lambda w: w.transport.check())


def test_dispatch_bytes_fall_to_the_fp8_rows_share(group):
    from tests.fp8_wire import dispatch_bytes

    for rank, sizes in enumerate(group.execute(dispatch_bytes, _case("bfloat16"), timeout=300)):
        assert sizes["bf16"] > 0 and sizes["fp8"] * 2 * H == sizes["bf16"] * (H + 4 * H // 128), (rank, sizes)


def _graph_vs_eager(worker) -> dict[str, float]:
    """The bf16 layer with FP8 experts and FP8 rows on the wire: forward+backward captured in a
    CUDA graph, replayed on new inputs (and after the weights change), against eager runs."""
    from ray_moe.comm.base import BufferSpec
    from ray_moe.device import capture_graph
    from ray_moe.model.moe import MoELayer, MoELayerSpec

    dev = worker.device
    worker.transport.reserve(BufferSpec(max_tokens=64, hidden=H, elem_bytes=2, max_top_k=2))
    spec = MoELayerSpec(H, 8, 2, 128, seed=7, dtype=torch.bfloat16, expert_precision="fp8")
    layer, eager = (MoELayer(spec, worker.transport, device=dev) for _ in range(2))
    torch.manual_seed(10 + worker.rank_info.rank)
    sx = torch.randn(40, H, dtype=torch.bfloat16, device=dev, requires_grad=True)
    sg = torch.randn(40, H, dtype=torch.bfloat16, device=dev)

    def train_step():
        out, _ = layer(sx)
        out.backward(sg)
        return out

    def clear_grads():
        layer.zero_grad(set_to_none=True)
        sx.grad = None

    graph, out = capture_graph(train_step, before_capture=clear_grads)
    errs = {}
    for trial in range(3):
        if trial == 2:  # a replay after an update reads the new weights (quantised inside the graph)
            with torch.no_grad():
                for a, b in ((layer.w13, eager.w13), (layer.w2, eager.w2)):
                    a.mul_(0.5)
                    b.mul_(0.5)
        nx = torch.randn(40, H, dtype=torch.bfloat16, device=dev)
        ng = torch.randn(40, H, dtype=torch.bfloat16, device=dev)
        with torch.no_grad():
            sx.copy_(nx)
            sg.copy_(ng)
        graph.replay()
        torch.cuda.synchronize()
        eager.zero_grad(set_to_none=True)
        ex = nx.clone().requires_grad_()
        eo, _ = eager(ex)
        eo.backward(ng)
        errs[f"out{trial}"] = rel_err(out, eo)
        errs[f"grad_x{trial}"] = rel_err(sx.grad, ex.grad)
        errs[f"grad_w13_{trial}"] = rel_err(layer.w13.grad, eager.w13.grad)
        errs[f"grad_router{trial}"] = rel_err(layer.router.grad, eager.router.grad)
    worker.transport.check()
    return errs


def test_cuda_graph_replay_of_the_wire_layer(group):
    for rank, errs in enumerate(group.execute(_graph_vs_eager, timeout=300)):
        assert all(v <= 1e-2 for v in errs.values()), (rank, errs)


def _bench_fp8_row(worker) -> dict:
    from ray_moe.bench.comm import _fp8_dispatch, _routing

    tr, dev = worker.transport, worker.device
    T, K, E = 256, 8, 64
    buf = tr.new_buffer(capacity=T, hidden=4096, elem_bytes=2, kmax=K)
    x = torch.randn(T, 4096, dtype=torch.bfloat16, device=dev)
    dr, ds, w = _routing(T, E, K, tr.world_size, 5 + tr.rank, dev)
    try:
        return _fp8_dispatch(buf, x, w, dr, ds, iters=3, rows_out=T)
    finally:
        buf.check()
        buf.close()


def test_bench_comm_fp8_dispatch_row(group):
    for rank, rec in enumerate(group.execute(_bench_fp8_row, timeout=300)):
        assert rec["fp8_dispatch_bytes"] == 256 * (4096 + 4 * 32 + 64), (rank, rec)
        assert 0 < rec["fp8_rel_err"] < 0.05, (rank, rec)  # E4M3's ~3.6 % RMS per element
        assert all(rec[k] > 0 for k in ("bf16_dispatch_s", "fp8_dispatch_s", "fp8_quant_dispatch_s")), (rank, rec)
