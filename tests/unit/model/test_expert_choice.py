"""The per-shape expert implementation choice (ray_moe.model.expert_choice), on CPU (the GPU
tests time the real candidates)."""

from __future__ import annotations

import pytest
import torch

from ray_moe.model.expert_choice import DEFAULT, ExpertChoice, ExpertImplChooser
from tests.kernel_cases import random_case


def _case(R=12, seed=0):
    c = random_case(R, 2, 4, 16, 8, "random", torch.float32, "cpu", seed=seed)
    return c["x"], c["slot"], c["weight"], c["w13"], c["w2"]


class FakeTimer:
    """Runs each candidate once (so a broken one fails for real) and returns preset times."""

    def __init__(self, ms):
        self.ms, self.calls = ms, []

    def __call__(self, fn, name):
        fn()
        self.calls.append(name)
        return self.ms[name]


def test_chooser_keeps_the_fastest_working_candidate_per_shape():
    cands = (ExpertChoice("loop"), ExpertChoice("grouped_mm"), ExpertChoice("no_such_impl"))
    timer = FakeTimer({"loop": 2.0, "grouped_mm": 1.0, "no_such_impl": 0.1})
    ch = ExpertImplChooser(candidates=cands, timer=timer)
    x, slot, weight, w13, w2 = _case()
    assert ch.choose(x, slot, weight, w13, w2, needs_grad=True) == ExpertChoice("grouped_mm")
    (timings,) = ch.timings.values()
    assert timings["loop"] == 2.0 and timings["grouped_mm"] == 1.0
    assert "no_such_impl" in timings["no_such_impl"]  # the error that ruled it out, not a time
    # three interleaved rounds; the failed candidate is tried once
    assert timer.calls == ["loop", "grouped_mm"] * 3
    # same shape: remembered, nothing re-measured; a new shape is measured again
    assert ch.choose(*_case(seed=1), needs_grad=True).impl == "grouped_mm"
    assert len(timer.calls) == 6
    ch.choose(*_case(R=20), needs_grad=True)
    assert len(timer.calls) == 12 and len(ch.choices) == 2


def test_chooser_keeps_each_candidates_median_over_interleaved_rounds():
    """A clock that drifts (a GPU slowing at its power cap) must not decide: one slow sample of the
    faster candidate loses to its median."""
    seq = {"loop": iter([5.0, 1.0, 1.1]), "grouped_mm": iter([2.0, 2.1, 1.9])}
    calls = []

    def timer(fn, name):
        calls.append(name)
        return next(seq[name])

    ch = ExpertImplChooser(candidates=(ExpertChoice("loop"), ExpertChoice("grouped_mm")), timer=timer, rounds=3)
    assert ch.choose(*_case(), needs_grad=False) == ExpertChoice("loop")
    assert calls == ["loop", "grouped_mm"] * 3
    (timings,) = ch.timings.values()
    assert timings == {"loop": 1.1, "grouped_mm": 2.0}
    with pytest.raises(ValueError, match="rounds"):
        ExpertImplChooser(rounds=0)


def test_chooser_buckets_rows_leaves_weights_alone_and_survives_any_error():
    class Boom(Exception):
        pass

    def timer(fn, name):
        fn()
        if name == "grouped_mm":
            raise Boom("compile failed")  # not a RuntimeError: still only rules the candidate out
        return 1.0

    ch = ExpertImplChooser(candidates=(ExpertChoice("loop"), ExpertChoice("grouped_mm")), timer=timer)
    x, slot, weight, w13, w2 = _case(R=12)
    before = w13.clone()
    assert ch.choose(x, slot, weight, w13, w2, needs_grad=True) == ExpertChoice("loop")
    (timings,) = ch.timings.values()
    assert timings["grouped_mm"].startswith("Boom: compile failed")
    assert torch.equal(w13, before) and w13.grad is None and not w13.requires_grad
    # NCCL-style transports receive a different row count every step: one power-of-two bucket
    for R in (9, 13, 16):
        ch.choose(*_case(R=R), needs_grad=True)
    assert len(ch.choices) == 1
    ch.choose(*_case(R=17), needs_grad=True)
    assert len(ch.choices) == 2


def test_chooser_falls_back_to_the_default_when_nothing_runs():
    ch = ExpertImplChooser(candidates=(ExpertChoice("no_such_impl"),), timer=FakeTimer({"no_such_impl": 1.0}))
    assert ch.choose(*_case(), needs_grad=False) == DEFAULT


def test_expert_ffn_rejects_an_unknown_wgrad_backend():
    from ray_moe.model.experts import expert_ffn

    x, slot, weight, w13, w2 = _case()
    with pytest.raises(ValueError, match="wgrad 'cublas' is not one of triton, grouped_mm, quack"):
        expert_ffn(x, slot, weight, w13, w2, impl="loop", wgrad="cublas")


def test_candidate_names_and_quack_measured_only_where_installed(monkeypatch):
    from ray_moe.kernels import quack_wgrad
    from ray_moe.model import expert_choice as ec

    assert [c.name for c in ec.CANDIDATES] == ["triton", "triton+mm_wgrad", "grouped_mm"]
    assert ec.QUACK_WGRAD.name == "triton+quack_wgrad"
    monkeypatch.setattr(quack_wgrad, "quack_available", lambda: False)
    assert ec.default_candidates() == ec.CANDIDATES
    assert ExpertImplChooser().candidates == ec.CANDIDATES
    monkeypatch.setattr(quack_wgrad, "quack_available", lambda: True)
    assert ec.default_candidates() == ec.CANDIDATES + (ec.QUACK_WGRAD,)
    assert ExpertImplChooser().candidates == ec.CANDIDATES + (ec.QUACK_WGRAD,)


def test_chooser_measures_inside_an_activation_checkpointed_block():
    """The first forward of a checkpointed block measures (a nested forward+backward); its saved
    tensors must not go through the checkpoint's hooks, or the nested backward replays the block
    (seen on the GPU: the replay's context manager entered twice)."""
    from ray_moe.model.experts import expert_ffn
    from ray_moe.model.recompute import checkpointed

    x, slot, weight, w13, w2 = _case()
    leaves = [t.clone().requires_grad_() for t in (x, weight, w13, w2)]
    timer = FakeTimer({"triton": 3.0, "triton+mm_wgrad": 2.0, "grouped_mm": 1.0})
    chooser = ExpertImplChooser(candidates=(ExpertChoice("grouped_mm"),), timer=timer)

    def block(x, weight, w13, w2):
        choice = chooser.choose(x, slot, weight, w13, w2, needs_grad=True)
        return expert_ffn(x, slot, weight, w13, w2, impl="loop" if choice.impl == "grouped_mm" else choice.impl)

    out = checkpointed(block, *leaves)
    out.square().sum().backward()
    assert timer.calls == ["grouped_mm"] * chooser.rounds  # in the first forward, not in the replay
    ref = [t.clone().requires_grad_() for t in (x, weight, w13, w2)]
    expert_ffn(ref[0], slot, ref[1], ref[2], ref[3], impl="loop").square().sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad)


def test_chooser_times_the_candidates_with_the_layers_biases_and_activation(monkeypatch):
    """Experts with biases and gpt-oss's clamped activation are measured with them (another
    epilogue, other timings) and under their own key: plain experts of the same shape measure anew."""
    import ray_moe.model.experts as experts
    from ray_moe.model.experts import ExpertActivation

    seen = []
    real = experts.expert_ffn

    def recording(*args, **kw):
        seen.append((kw.get("act"), kw.get("b13") is not None and kw.get("b2") is not None))
        return real(*args, **kw)

    monkeypatch.setattr(experts, "expert_ffn", recording)
    c = random_case(12, 2, 4, 16, 8, "random", torch.float32, "cpu", seed=0, biases=True)
    act = ExpertActivation("clamped_swiglu", 1.702, 1.0)
    timer = FakeTimer({"loop": 1.0, "grouped_mm": 2.0})
    ch = ExpertImplChooser(candidates=(ExpertChoice("loop"), ExpertChoice("grouped_mm")), timer=timer, rounds=1)
    args = (c["x"], c["slot"], c["weight"], c["w13"], c["w2"])
    assert ch.choose(*args, needs_grad=True, act=act, b13=c["b13"], b2=c["b2"]) == ExpertChoice("loop")
    assert seen == [(act, True)] * 2
    ch.choose(*args, needs_grad=True)
    assert len(ch.choices) == 2 and seen[2:] == [(experts.SWIGLU, False)] * 2
