"""MixedPrecisionAdamW against torch's AdamW (the oracle) on masters, weight-decay groups, masters."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn

from ray_moe.placement.placement import ExpertShard, expert_shard
from ray_moe.worker.optim import MixedPrecisionAdamW, no_weight_decay

HYPER = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Tiny(nn.Module):
    """Every kind of tensor the decay rule must sort: embedding, bare positional table, norm,
    biased linear, an expert-sharded 3-D weight, and an LM head tied to the embedding."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tok_emb = nn.Embedding(11, 6)
        self.pos_emb = nn.Parameter(torch.randn(5, 6, generator=g))
        self.norm = nn.RMSNorm(6)
        self.proj = nn.Linear(6, 6, bias=True)
        self.experts = nn.Parameter(torch.randn(2, 6, 4, generator=g))
        self.experts.expert_shard = ExpertShard((2, 3))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.tok_emb.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.to(dtype)


def _set_grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _reference(model: nn.Module) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    """float32 copies of the parameters and torch's one-tensor-at-a-time AdamW over them, with the
    decay groups written out by hand."""
    exempt = {"tok_emb.weight", "pos_emb", "norm.weight", "proj.bias"}
    copies = [p.detach().float().clone() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    groups = [{"params": [c for n, c in zip(names, copies, strict=True) if n not in exempt]},
              {"params": [c for n, c in zip(names, copies, strict=True) if n in exempt], "weight_decay": 0.0}]
    return copies, torch.optim.AdamW(groups, foreach=False, **HYPER)


def test_no_weight_decay_by_rank_module_type_and_name():
    assert no_weight_decay(Tiny()) == {"tok_emb.weight", "pos_emb", "norm.weight", "proj.bias"}


@pytest.mark.parametrize("impl", ["fused", "foreach", "for_loop"])
def test_fp32_step_equals_torch_adamw_and_masters_are_the_parameters(impl):
    model = Tiny()
    opt = MixedPrecisionAdamW(model, impl=impl, **HYPER)
    assert all(m is p for m, p in zip(opt.masters, model.parameters(), strict=True))
    copies, ref = _reference(model)
    for step, clip in enumerate((1.0, 0.25, 1.0)):
        _set_grads(model, step)
        opt.gather_grads()
        for c, p in zip(copies, model.parameters(), strict=True):
            c.grad = p.grad.clone() * clip
        opt.step(lr=HYPER["lr"] / (step + 1), clip_coef=clip)
        for group in ref.param_groups:
            group["lr"] = HYPER["lr"] / (step + 1)
        ref.step()
    for (name, p), c in zip(model.named_parameters(), copies, strict=True):
        torch.testing.assert_close(p, c, rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[c]["exp_avg_sq"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("impl", ["onepass", "fused", "foreach"])
def test_bf16_masters_follow_fp32_adamw_and_round_into_the_parameters(impl):
    model = Tiny(torch.bfloat16)
    opt = MixedPrecisionAdamW(model, impl=impl, **HYPER)
    copies, ref = _reference(model)
    for m, p in zip(opt.masters, model.parameters(), strict=True):
        assert m is not p and m.dtype == torch.float32 and torch.equal(m, p.float())
    assert expert_shard(opt.master(model.experts)) == ExpertShard((2, 3))
    for step, clip in enumerate((1.0, 0.25, 0.5)):  # Adam is nearly invariant to a constant scale
        _set_grads(model, step)
        for c, p in zip(copies, model.parameters(), strict=True):
            c.grad = p.grad.float() * clip
        opt.gather_grads()
        # bf16 gradients freed once copied; the one-pass kernel reads the expert weights' own
        kept = [n for n, p in model.named_parameters() if p.grad is not None]
        assert kept == (["experts"] if impl == "onepass" else [])
        opt.step(lr=HYPER["lr"], clip_coef=clip)
        assert all(p.grad is None for p in model.parameters())
        assert all(m.grad is None for m in opt.masters)  # and the float32 ones after the update
        ref.step()
    for (name, p), m, c in zip(model.named_parameters(), opt.masters, copies, strict=True):
        assert p.dtype == torch.bfloat16 and opt.state[m]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(m, c, rtol=1e-6, atol=1e-6, msg=name)
        assert torch.equal(p, m.to(torch.bfloat16)), name
        assert not torch.equal(m, p.float()), name  # the masters keep what bf16 cannot hold


def test_one_rank_reads_every_bf16_gradient_as_it_is_with_bf16_moments():
    """``alone`` (one rank: no replicated gradient is all-reduced) with bf16 moments and the one-pass
    update: every bf16 parameter's gradient stays bf16, read by the update with no float32 copy,
    and the masters, moments and parameters come out exactly as through the copies; so with
    float32 moments, every parameter then going through the one-pass kernel too."""
    runs = {}
    for alone in (False, True):
        model = Tiny(torch.bfloat16)
        opt = MixedPrecisionAdamW(model, impl="onepass", state_dtype="bfloat16", alone=alone, **HYPER)
        for step in range(1, 4):
            _set_grads(model, step)
            opt.gather_grads()
            kept = sorted(n for n, p in model.named_parameters() if p.grad is not None)
            assert kept == (sorted(n for n, _ in model.named_parameters()) if alone else ["experts"]), kept
            assert all(opt.grad(p).dtype == (torch.bfloat16 if alone else torch.float32)
                       for n, p in model.named_parameters() if n != "experts")
            opt.step(lr=HYPER["lr"], clip_coef=0.5)
            assert all(p.grad is None for p in model.parameters()) and all(m.grad is None for m in opt.masters)
        runs[alone] = [t.clone() for m in opt.masters for t in (m, opt.state[m]["exp_avg"], opt.state[m]["exp_avg_sq"])]
        runs[alone] += [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))
    for alone in (False, True):
        model = Tiny(torch.bfloat16)
        fp32 = MixedPrecisionAdamW(model, impl="onepass", alone=alone, **HYPER)
        assert len(fp32._one_pass) == len(fp32.masters) and not fp32.inner.param_groups
        _set_grads(model, 1)
        fp32.gather_grads()
        kept = sorted(n for n, p in model.named_parameters() if p.grad is not None)
        assert kept == (sorted(n for n, _ in model.named_parameters()) if alone else ["experts"])


def test_small_updates_survive_in_masters_and_are_lost_in_pure_bf16():
    """An update of 1e-4 on weights near 1 is below half a bf16 ulp (2^-8): pure bf16 AdamW drops
    it every step; the masters accumulate it and the parameters move once it adds up."""
    moved = {}
    for master_weights in (True, False):
        model = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            model.weight.fill_(1.0)
        opt = MixedPrecisionAdamW(model, lr=1e-4, weight_decay=0.0, impl="foreach", master_weights=master_weights)
        for _ in range(50):
            model.weight.grad = torch.ones_like(model.weight)
            opt.gather_grads()
            opt.step(lr=1e-4)
        moved[master_weights] = float(1.0 - model.weight.detach().float().mean())
    assert moved[False] == 0.0
    assert 0.003 < moved[True] < 0.006  # ≈ 50 · 1e-4, rounded to bf16 steps of 2^-8


def test_gather_grads_fills_missing_gradients_with_zeros():
    model = Tiny(torch.bfloat16)
    opt = MixedPrecisionAdamW(model, **HYPER)
    opt.gather_grads()
    assert all(torch.count_nonzero(opt.grad(p)) == 0 for p in model.parameters())


def _bf16_moment_reference(model: nn.Module, steps: int, clip: float) -> list[torch.Tensor]:
    """float32 masters updated by hand-written AdamW whose moments are rounded to bf16 after every
    update (computed in float32 from the rounded ones): what bf16 moments must give."""
    exempt = {"tok_emb.weight", "pos_emb", "norm.weight", "proj.bias"}
    masters = [p.detach().float().clone() for p in model.parameters()]
    moments = [(torch.zeros_like(m, dtype=torch.bfloat16), torch.zeros_like(m, dtype=torch.bfloat16)) for m in masters]
    lr, (b1, b2), eps = HYPER["lr"], HYPER["betas"], HYPER["eps"]
    for step in range(1, steps + 1):
        _set_grads(model, step)
        for (name, p), m, (ea, eas) in zip(model.named_parameters(), masters, moments, strict=True):
            g = p.grad.float() * clip
            decay = 0.0 if name in exempt else HYPER["weight_decay"]
            mu = ea.float().mul_(b1).add_(g, alpha=1 - b1)  # (torch's AdamW's operations: same roundings)
            nu = eas.float().mul_(b2).addcmul_(g, g, value=1 - b2)
            # (AdamW's bias corrections in the order torch's foreach AdamW applies them)
            m.mul_(1 - lr * decay).sub_(lr / (1 - b1 ** step) * mu / (nu.sqrt() / math.sqrt(1 - b2 ** step) + eps))
            ea.copy_(mu)
            eas.copy_(nu)
    return masters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["foreach", "fused", "onepass"])
def test_bf16_moments_are_stored_in_bf16_and_computed_in_fp32(impl, dtype):
    """``state_dtype='bfloat16'``: every parameter's moments are bf16 tensors, the masters stay
    float32 and follow AdamW computed in float32 from the rounded moments (any impl: all of them
    go through the one-pass update, on the CPU its torch reference)."""
    model = Tiny(dtype)
    opt = MixedPrecisionAdamW(model, impl=impl, state_dtype="bfloat16", **HYPER)
    expected = _bf16_moment_reference(Tiny(dtype), 3, 0.5)
    for step in range(1, 4):
        _set_grads(model, step)
        opt.gather_grads()
        opt.step(lr=HYPER["lr"], clip_coef=0.5)
        assert all(m.grad is None for m in opt.masters if m.dtype != dtype)
    for (name, p), m, e in zip(model.named_parameters(), opt.masters, expected, strict=True):
        assert m.dtype == torch.float32
        assert opt.state[m]["exp_avg"].dtype == opt.state[m]["exp_avg_sq"].dtype == torch.bfloat16, name
        torch.testing.assert_close(m, e, rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(p, m.to(dtype)), name
    # float32 moments give other masters: the comparison above can tell the two apart
    other = Tiny(dtype)
    fp32 = MixedPrecisionAdamW(other, impl=impl, **HYPER)
    for step in range(1, 4):
        _set_grads(other, step)
        fp32.gather_grads()
        fp32.step(lr=HYPER["lr"], clip_coef=0.5)
    assert not torch.equal(fp32.master(other.proj.weight), opt.master(model.proj.weight))


def test_bf16_moments_survive_a_reload_through_the_state_dict_shape_of_a_checkpoint():
    """loaded() puts float32 moments (an old checkpoint) into bf16 storage and the step on the host."""
    model = Tiny(torch.bfloat16)
    opt = MixedPrecisionAdamW(model, impl="foreach", state_dtype="bfloat16", **HYPER)
    for m in opt.masters:
        opt.state[m] = {"exp_avg": torch.ones_like(m), "exp_avg_sq": torch.ones_like(m), "step": torch.tensor(4.0)}
    opt.loaded()
    for m in opt.masters:
        assert opt.state[m]["exp_avg"].dtype == torch.bfloat16 and opt.state[m]["step"].device.type == "cpu"
    _set_grads(model, 0)
    opt.gather_grads()
    opt.step(lr=HYPER["lr"])
    assert all(int(opt.state[m]["step"]) == 5 for m in opt.masters)


def test_bf16_moments_need_float32_masters_and_a_known_dtype():
    with pytest.raises(ValueError, match="needs float32 masters"):
        MixedPrecisionAdamW(Tiny(torch.bfloat16), master_weights=False, state_dtype="bfloat16", **HYPER)
    with pytest.raises(ValueError, match="train.optimizer_state_dtype='fp8'"):
        MixedPrecisionAdamW(Tiny(), state_dtype="fp8", **HYPER)


def test_unknown_impl_is_named():
    with pytest.raises(ValueError, match="train.optimizer_impl='adam'"):
        MixedPrecisionAdamW(Tiny(), impl="adam", **HYPER)


_ONE_PASS_SCRIPT = """
import torch
from ray_moe.worker.adamw_kernel import adamw_step, adamw_step_reference
g = torch.Generator().manual_seed(0)
cases = ((1, torch.bfloat16, 1, torch.float32), (4099, torch.bfloat16, 7, torch.float32),
         (300, torch.float32, 2, torch.float32), (4099, torch.bfloat16, 7, torch.bfloat16),
         (5, torch.float32, 1, torch.bfloat16))
for n, gdtype, step, sdtype in cases:
    grad = torch.randn(n, generator=g).to(gdtype)
    state = [torch.randn(n, generator=g), (torch.randn(n, generator=g) * 0.1).to(sdtype),
             torch.rand(n, generator=g).to(sdtype)]
    ref = [t.clone() for t in state]
    p, p_ref = torch.empty(n, dtype=gdtype), torch.empty(n, dtype=gdtype)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step, grad_scale=0.5)
    adamw_step(grad, *state, p, block=1024, **kw)
    adamw_step_reference(grad, *ref, p_ref, **kw)
    torch.testing.assert_close(state[0], ref[0], rtol=2e-6, atol=1e-7)
    for a, b in zip(state[1:], ref[1:]):  # bf16 moments: one rounding apart at most
        assert a.dtype == sdtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-6 if sdtype == torch.float32 else 2 ** -7, atol=1e-7)
    # the parameter is the rounded master (the interpreter may round fp32 -> bf16 differently
    # from the GPU's round-to-nearest by one ulp; the GPU test checks it exactly)
    torch.testing.assert_close(p.float(), state[0].to(gdtype).float(), rtol=2 ** -7, atol=1e-7)
print("adamw kernel ok")
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _ONE_PASS_SCRIPT)
def test_one_pass_kernel_equals_its_reference_under_the_interpreter(interpreter_scripts):
    """The Triton kernel of the one-pass update (run by Triton's interpreter on the CPU) equals
    the torch reference, for bf16 and float32 gradients, float32 and bf16 moments, clipping,
    decay, odd sizes."""
    pytest.importorskip("triton")
    r = interpreter_scripts.result(sys.executable, "-c", _ONE_PASS_SCRIPT)
    assert "adamw kernel ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("rounded", [False, True])
def test_expert_weights_with_clone_slots_read_in_bf16_only_where_clone_sums_are_rounded(rounded):
    """An expert weight with a clone slot (one native expert, two slots) keeps the float32 gradient
    copy (its clone's gradient is added onto the owner in float32), unless the clone sums are
    rounded into the bf16 gradient (``parallel.grad_reduce_dtype: bfloat16``): then the one-pass
    update reads it as it is, and the update equals the one through the float32 copy of the same
    bf16 gradient."""
    out = {}
    for flag in (False, rounded):
        model = Tiny(torch.bfloat16)
        model.experts.expert_shard = ExpertShard((2,))  # slot 0 native, slot 1 a clone
        opt = MixedPrecisionAdamW(model, impl="onepass", rounded_clone_sums=flag, **HYPER)
        assert (id(model.experts) in opt._one_pass_ids) == flag
        _set_grads(model, 1)
        opt.gather_grads()
        assert opt.grad(model.experts).dtype == (torch.bfloat16 if flag else torch.float32)
        opt.step(lr=HYPER["lr"])
        out[flag] = model.experts.detach().clone()
    assert torch.equal(out[False], out[rounded])


@pytest.mark.parametrize("impl,rounded", [("onepass", False), ("onepass", True), ("foreach", False)])
def test_clone_slots_hold_no_master_or_moments(impl, rounded):
    """An expert weight with two native slots and one clone slot: its master and moments cover the
    native slots only (a checkpoint saves those), the update moves the native slots exactly as it
    moves the same weight without the clone slot, and leaves the clone slot to the owners' push."""
    g = torch.Generator().manual_seed(3)
    native = torch.randn(2, 6, 4, generator=g).to(torch.bfloat16)
    grads = [torch.randn(3, 6, 4, generator=g).to(torch.bfloat16) for _ in range(3)]
    out = {}
    for slots in (2, 3):
        model = nn.Module()
        model.experts = nn.Parameter(torch.cat([native, torch.full((slots - 2, 6, 4), 7.0, dtype=torch.bfloat16)]))
        model.experts.expert_shard = ExpertShard((4, 5))
        opt = MixedPrecisionAdamW(model, impl=impl, rounded_clone_sums=rounded, **HYPER)
        m = opt.master(model.experts)
        assert m.shape == (2, 6, 4) and expert_shard(m) == ExpertShard((4, 5))
        for grad in grads:
            model.experts.grad = grad[:slots].clone()
            opt.gather_grads()
            assert opt.grad(model.experts).shape[0] == (slots if id(model.experts) in opt._one_pass_ids else 2)
            opt.step(lr=HYPER["lr"], clip_coef=0.5)
        assert opt.state[m]["exp_avg"].shape == (2, 6, 4)
        if slots == 3:
            assert bool((model.experts[2] == 7.0).all())  # the clone slot: the owners' push writes it
        out[slots] = (model.experts.detach()[:2].clone(), m.clone(), opt.state[m]["exp_avg_sq"].clone())
    for a, b in zip(out[2], out[3], strict=True):
        assert torch.equal(a, b)
