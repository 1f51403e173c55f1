"""The pipelined exchange on one process: chunking, the issue order, equality with the sequential
layer (forward, backward, load statistics, no-grad, frozen weights, activation checkpointing), and
the NVSHMEM buffer's host side (per-call capacity, launch cache) with the real kernels under
Triton's interpreter at W=1. The multi-rank equality runs on gloo: tests/cluster/test_layer_parity.py."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm import pipeline
from ray_moe.comm.local import LocalTransport
from ray_moe.chunks import chunk_capacities, chunk_weights, token_chunks
from ray_moe.model.moe import MoELayer, MoELayerSpec
from ray_moe.validation.errors import rel_err

TOL = 1e-6


def test_token_chunks_cover_every_token_once_in_aligned_chunks():
    for T in (0, 1, 3, 5, 16, 33, 130):
        for C in (1, 2, 3, 4, 8):
            b = token_chunks(T, C)
            assert len(b) == C and b[0][0] == 0 and b[-1][1] == T
            assert all(t0 <= t1 and (t0 % 4 == 0 or t0 == T) for t0, t1 in b)
            assert all(b[i][1] == b[i + 1][0] for i in range(C - 1))
            assert max(t1 - t0 for t0, t1 in b) <= chunk_capacities(T, C)[0] <= chunk_capacities(T + 1, C)[0]
    assert token_chunks(5, 8) == [(0, 4), (4, 5)] + [(5, 5)] * 6  # T < C: empty chunks still run


@pytest.mark.parametrize("weights", [(1, 6, 1), (2, 1), (1, 3, 3, 1), (5,), (1, 1, 1)])
def test_weighted_chunks_cover_every_token_within_their_capacities(weights):
    """Chunks of relative sizes: in order, aligned, the sizes roughly proportional, and never
    above the capacity computed from any larger token count (every rank sizes its dispatches
    from BufferSpec.max_tokens, not from its own tokens)."""
    caps = chunk_capacities(260, weights)
    for T in range(0, 261):
        b = token_chunks(T, weights)
        assert len(b) == len(weights) and b[0][0] == 0 and b[-1][1] == T
        assert all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
        assert all(t0 <= t1 and (t0 % 4 == 0 or t0 == T) for t0, t1 in b)
        assert all(t1 - t0 <= cap for (t0, t1), cap in zip(b, caps)), (T, b, caps)
    b = token_chunks(256, weights)
    for (t0, t1), w in zip(b, weights):
        assert abs((t1 - t0) - 256 * w / sum(weights)) <= 4 * len(weights)
    assert token_chunks(256, (1, 6, 1)) == [(0, 32), (32, 224), (224, 256)]
    assert token_chunks(97, (1,) * 3) == token_chunks(97, 3)  # equal weights: the equal split


@pytest.mark.parametrize("bad", [0, -1, True, (), (1, 0), [2, "x"], 1.5])
def test_chunk_weights_name_what_is_allowed(bad):
    with pytest.raises(ValueError, match="pipeline_chunks must be an integer >= 1 or a list of positive integers"):
        chunk_weights(bad)


def test_schedule_issues_the_next_dispatch_before_the_combine():
    order = []
    out = pipeline._schedule(
        4, lambda i: order.append(f"D{i}") or (i,), lambda i, s: order.append(f"E{i}") or s,
        lambda i, w: order.append(f"C{i}") or w, side=None)
    assert order == "D0 D1 E0 C0 D2 E1 C1 D3 E2 C2 E3 C3".split()
    assert out == [(0,), (1,), (2,), (3,)]


def test_schedule_puts_communication_on_the_side_stream_behind_events(monkeypatch):
    """The GPU issue path with stand-in streams and events: sends and backs on the side stream,
    work on the current one, each stage waits for the event recorded after the stage it
    consumes, the side stream first waits for the current one and is joined at the end."""
    import contextlib

    log, current = [], []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

        def wait_event(self, ev):
            log.append(f"{self.name} waits {ev.name}")

    class Event:
        def record(self, stream):
            assert stream is current[-1]
            self.name = f"ev({log[-1]})"

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    main, side = Stream("main"), Stream("side")
    current.append(main)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)

    def stage(name):
        return lambda i, *a: log.append(f"{name}{i}@{current[-1].name}") or (i,)

    pipeline._schedule(3, stage("D"), stage("E"), stage("C"), side)
    assert log == ["side waits main", "D0@side", "D1@side",
                   "main waits ev(D0@side)", "E0@main", "side waits ev(E0@main)", "C0@side",
                   "D2@side", "main waits ev(D1@side)", "E1@main", "side waits ev(E1@main)", "C1@side",
                   "main waits ev(D2@side)", "E2@main", "side waits ev(E2@main)", "C2@side",
                   "main waits side"]


def _run(layer, x, go):
    out, aux = layer(x)
    out.backward(go)
    return {"out": out.detach(), "grad_x": x.grad, "grad_router": layer.router.grad,
            "grad_w13": layer.w13.grad, "grad_w2": layer.w2.grad,
            "pairs": layer.received_pairs.clone(), "tokens": layer.expert_tokens.clone()}


@pytest.mark.parametrize("T,C,E,K", [(16, 2, 4, 2), (10, 4, 4, 1), (5, 8, 4, 4), (0, 3, 4, 2), (33, 3, 8, 8),
                                     (37, (1, 6, 1), 4, 2), (6, (1, 3, 3, 1), 8, 3)],
                         ids=["even", "uneven-K1", "T<C-K=E", "empty", "K=E", "weighted", "weighted-T-small"])
def test_pipelined_layer_equals_the_sequential_layer(T, C, E, K):
    res = []
    for chunks in (1, C):
        layer = MoELayer(MoELayerSpec(16, E, K, 8, seed=3, pipeline_chunks=chunks, clone_slots=1), LocalTransport())
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, 16, generator=g).requires_grad_()
        res.append(_run(layer, x, torch.randn(T, 16, generator=g)))
    for name, ref in res[0].items():
        # top-1 renormalised weights are identically 1: the router gradient is round-off (~1e-8)
        floor = 1.0 if (name == "grad_router" and K == 1) else 0.0
        assert rel_err(res[1][name], ref, floor=floor) <= TOL, (name, rel_err(res[1][name], ref))


def test_pipelined_layer_with_tokens_that_need_no_gradient():
    """The benchmark's case: x is data (no gradient); the router and the experts still get theirs."""
    res = []
    for chunks in (1, 3):
        layer = MoELayer(MoELayerSpec(16, 4, 2, 8, seed=2, pipeline_chunks=chunks), LocalTransport())
        x = torch.randn(11, 16, generator=torch.Generator().manual_seed(3))
        layer(x)[0].square().sum().backward()
        res.append((layer.router.grad, layer.w13.grad, layer.w2.grad))
    for a, b in zip(*res):
        assert rel_err(b, a) <= TOL


def test_pipelined_layer_without_grad_and_with_frozen_experts():
    ref = MoELayer(MoELayerSpec(16, 4, 2, 8, seed=1), LocalTransport())
    pip = MoELayer(MoELayerSpec(16, 4, 2, 8, seed=1, pipeline_chunks=3), LocalTransport())
    x = torch.randn(13, 16)
    with torch.no_grad():
        assert rel_err(pip(x)[0], ref(x)[0]) <= TOL
    for layer in (ref, pip):
        layer.w13.requires_grad_(False)
        layer.w2.requires_grad_(False)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for layer, xi in zip((ref, pip), xs):
        layer(xi)[0].square().sum().backward()
    assert rel_err(xs[1].grad, xs[0].grad) <= TOL and rel_err(pip.router.grad, ref.router.grad) <= TOL
    assert pip.w13.grad is None


@pytest.mark.parametrize("mode", ["none", "moe"])
def test_pipelined_model_with_activation_checkpointing(tmp_path, mode):
    """A byte model with the pipelined layer (and its MoE FFNs recomputed in backward) has the
    sequential model's gradients and counts each token's load once."""
    from tests.support import build, small_config

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    grads, counts = [], []
    for chunks in (1, 3):
        cfg = small_config(tmp_path, world_size=1, **{"moe.pipeline_chunks": chunks,
                                                      "model.activation_checkpointing": mode})
        model = build(cfg, LocalTransport())
        h, _ = model.hidden_states(ids)
        h.float().square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        counts.append(torch.stack([m.expert_tokens.clone() for m in model.moe_layers()]))
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert rel_err(grads[1][name], g) <= 1e-5, name
    assert torch.equal(counts[0], counts[1])
