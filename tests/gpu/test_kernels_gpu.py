"""GPU checks of the Triton expert kernels: bf16 kernels vs float64 references, fresh random
inputs, odd shapes, empty experts, and CUDA-graph capture/replay. Run on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from ray_moe.device import capture_graph
from ray_moe.validation import rel_err
from tests.kernel_cases import check_expert_ffn, random_case

pytestmark = pytest.mark.gpu

TOL = 1e-2


@pytest.fixture(autouse=True)
def _poison_allocator():
    """Fill the caching allocator's free memory with NaN so that a read of an unwritten row
    shows up as NaN instead of stale finite data."""
    if torch.cuda.is_available():
        junk = torch.full((1 << 27,), float("nan"), device="cuda")
        del junk
    yield


CASES = [
    # R, K, S, H, I, pattern
    (512, 4, 8, 1024, 384, "random"),  # multiples of the block sizes, one empty slot
    (300, 8, 16, 200, 72, "random"),  # H, I not multiples of any block size
    (1, 2, 4, 256, 128, "random"),  # a single token
    (16, 2, 64, 128, 96, "sparse"),  # experts with 0 or 1 pair
    (257, 2, 4, 320, 160, "all_one_expert"),
    (333, 1, 8, 512, 256, "random"),  # K = 1
]


@pytest.mark.parametrize("R,K,S,H,I,pattern", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_expert_ffn_bf16_matches_reference(R, K, S, H, I, pattern, seed):
    errs = check_expert_ffn(random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", seed), seed=seed + 7)
    for name in ("out", "dx", "dweight", "dw13", "dw2"):
        assert errs[name] <= TOL, f"{name}: relative error {errs[name]:.3g} > {TOL} ({errs})"
    assert errs["empty_slot_grad"] == 0.0, errs


@pytest.mark.parametrize("dual_wgrad13", [False, True])
def test_expert_ffn_bf16_both_wgrad13_variants(dual_wgrad13):
    import dataclasses

    from ray_moe.kernels.grouped_swiglu import default_plan

    plan = dataclasses.replace(default_plan(torch.bfloat16, torch.device("cuda")), dual_wgrad13=dual_wgrad13)
    errs = check_expert_ffn(random_case(700, 4, 8, 1024, 384, "random", torch.bfloat16, "cuda", 5), plan=plan)
    for name in ("out", "dx", "dweight", "dw13", "dw2"):
        assert errs[name] <= TOL, f"{name}: relative error {errs[name]:.3g} > {TOL} ({errs})"


def _variant_plan(variant: str):
    """The default bf16 plan with every GEMM as the pointer kernel, the TMA kernel (grid), the
    TMA kernel persistent, or persistent with the flattened loop; ``one_dot``: the pointer kernels
    with the up-projection's gate and up columns in one dot (GemmConfig.one_dot)."""
    import dataclasses

    from ray_moe.kernels.grouped_swiglu import default_plan

    plan = default_plan(torch.bfloat16, torch.device("cuda"))
    flags = {"pointer": dict(tma=False, persistent=False, flatten=False),
             "one_dot": dict(tma=False, persistent=False, flatten=False),
             "tma": dict(tma=True, persistent=False, flatten=False),
             "tma_persistent": dict(tma=True, persistent=True, flatten=False),
             "tma_persistent_flat": dict(tma=True, persistent=True, flatten=True)}[variant]
    roles = ("gate_up", "down", "dact", "dx", "wgrad13", "wgrad2")
    # one_dot only where asked (the Hopper default's up-projection has it: the other variants test the two dots)
    plan = dataclasses.replace(plan, **{r: dataclasses.replace(getattr(plan, r), **flags, one_dot=variant == "one_dot")
                                        for r in roles})
    return plan


@pytest.mark.parametrize("variant", ["pointer", "tma", "tma_persistent", "tma_persistent_flat", "one_dot"])
@pytest.mark.parametrize("R,K,S,H,I,pattern", [CASES[0], CASES[1], CASES[3], CASES[4], (2048, 8, 64, 512, 256, "random")])
def test_expert_ffn_bf16_kernel_variants(variant, R, K, S, H, I, pattern):
    """Pointer and Hopper (TMA, persistent) kernels, each on shapes where the descriptors apply and
    where they fall back (H, I not multiples of the tiles), empty slots, 0/1-pair slots."""
    errs = check_expert_ffn(random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", 4), plan=_variant_plan(variant))
    for name in ("out", "dx", "dweight", "dw13", "dw2"):
        assert errs[name] <= TOL, f"{variant} {name}: relative error {errs[name]:.3g} > {TOL} ({errs})"
    assert errs["empty_slot_grad"] == 0.0, errs


def _clamped(limit: float):
    from ray_moe.model.experts import ExpertActivation

    return ExpertActivation("clamped_swiglu", 1.702, limit)


BIAS_GRADS = ("out", "dx", "dweight", "dw13", "dw2", "db13", "db2")


@pytest.mark.parametrize("limit", [1.0, 7.0])  # 1.0: both clamps often active; 7.0: gpt-oss's
@pytest.mark.parametrize("R,K,S,H,I,pattern", [CASES[0], CASES[1], CASES[3], CASES[4], CASES[5]])
def test_expert_ffn_bf16_biases_and_clamp_match_reference(R, K, S, H, I, pattern, limit):
    """gpt-oss's experts (b13, b2, the clamped activation) on the default plan: bf16 vs the float64
    loop path, output and every gradient (biases included); empty experts' gradients exactly 0."""
    case = random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", 2, biases=True)
    errs = check_expert_ffn(case, seed=3, act=_clamped(limit))
    for name in BIAS_GRADS:
        assert errs[name] <= TOL, f"{name}: relative error {errs[name]:.3g} > {TOL} ({errs})"
    assert errs["empty_slot_grad"] == 0.0, errs
    if limit == 1.0:
        assert errs["clamped_share"] > 0.05, errs


@pytest.mark.parametrize("biases,kind", [(True, "swiglu"), (False, "clamped_swiglu")])
def test_expert_ffn_bf16_biases_or_clamp_alone(biases, kind):
    case = random_case(512, 4, 8, 1024, 384, "random", torch.bfloat16, "cuda", 6, biases=biases)
    errs = check_expert_ffn(case, act=_clamped(1.0) if kind == "clamped_swiglu" else None)
    for name in BIAS_GRADS[:5] + (BIAS_GRADS[5:] if biases else ()):
        assert errs[name] <= TOL, f"{name}: relative error {errs[name]:.3g} > {TOL} ({errs})"
    assert errs["empty_slot_grad"] == 0.0, errs


@pytest.mark.parametrize("variant", ["pointer", "tma", "tma_persistent", "tma_persistent_flat", "one_dot"])
@pytest.mark.parametrize("R,K,S,H,I,pattern", [CASES[0], CASES[1], (2048, 8, 64, 512, 256, "random")])
def test_expert_ffn_bf16_biases_and_clamp_kernel_variants(variant, R, K, S, H, I, pattern):
    """The bias and activation epilogues in every kernel form (pointer, TMA grid / persistent /
    flattened, the one-dot up-projection), where the descriptors apply and where they fall back."""
    case = random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", 8, biases=True)
    errs = check_expert_ffn(case, plan=_variant_plan(variant), act=_clamped(1.0))
    for name in BIAS_GRADS:
        assert errs[name] <= TOL, f"{variant} {name}: relative error {errs[name]:.3g} > {TOL} ({errs})"
    assert errs["empty_slot_grad"] == 0.0, errs


def test_cuda_graph_replay_with_biases_and_clamp():
    """Forward+backward with biases and the clamped activation captured once and replayed on new
    values: bit-identical to eager (the bias gradients' per-slot sums use no atomics)."""
    from ray_moe.kernels import expert_ffn_triton

    R, K, S, H, I = 1024, 4, 8, 512, 256
    names = ("x", "weight", "w13", "w2", "b13", "b2")
    static = random_case(R, K, S, H, I, "random", torch.bfloat16, "cuda", 3, biases=True)
    leaves = {n: static[n].clone().requires_grad_() for n in names}
    slot = static["slot"].clone()
    grad_out = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    act = _clamped(1.0)

    def step():
        out = expert_ffn_triton(leaves["x"], slot, leaves["weight"], leaves["w13"], leaves["w2"], act=act,
                                b13=leaves["b13"], b2=leaves["b2"])
        return (out, *torch.autograd.grad(out, list(leaves.values()), grad_out))

    graph, captured = capture_graph(step, warmup=1)
    for seed in (10, 11):
        fresh = random_case(R, K, S, H, I, "random", torch.bfloat16, "cuda", seed, biases=True)
        with torch.no_grad():
            for n, t in leaves.items():
                t.copy_(fresh[n])
            slot.copy_(fresh["slot"])
        graph.replay()
        eager = step()
        for a, b in zip(captured, eager):
            assert torch.equal(a, b)


def test_pair_layout_and_topk_match_references():
    from ray_moe.kernels.routing import (
        pair_layout,
        pair_layout_reference,
        topk_softmax,
        topk_softmax_reference,
    )

    for seed, (R, K, S) in enumerate([(32768, 8, 64), (1000, 3, 7), (1, 1, 1), (5000, 2, 300)]):
        case = random_case(R, K, S, 8, 8, "random", torch.bfloat16, "cuda", seed)
        got, ref = pair_layout(case["slot"], S), pair_layout_reference(case["slot"], S)
        for a, b, name in zip(got, ref, got._fields):
            assert torch.equal(a, b), name
    for T, E, K in [(4096, 64, 8), (100, 128, 4), (7, 6, 1), (33, 16, 3)]:
        logits = torch.randn(T, E, device="cuda", requires_grad=True)
        w, i = topk_softmax(logits, K)
        wr, ir = topk_softmax_reference(logits, K)
        # A valid top-k: every chosen logit >= every other one (ties in any order), and the same
        # weights per chosen expert as the reference (softmax over all E, renormalised).
        chosen = logits.detach().gather(1, i.long())
        rest = logits.detach().scatter(1, i.long(), float("-inf"))
        assert (chosen.min(1).values >= rest.max(1).values).all()
        assert rel_err(w, wr.gather(1, (ir.unsqueeze(2) == i.unsqueeze(1)).float().argmax(1))) < 1e-6
        exact = (chosen.min(1).values - rest.max(1).values) > 1e-5  # rows without a near tie
        assert exact.float().mean() > 0.99 and torch.equal(i[exact], ir[exact])
        g = torch.randn_like(w)
        (a,) = torch.autograd.grad(w, logits, g)
        (b,) = torch.autograd.grad(wr, logits, g.gather(1, (i.unsqueeze(2) == ir.unsqueeze(1)).float().argmax(1)))
        assert (a - b).abs().max().item() < 1e-5


def test_cuda_graph_capture_and_replay():
    from ray_moe.kernels import expert_ffn_triton

    R, K, S, H, I = 1024, 4, 8, 512, 256
    static = random_case(R, K, S, H, I, "random", torch.bfloat16, "cuda", 3)
    leaves = {n: static[n].clone().requires_grad_() for n in ("x", "weight", "w13", "w2")}
    slot = static["slot"].clone()
    grad_out = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)

    def step():
        out = expert_ffn_triton(leaves["x"], slot, leaves["weight"], leaves["w13"], leaves["w2"])
        return (out, *torch.autograd.grad(out, list(leaves.values()), grad_out))

    graph, captured = capture_graph(step, warmup=1)  # compiled and warmed up outside the capture
    for seed in (10, 11):  # new values (slots included) into the static inputs, replay, compare
        fresh = random_case(R, K, S, H, I, "random", torch.bfloat16, "cuda", seed)
        with torch.no_grad():
            for n, t in leaves.items():
                t.copy_(fresh[n])
            slot.copy_(fresh["slot"])
        graph.replay()
        eager = step()
        for a, b in zip(captured, eager):
            assert torch.equal(a, b)


# 16-byte rows (torch._grouped_mm's rule): H and I multiples of 8 in bf16
MM_WGRAD_CASES = [c for c in CASES if c[3] % 8 == 0 and c[4] % 8 == 0]


@pytest.mark.parametrize("R,K,S,H,I,pattern", MM_WGRAD_CASES)
def test_expert_ffn_bf16_grouped_mm_weight_grads(R, K, S, H, I, pattern):
    """The Triton forward with dW13/dW2 through torch._grouped_mm: same gradients, empty slots 0."""
    import dataclasses

    from ray_moe.kernels.grouped_swiglu import default_plan

    plan = dataclasses.replace(default_plan(torch.bfloat16, torch.device("cuda")), wgrad="grouped_mm")
    errs = check_expert_ffn(random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", 3), plan=plan)
    for name in ("out", "dx", "dweight", "dw13", "dw2"):
        assert errs[name] <= TOL, f"{name}: relative error {errs[name]:.3g} > {TOL} ({errs})"
    assert errs["empty_slot_grad"] == 0.0, errs


def test_gather_pair_rows_copies_the_valid_positions():
    """An EP rank's slots (about half empty: one row per token and destination), H=4096 bf16: the
    valid positions equal the torch gather; a CUDA-graph replay with new slots follows them."""
    from ray_moe.kernels.gather_sum import gather_pair_rows
    from tests.references import gather_pair_rows_reference
    from ray_moe.kernels.routing import pair_layout

    g = torch.Generator(device="cuda").manual_seed(5)
    R, K, S, H = 2048, 8, 32, 4096
    x = torch.randn(R, H, device="cuda", dtype=torch.bfloat16, generator=g)

    def slots():
        s = torch.randint(0, S, (R, K), device="cuda", generator=g, dtype=torch.int32)
        return torch.where(torch.rand(R, K, device="cuda", generator=g) < 0.5, s, -1)

    slot = slots()
    lay = pair_layout(slot, S)
    assert 0 < int(lay.offsets[-1]) < R * K
    nv = int(lay.offsets[-1])
    assert torch.equal(gather_pair_rows(x, lay, K)[:nv], gather_pair_rows_reference(x, lay, K))
    graph, out = capture_graph(lambda: gather_pair_rows(x, lay, K))
    for a, b in zip(lay, pair_layout(slots(), S)):  # new slots into the captured layout's tensors
        a.copy_(b)
    graph.replay()
    nv = int(lay.offsets[-1])
    assert torch.equal(out[:nv], gather_pair_rows_reference(x, lay, K))


def test_zero_empty_groups_touches_only_the_empty_groups():
    """A weight gradient's shape (32 groups of 3072 x 4096 bf16) filled with NaN: the empty groups
    (first, middle, last) become 0, every other group keeps its NaN (not read, not written), also
    replayed from a CUDA graph with other empty groups."""
    from ray_moe.kernels.empty_groups import zero_empty_groups

    S, M, N = 32, 3072, 4096
    out = torch.full((S, M, N), float("nan"), device="cuda", dtype=torch.bfloat16)

    def offsets(empty):
        counts = torch.ones(S, dtype=torch.int32)
        counts[list(empty)] = 0
        return torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)]).cuda()

    def check(empty):
        nan = out.isnan().flatten(1).all(1).cpu()
        zero = (out == 0).flatten(1).all(1).cpu()
        assert zero[list(empty)].all() and nan[[s for s in range(S) if s not in empty]].all()

    offs = offsets({0, 13, 31})
    zero_empty_groups(out, offs)
    check({0, 13, 31})
    out.fill_(float("nan"))
    graph, _ = capture_graph(lambda: zero_empty_groups(out, offs))
    out.fill_(float("nan"))
    offs.copy_(offsets({5}))
    graph.replay()
    check({5})


def _needs_quack():
    from ray_moe.kernels.quack_wgrad import quack_available

    if not quack_available():
        pytest.skip("quack (the optional weight-gradient backend) is not installed")


@pytest.mark.parametrize("pattern", ["random", "sparse", "all_one_expert"])
def test_grouped_wgrad_quack_matches_reference(pattern):
    """quack's varlen-K GEMM for dW13 (x gathered) and dW2 (grad_out gathered, written through the
    transposed view): bf16 vs the float32 reference, slots with no pairs exactly zero."""
    _needs_quack()
    from ray_moe.kernels.grouped_swiglu import grouped_wgrad_reference
    from ray_moe.kernels.quack_wgrad import grouped_wgrad_quack
    from ray_moe.kernels.routing import pair_layout

    R, K, S, H, I = (16, 2, 64, 128, 96) if pattern == "sparse" else (700, 4, 8, 512, 192)
    c = random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", 11)
    lay = pair_layout(c["slot"], S)
    dh13 = torch.randn(R * K, 2 * I, device="cuda").bfloat16()
    aw = torch.randn(R * K, I, device="cuda").bfloat16()
    go = torch.randn(R, H, device="cuda").bfloat16()
    empty = lay.offsets[1:] == lay.offsets[:-1]
    for args in ((c["x"], dh13, lay, K, True, False), (aw, go, lay, K, False, True)):
        got, ref = grouped_wgrad_quack(*args), grouped_wgrad_reference(*args)
        assert rel_err(got, ref) <= TOL, (pattern, args[4], rel_err(got, ref))
        if empty.any():
            assert got[empty].abs().max().item() == 0


def test_expert_ffn_bf16_quack_weight_grads():
    """The Triton forward and activation gradients with dW13/dW2 through quack: same gradients."""
    _needs_quack()
    import dataclasses

    from ray_moe.kernels.grouped_swiglu import default_plan

    plan = dataclasses.replace(default_plan(torch.bfloat16, torch.device("cuda")), wgrad="quack")
    errs = check_expert_ffn(random_case(512, 4, 8, 1024, 384, "random", torch.bfloat16, "cuda", 3), plan=plan)
    for name in ("out", "dx", "dweight", "dw13", "dw2"):
        assert errs[name] <= TOL, f"{name}: relative error {errs[name]:.3g} > {TOL} ({errs})"
    assert errs["empty_slot_grad"] == 0.0, errs


def test_chooser_measures_every_candidate_and_its_choice_is_correct():
    from ray_moe.model.expert_choice import ExpertImplChooser
    from ray_moe.model.experts import expert_ffn

    case = random_case(2048, 4, 8, 1024, 384, "random", torch.bfloat16, "cuda", 9)
    ch = ExpertImplChooser()
    choice = ch.choose(case["x"], case["slot"], case["weight"], case["w13"], case["w2"], needs_grad=True)
    (timings,) = ch.timings.values()
    assert set(timings) == {c.name for c in ch.candidates}
    assert all(isinstance(t, float) and t > 0 for t in timings.values()), timings
    assert timings[choice.name] == min(timings.values())
    got = expert_ffn(case["x"], case["slot"], case["weight"], case["w13"], case["w2"], impl=choice.impl,
                     wgrad=choice.wgrad)
    want = expert_ffn(case["x"].double().cpu(), case["slot"].cpu(), case["weight"].double().cpu(),
                      case["w13"].double().cpu(), case["w2"].double().cpu(), impl="loop")
    assert rel_err(got, want) <= TOL


def test_chooser_with_biases_and_clamp_measures_them_and_its_choice_is_correct():
    """A gpt-oss-like layer under expert_impl auto: every candidate (Triton ones included, no
    fallback) runs with the biases and the clamped activation; the choice equals the oracle."""
    from ray_moe.model.expert_choice import ExpertImplChooser
    from ray_moe.model.experts import expert_ffn

    case = random_case(2048, 4, 8, 1024, 384, "random", torch.bfloat16, "cuda", 9, biases=True)
    act = _clamped(7.0)
    ch = ExpertImplChooser()
    choice = ch.choose(case["x"], case["slot"], case["weight"], case["w13"], case["w2"], needs_grad=True,
                       act=act, b13=case["b13"], b2=case["b2"])
    (timings,) = ch.timings.values()
    assert all(isinstance(t, float) and t > 0 for t in timings.values()), timings
    got = expert_ffn(case["x"], case["slot"], case["weight"], case["w13"], case["w2"], impl=choice.impl,
                     wgrad=choice.wgrad, act=act, b13=case["b13"], b2=case["b2"])
    want = expert_ffn(*(case[n].double().cpu() if n != "slot" else case[n].cpu()
                        for n in ("x", "slot", "weight", "w13", "w2")), impl="loop", act=act,
                      b13=case["b13"].double().cpu(), b2=case["b2"].double().cpu())
    assert rel_err(got, want) <= TOL


def test_router_logits_split_bf16_matches_float32():
    """route()'s router GEMM on CUDA bf16 (two bf16 halves of the float32 weight, tensor cores)."""
    from ray_moe.model.router import router_logits
    from tests.kernel_cases import check_router_logits

    for T, H, E in [(16384, 4096, 64), (7, 200, 6), (0, 64, 8)]:
        errs = check_router_logits(router_logits, T, H, E, "cuda", seed=T)
        assert errs["logits"] < 2e-5 and errs["dw"] < 2e-5 and errs["dx"] < 1e-2, (T, errs)  # dx is bf16
