"""NVSHMEM transport on real GPUs (run on the GPU machine; skipped without CUDA or nvshmem4py).

Covers: UID bootstrap across Ray actors, the kernels' layout against ``layout_reference``, the
transport validators (fp32 and bf16; also with the dispatch's copy-out interleaved with its
sends, ``Tuning.interleave``), the full layer's parity with the single-process oracle in
bf16 (every gradient), a larger buffer reserved on a live transport, the ``force_remote_path``
variant, CUDA-graph capture and replay of a layer's forward+backward, and (with
``RAY_MOE_TWO_NODE_ADDRESS`` pointing at a cluster of two Ray nodes on one host, see
``scripts/nvshmem_device.sh``) two Ray nodes treated as two nodes.

The group has two ranks where the machine has two GPUs, else one (one PE: the kernels, the
layout and the graph capture still run; the peer paths need two).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from ray_moe.device import capture_graph
from ray_moe.validation import Case, rel_err
from ray_moe.validation.layer import layer_parity, make_problem
from tests.support import gpu_ranks, run_all

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2
PARITY_CASES = [
    dict(),
    dict(routing="empty_rank"),
    dict(routing="empty_expert"),
    dict(routing="one_expert", top_k=1, tokens_per_rank=[3, 7]),
    dict(tokens_per_rank=[1]),
    dict(tokens_per_rank=[1, 40], top_k=4),
    dict(top_k=8),
]


# RAY_MOE_TEST_SPIN_LIMIT: the module group's nvshmem_spin_limit (default 2^25 polls). A much
# larger one tells a peer that is merely late (e.g. still compiling a kernel variant: the W=4
# interleaved combine compiles in 5 s against 1 s) from a signal that never comes
SPIN_LIMIT = int(os.environ.get("RAY_MOE_TEST_SPIN_LIMIT", str(1 << 25)))


def _make_group(force_remote: bool = False, address: str | None = None, strategy: str = "PACK",
                min_gpus: int = 1, spin_limit: int = SPIN_LIMIT):
    pytest.importorskip("nvshmem.core")
    import ray

    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup, connect

    connect(address)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus < min_gpus:
        pytest.skip(f"needs {min_gpus} GPUs in the Ray cluster")
    W, per_gpu = gpu_ranks()
    cfg = Config.from_dict({
        "model": {"d_model": 64, "seq_len": 32, "n_heads": 4},
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 96},
        "train": {"batch_size": 2 * W},  # 2 sequences x 32 = 64 tokens per rank
        "parallel": {"world_size": W, "device": "cuda", "transport": "nvshmem",
                     "force_remote_path": force_remote, "placement_strategy": strategy,
                     "startup_timeout_s": 180, "workers_per_gpu": per_gpu,
                     "nvshmem_spin_limit": spin_limit,
                     # RAY_MOE_TEST_COMM_PROGRAMS: G, the exchange's programs per rank (0: the SMs
                     # divided among the ranks sharing a GPU), to tell residency from other causes
                     "comm_programs": int(os.environ.get("RAY_MOE_TEST_COMM_PROGRAMS", "0"))},
    })
    return WorkerGroup(cfg)


@pytest.fixture(scope="module")
def group():
    g = _make_group()
    yield g
    g.close()


@pytest.fixture
def remote_group(group):
    """Function-scoped: it holds every GPU, and the tests after it make their own groups. Its
    arrivals are waited for by the receiving kernel."""
    group.close()  # one group of two GPUs at a time
    g = _make_group(force_remote=True, min_gpus=2)
    yield g
    g.close()


def _check_everything(g, label: str) -> None:
    fails = run_all(g, Case(hidden=64)) + run_all(g, Case(hidden=64, dtype="bfloat16"))
    assert not fails, f"{label}: " + "\n".join(fails)
    for extra in PARITY_CASES:
        if Case(**extra).applies_to(g.world_size) is not None:
            continue
        case = Case(seed=_seed_without_near_ties(extra, g.world_size), dtype="bfloat16", hidden=64, **extra)
        res = g.execute(layer_parity, case, timeout=300)
        for rank, errs in enumerate(res):
            bad = {k: v for k, v in errs.items() if not v <= BF16_TOL}
            assert not bad, f"{label} rank {rank} case {extra}: {bad}"
    g.execute(lambda w: w.transport.check())


def _seed_without_near_ties(extra: dict, world_size: int) -> int:
    """A seed whose top-k is the same on fp32 and bf16-rounded tokens.

    layer_parity routes the fp32 oracle on fp32 tokens while the bf16 layer routes on bf16
    tokens; a near tie then picks another expert for that token and the relative error is ~0.1
    whatever the transport (seen on the device: seed 5, 1 token of 32).
    """
    from ray_moe.model.router import route

    for seed in range(5, 100):
        case = Case(seed=seed, dtype="bfloat16", hidden=64, **extra)
        P = make_problem(case, world_size)
        _, a, _ = route(P["x"], P["router"], case.top_k)
        _, b, _ = route(P["x"].bfloat16(), P["router"], case.top_k)
        if torch.equal(a.sort(1).values, b.sort(1).values):
            return seed
    raise AssertionError(f"no seed without near ties for {extra}")


def test_bootstrap(group):
    desc = group.execute(lambda w: w.transport.describe())
    assert [d["transport"] for d in desc] == ["nvshmem"] * group.world_size
    assert all(d["remote_peers"] == [] for d in desc)
    assert group.world_size == gpu_ranks()[0]


def test_kernel_layout_equals_layout_reference(group):
    """The dispatch kernel's on-device layout (row of each token at each destination, rows per
    destination) is exactly ``layout_reference``'s, for fresh random routings and edge cases."""
    res = group.execute(_layout_vs_reference, timeout=300)
    for rank, bad in enumerate(res):
        assert not bad, f"rank {rank}: {bad}"


def test_reserve_grows_the_buffer_on_a_live_transport(group):
    """A case wider and longer than the group's config: the transport reserves a new symmetric
    buffer (collectively) and the validators still pass on it."""
    fails = run_all(group, Case(hidden=192, tokens_per_rank=(300, 7), dtype="bfloat16"))
    assert not fails, "\n".join(fails)
    caps = group.execute(lambda w: (w.transport.buffer.capacity, w.transport.spec.hidden))
    assert all(c >= 300 and h == 192 for c, h in caps), caps


def test_validators_and_layer_parity(group):
    _check_everything(group, "peer path")


def _interleave_copy_out(worker, on: bool) -> None:
    """Give this rank's buffers (the live one and every later one) ``Tuning.interleave`` = on."""
    from ray_moe.comm.nvshmem_kernels import Tuning

    tr = worker.transport

    def tuned(buf):
        buf.tuning = Tuning.for_hidden(buf.geo.hidden, buf.geo.world_size)
        buf.tuning.interleave = on
        return buf

    if on:
        make = type(tr).new_buffer
        tr.new_buffer = lambda *a, **k: tuned(make(tr, *a, **k))
    else:
        tr.__dict__.pop("new_buffer", None)
    tuned(tr.buffer)


def test_interleaved_copy_out_parity(group):
    """The dispatch's copy-out and the combine's sums interleaved with the sends (Tuning.interleave,
    a launch variant ``bench comm`` times) equal the references on every edge case and the oracle
    in bf16, and a CUDA-graph replay equals eager, at any world size (at W=4, two PEs on each of
    two GPUs, it once timed out at a peer still compiling, 2026-11-25)."""
    group.execute(_interleave_copy_out, True)
    try:
        _check_everything(group, "interleaved copy-out")
        for rank, errs in enumerate(group.execute(_graph_vs_eager, timeout=300)):
            assert all(v <= BF16_TOL for v in errs.values()), ("graph", rank, errs)
    finally:
        group.execute(_interleave_copy_out, False)


def _interleaved_on_few_programs(worker) -> dict:
    """Many blocks per program (a buffer of 2 programs, H=1024, blocks of 4 rows), so rows arrive
    part by part while the receiver copies and sums: 12 rounds of every transport check, the
    tuning alternating between interleaved and not, then the buffer's invariants."""
    import torch.distributed as dist

    from ray_moe.comm.base import BufferSpec
    from ray_moe.comm.nvshmem_kernels import Tuning
    from ray_moe.validation.transport import check_combine, check_dispatch

    tr = worker.transport
    old = tr.buffer, tr.spec
    spec = BufferSpec(max_tokens=256, hidden=1024, elem_bytes=4, max_top_k=8)
    buf = tr.new_buffer(capacity=spec.max_tokens, hidden=spec.hidden, elem_bytes=4, kmax=8, num_programs=2)
    tr.buffer, tr.spec = buf, spec
    worst: dict = {"interleave_ok": float(not buf.interleave_ok)}  # every peer through peer pointers
    cases = [dict(tokens_per_rank=(256, 131)), dict(routing="empty_rank", tokens_per_rank=(200,)),
             dict(tokens_per_rank=(0, 256)), dict(top_k=8, tokens_per_rank=(97,))]
    try:
        for i in range(12):
            buf.tuning = Tuning(block_r=4, block_h=1024, num_warps=8, interleave=i % 3 != 2)
            case = Case(hidden=1024, seed=i).but(**cases[i % len(cases)])
            for fn in (check_dispatch, check_combine):
                for k, v in fn(worker, case)["errors"].items():
                    worst[k] = max(worst.get(k, 0.0), v)
        torch.cuda.synchronize()
        worst["done_nonzero"] = float(sum(int(ch.addrs.done.abs().sum()) for ch in (buf.dch, buf.cch)))
        worst["device_error"] = float(int(buf.err[0]))
    finally:
        tr.buffer, tr.spec = old
        tr.runtime.barrier()
        buf.close()
        dist.barrier()
    return worst


def test_interleaved_exchange_on_few_programs(group):
    """Tuning.interleave where each program has many blocks (the CPU harness has one program per
    rank; on the GPU the other tests' programs hold a block or less each)."""
    if group.world_size < 2:
        pytest.skip("needs two ranks")
    for rank, worst in enumerate(group.execute(_interleaved_on_few_programs, timeout=300)):
        bad = {k: v for k, v in worst.items() if not v <= 1e-6}
        assert not bad, (rank, bad)


def test_many_layers_reuse_one_buffer(group):
    """Four layers forward, then backward in reverse: layer 0's rows survive three later dispatches."""
    res = group.execute(_stacked_layers, timeout=300)
    for rank, errs in enumerate(res):
        assert all(v <= BF16_TOL for v in errs.values()), (rank, errs)


def _decode_layers(worker) -> dict:
    """Four stacked layers without autograd, as a decoding step runs them (the dispatch's outputs
    owned by the buffer, so each layer's dispatch overwrites the previous layer's received rows):
    eager twice and replayed from a CUDA graph with new tokens, against the same layers over the
    torch transport (new outputs every call)."""
    from ray_moe.comm.torch_a2a import TorchA2ATransport

    dev = worker.device
    torch.manual_seed(30 + worker.rank_info.rank)
    layers = [_layer(worker, 3, i, impl="triton") for i in range(4)]
    ref_t = TorchA2ATransport(worker.rank_info.rank, worker.rank_info.world_size)
    ref_layers = [_layer(worker, 3, i, impl="triton") for i in range(4)]
    for layer in ref_layers:
        layer.transport = ref_t
    x = torch.randn(8, 64, dtype=torch.bfloat16, device=dev)

    def step(stack, inp):
        h = inp
        for layer in stack:
            h = h + layer(h)[0]
        return h

    errs = {}
    with torch.no_grad():
        buf = worker.transport.buffer
        owned_before = set(buf._owned)
        first, second = step(layers, x), step(layers, x)
        ref = step(ref_layers, x)
        errs["eager"] = rel_err(first, ref)
        errs["eager_again"] = rel_err(second, ref)
        # eight dispatches of one call shape: at most one new set of owned outputs
        errs["one_owned_set"] = 0.0 if len(set(buf._owned) - owned_before) <= 1 else float("inf")
        graph, out = capture_graph(lambda: step(layers, x))
        for trial in range(3):
            x.copy_(torch.randn(8, 64, dtype=torch.bfloat16, device=dev))
            graph.replay()
            errs[f"graph{trial}"] = rel_err(out, step(ref_layers, x))
    torch.cuda.synchronize()
    worker.transport.check()
    return errs


def test_decoding_layers_with_buffer_owned_outputs(group):
    res = group.execute(_decode_layers, timeout=300)
    for rank, errs in enumerate(res):
        assert all(v <= BF16_TOL for v in errs.values()), (rank, errs)


def test_cuda_graph_replay(group):
    res = group.execute(_graph_vs_eager, timeout=300)
    for rank, errs in enumerate(res):
        assert all(v <= BF16_TOL for v in errs.values()), (rank, errs)  # index_add order varies


def test_layer_parity_with_clones(group):
    """Forced placements that clone experts across ranks (W=2: clones both ways; W=4 and W=8:
    experts with two clones, clones on every rank; random per-source shares with exact zeros):
    the bf16 layer over NVSHMEM equals the single-process oracle, every gradient."""
    from tests.cluster.test_clone_parity import FORCED_PLACEMENTS

    if group.world_size not in FORCED_PLACEMENTS:
        pytest.skip(f"the forced clone placements are for W in {sorted(FORCED_PLACEMENTS)}")
    extra = {"placement": FORCED_PLACEMENTS[group.world_size]().to_dict()}
    case = Case(seed=_seed_without_near_ties(extra, group.world_size), dtype="bfloat16", hidden=64, **extra)
    for rank, errs in enumerate(group.execute(layer_parity, case, timeout=300)):
        bad = {k: v for k, v in errs.items() if not v <= BF16_TOL}
        assert not bad, f"clones rank {rank}: {bad}"
    group.execute(lambda w: w.transport.check())


def test_force_remote_path(remote_group):
    desc = remote_group.execute(lambda w: w.transport.describe())
    W = remote_group.world_size
    for rank, d in enumerate(desc):  # every peer through NVSHMEM puts, at any world size
        assert d["remote_peers"] == [p for p in range(W) if p != rank], (rank, d["remote_peers"])
    _check_everything(remote_group, "force_remote_path")
    # the host-issued puts capture in a CUDA graph like the peer path's kernels
    for rank, errs in enumerate(remote_group.execute(_graph_vs_eager, timeout=300)):
        assert all(v <= BF16_TOL for v in errs.values()), ("graph", rank, errs)


def test_a_killed_worker_ends_the_others_waits_with_a_named_error(group):
    """The last rank dies (os._exit) where the others enter a dispatch: their bounded device-side
    waits end (a small parallel.nvshmem_spin_limit keeps it short), the transport's check raises
    its named error, and the driver's call names a rank and what happened to it, no hang."""
    from ray_moe.driver.group import WorkerFailure

    if group.world_size < 2:
        pytest.skip("needs two ranks")
    group.close()  # this group is broken by the test: one of its own
    g = _make_group(spin_limit=1 << 20)
    try:
        with pytest.raises(WorkerFailure) as err:
            g.execute(_dispatch_unless_last, timeout=120)
        text = str(err.value)
        assert re.search(r"rank \d", text), text
        assert "died" in text or "did not arrive" in text or "NVSHMEM" in text, text
    finally:
        g.close()


@pytest.mark.skipif(not os.environ.get("RAY_MOE_TWO_NODE_ADDRESS"), reason="set RAY_MOE_TWO_NODE_ADDRESS")
def test_two_ray_nodes_on_one_host():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    g = _make_group(address=os.environ["RAY_MOE_TWO_NODE_ADDRESS"], strategy="STRICT_SPREAD")
    try:
        assert g.num_nodes == 2
        desc = g.execute(lambda w: w.transport.describe())
        assert desc[0]["remote_peers"] == [1], desc  # another Ray node: the remote path
        _check_everything(g, "two Ray nodes")
    finally:
        g.close()


# --------------------------------------------------------------------------- worker functions
def _layer(worker, seed: int, idx: int = 0, impl: str = "grouped_mm"):
    from ray_moe.comm.base import BufferSpec
    from ray_moe.model.moe import MoELayer, MoELayerSpec

    worker.transport.reserve(BufferSpec(max_tokens=64, hidden=64, elem_bytes=2, max_top_k=2))
    return MoELayer(MoELayerSpec(64, 8, 2, 96, seed=seed, dtype=torch.bfloat16, expert_impl=impl),
                    worker.transport, layer_idx=idx, device=worker.device)


def _layout_vs_reference(worker) -> list[str]:
    from ray_moe.comm.base import BufferSpec
    from tests.references import layout_reference

    tr, dev = worker.transport, worker.device
    W, me = tr.world_size, tr.rank
    tr.reserve(BufferSpec(max_tokens=512, hidden=64, elem_bytes=2, max_top_k=8))
    g = torch.Generator().manual_seed(100 + me)
    bad = []
    for T, K, mode in ((512, 8, "random"), (300, 2, "random"), (1, 1, "random"), (0, 2, "random"),
                       (257, 4, "all_to_last"), (64, 3, "all_to_me")):
        if mode == "random":
            dr = torch.randint(0, W, (T, K), generator=g, dtype=torch.int32)
        else:
            dr = torch.full((T, K), W - 1 if mode == "all_to_last" else me, dtype=torch.int32)
        ds = torch.randint(0, 4, (T, K), generator=g, dtype=torch.int32)
        x = torch.randn(T, 64, generator=g).to(dev, torch.bfloat16)
        w = torch.rand(T, K, generator=g).to(dev)
        *_, layout = tr.dispatch_forward(x, w, dr.to(dev), ds.to(dev))
        pos, counts = layout_reference(dr, W)
        if not torch.equal(layout.pos.cpu(), pos):
            bad.append(f"T={T} K={K} {mode}: pos differs in {(layout.pos.cpu() != pos).sum().item()} entries")
        totals = layout.smeta[..., 2].cpu().max(0).values if T else torch.zeros(W, dtype=torch.int32)
        if not torch.equal(totals.long(), counts.long()):
            bad.append(f"T={T} K={K} {mode}: rows per destination {totals.tolist()} != {counts.tolist()}")
    tr.check()
    return bad


def _dispatch_unless_last(worker) -> None:
    """The last rank exits at once; every other rank dispatches to it and checks the transport."""
    tr = worker.transport
    if tr.rank == tr.world_size - 1:
        os._exit(1)
    T, K = 64, 2
    x = torch.randn(T, 64, device=worker.device, dtype=torch.bfloat16)
    dest = torch.full((T, K), tr.world_size - 1, dtype=torch.int32, device=worker.device)
    slot = torch.zeros(T, K, dtype=torch.int32, device=worker.device)
    w = torch.rand(T, K, device=worker.device)
    tr.dispatch_forward(x, w, dest, slot)
    torch.cuda.synchronize()
    tr.check()


def _stacked_layers(worker) -> dict:
    from ray_moe.comm.local import LocalTransport

    torch.manual_seed(worker.rank_info.rank)
    layers = [_layer(worker, 3, i) for i in range(4)]
    x = torch.randn(48, 64, dtype=torch.bfloat16, device=worker.device, requires_grad=True)
    h = x
    for layer in layers:
        h = h + layer(h)[0]
    h.float().square().sum().backward()
    # the same computation with the rows kept per layer in ordinary tensors (torch transport)
    from ray_moe.comm.torch_a2a import TorchA2ATransport

    ref_t = TorchA2ATransport(worker.rank_info.rank, worker.rank_info.world_size)
    ref_layers = [_layer(worker, 3, i) for i in range(4)]
    for lr in ref_layers:
        lr.transport = ref_t
    x2 = x.detach().clone().requires_grad_()
    h2 = x2
    for layer in ref_layers:
        h2 = h2 + layer(h2)[0]
    h2.float().square().sum().backward()
    del LocalTransport
    worker.transport.check()
    out = {"out": rel_err(h, h2), "grad_x": rel_err(x.grad, x2.grad)}
    for i, (a, b) in enumerate(zip(layers, ref_layers)):
        out[f"w13_{i}"] = rel_err(a.w13.grad, b.w13.grad)
        out[f"router_{i}"] = rel_err(a.router.grad, b.router.grad)
    return out


def _graph_vs_eager(worker, **layer_kw) -> dict:
    """``layer_kw``: the impl of the captured and the eager layer (:func:`_layer`)."""
    dev = worker.device
    torch.manual_seed(10 + worker.rank_info.rank)
    layer = _layer(worker, 7, **layer_kw)
    eager = _layer(worker, 7, **layer_kw)
    sx = torch.randn(40, 64, dtype=torch.bfloat16, device=dev, requires_grad=True)
    sg = torch.randn(40, 64, dtype=torch.bfloat16, device=dev)
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
        nx = torch.randn(40, 64, dtype=torch.bfloat16, device=dev)
        ng = torch.randn(40, 64, dtype=torch.bfloat16, device=dev)
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
