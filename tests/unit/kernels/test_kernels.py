"""CPU tests of the expert kernels.

- The pure-torch references beside each kernel, composed, against ``expert_ffn(impl="loop")``.
- The Triton kernels themselves under ``TRITON_INTERPRET=1`` at tiny sizes (float32), run in a
  process of its own (started in the background at collection: tests/interpreter_scripts.py) so
  the interpreter never leaks into other tests; skipped with the reason if the
  installed Triton's interpreter cannot run them.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.kernel_cases import random_case, rel_err

INTERP_CASES = {
    # name: (R, K, S, H, I, pattern); every case runs the default plan, VARIANT_CASES the others
    "random": (9, 3, 5, 40, 24, "random"),
    "single_token": (1, 2, 4, 32, 16, "all_one_expert"),
    "odd_shapes": (11, 2, 3, 37, 19, "random"),
    "all_one_expert": (9, 2, 4, 32, 16, "all_one_expert"),
    "k1_sparse": (6, 1, 8, 32, 16, "sparse"),
    "tile_multiples": (9, 2, 3, 32, 32, "random"),  # H, I multiples of the 16-wide CPU tiles: every TMA form
}
# Plan variants and the cases they run on under the interpreter (each run is a whole training step
# of tiny GEMMs at interpreter speed: the matrix is kept small to keep the unit suite fast).
VARIANT_CASES = {
    "expert_ffn_tma": ("tile_multiples", "odd_shapes"),  # descriptors, and the pointer fallback
    "expert_ffn_tma_persistent": ("tile_multiples",),
    "expert_ffn_mm_wgrad": ("tile_multiples", "odd_shapes"),  # runs, and the 16-byte row rule
    "expert_ffn_one_dot": ("random", "odd_shapes"),  # one dot (I=24: a masked second column tile); I=19: two
}
# gpt-oss's experts (biases b13, b2; the clamped activation) on the Triton path: variant → (plan,
# biases, activation, cases). Empty experts (random, k1_sparse), every pair to one expert, K=1,
# one token, the descriptor kernels (tile_multiples) and the one-dot up-projection.
EPILOGUE_CASES = {
    "bias_clamped": ("default", True, "clamped_swiglu", ("random", "all_one_expert", "k1_sparse", "single_token")),
    "bias_swiglu": ("default", True, "swiglu", ("odd_shapes",)),
    "clamped_no_bias": ("default", False, "clamped_swiglu", ("odd_shapes",)),
    "bias_clamped_tma": ("tma_persistent", True, "clamped_swiglu", ("tile_multiples",)),
    "bias_clamped_one_dot": ("one_dot", True, "clamped_swiglu", ("random",)),
}


def _clamped():
    from ray_moe.model.experts import ExpertActivation
    from tests.kernel_cases import CLAMPED_TEST_LIMIT

    return ExpertActivation("clamped_swiglu", 1.702, CLAMPED_TEST_LIMIT)


def _reference_expert_ffn(case: dict[str, torch.Tensor], act=None) -> torch.Tensor:
    """expert_ffn built only from the kernels' pure-torch references (biases where the case has them)."""
    from tests.references import gather_sum_reference
    from ray_moe.kernels.grouped_swiglu import (
        down_scaled_reference,
        gate_up_swiglu_reference,
    )
    from ray_moe.kernels.routing import pair_layout_reference

    K, S = case["slot"].shape[1], case["w13"].shape[0]
    layout = pair_layout_reference(case["slot"], S)
    a, _ = gate_up_swiglu_reference(case["x"], layout, K, case["w13"], act, case.get("b13"))
    y = down_scaled_reference(a, layout, K, case["weight"], case["w2"], case.get("b2"))
    return gather_sum_reference(y, layout, K)


@pytest.mark.parametrize("name", sorted(INTERP_CASES))
def test_references_compose_to_loop_path(name):
    from ray_moe.model.experts import expert_ffn

    case = random_case(*INTERP_CASES[name], torch.float64, "cpu", seed=3)
    want = expert_ffn(case["x"], case["slot"], case["weight"].double(), case["w13"], case["w2"], impl="loop")
    assert rel_err(_reference_expert_ffn(case), want) < 1e-5  # references compute in float32


@pytest.mark.parametrize("name", ["random", "all_one_expert", "k1_sparse"])
def test_references_with_biases_and_the_clamp_compose_to_loop_path(name):
    from ray_moe.model.experts import expert_ffn

    case = random_case(*INTERP_CASES[name], torch.float64, "cpu", seed=3, biases=True)
    want = expert_ffn(case["x"], case["slot"], case["weight"].double(), case["w13"], case["w2"], impl="loop",
                      act=_clamped(), b13=case["b13"], b2=case["b2"])
    assert rel_err(_reference_expert_ffn(case, _clamped()), want) < 1e-5
    plain = expert_ffn(case["x"], case["slot"], case["weight"].double(), case["w13"], case["w2"], impl="loop")
    assert rel_err(plain, want) > 1e-2  # the biases and the clamp change the output


@pytest.mark.parametrize("epilogue", ["swiglu", "bias_clamped"])
def test_backward_references_match_autograd(epilogue):
    """swiglu_backward_rows / dgrad_rows / grouped_wgrad / group_sum references give autograd's
    gradients (with gpt-oss's biases and clamped activation too: the clamp's zero gradient, the
    down bias's share of the routing weight's gradient, the bias gradients)."""
    from tests.references import gather_sum_reference, group_sum_reference
    from ray_moe.kernels.grouped_swiglu import (
        dgrad_rows_reference,
        gate_up_swiglu_reference,
        grouped_wgrad_reference,
        swiglu_backward_rows_reference,
    )
    from ray_moe.kernels.routing import pair_layout_reference
    from ray_moe.model.experts import SWIGLU, expert_ffn

    bias = epilogue == "bias_clamped"
    act = _clamped() if bias else None
    case = random_case(*INTERP_CASES["random"], torch.float64, "cpu", seed=5, biases=bias)
    K, S = case["slot"].shape[1], case["w13"].shape[0]
    names = ("x", "weight", "w13", "w2") + (("b13", "b2") if bias else ())
    leaves = {n: case[n].clone().double().requires_grad_() for n in names}
    out = expert_ffn(leaves["x"], case["slot"], leaves["weight"], leaves["w13"], leaves["w2"], impl="loop",
                     act=act or SWIGLU, b13=leaves.get("b13"), b2=leaves.get("b2"))
    go = torch.randn_like(out)
    want = torch.autograd.grad(out, list(leaves.values()), go)

    layout = pair_layout_reference(case["slot"], S)
    _, h13 = gate_up_swiglu_reference(case["x"], layout, K, case["w13"], act, case.get("b13"))
    dh13, aw, dw_pos = swiglu_backward_rows_reference(go, layout, K, case["weight"], case["w2"], h13, act,
                                                      case.get("b2"))
    n_valid = int(layout.offsets[-1])
    pos = layout.pair_pos.long()
    dweight = torch.where(pos < n_valid, dw_pos[pos.clamp(max=len(dw_pos) - 1)], 0.0).reshape(case["weight"].shape)
    dx = gather_sum_reference(dgrad_rows_reference(dh13, layout, K, case["w13"]), layout, K)
    dw13 = grouped_wgrad_reference(case["x"], dh13, layout, K, True, False)
    dw2 = grouped_wgrad_reference(aw, go, layout, K, False, True)
    got = [dx, dweight, dw13, dw2]
    if bias:
        got += [group_sum_reference(dh13, layout, K, gather=False),
                group_sum_reference(go, layout, K, gather=True, scale=case["weight"])]
    for g, ref, name in zip(got, want, names):
        assert rel_err(g, ref) < 1e-5, name  # float32 inside the references


def test_topk_softmax_reference_matches_route():
    from ray_moe.kernels.routing import topk_softmax_reference
    from ray_moe.model.experts import route

    x, router_w = torch.randn(50, 16), torch.randn(16, 10)
    w, ids, _ = route(x, router_w, 3)
    wr, ir = topk_softmax_reference(x @ router_w, 3)
    assert torch.equal(ids, ir) and torch.allclose(w, wr)


def test_pair_layout_reference_is_a_stable_grouping():
    from ray_moe.kernels.routing import pair_layout_reference

    slot = torch.tensor([[2, -1], [0, 2], [7, 0]])  # 7 is out of range for S=3: treated as -1
    lay = pair_layout_reference(slot, 3)
    assert lay.offsets.tolist() == [0, 2, 2, 4]
    assert lay.sorted_pair.tolist()[:4] == [2, 5, 0, 3]
    assert torch.equal(lay.sorted_pair[lay.pair_pos.long()], torch.arange(6, dtype=torch.int32))


# ------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (subprocess)
# ------------------------------------------------------------------------------------------


def run_interpreter_checks() -> dict:
    """Runs inside the subprocess (TRITON_INTERPRET=1 set before triton is imported)."""
    from ray_moe.kernels import grouped_swiglu as gs
    from ray_moe.kernels.gather_sum import gather_pair_rows, gather_sum
    from tests.references import gather_pair_rows_reference, gather_sum_reference
    from ray_moe.kernels.routing import (
        pair_layout,
        pair_layout_reference,
        topk_softmax,
        topk_softmax_reference,
    )
    from tests.kernel_cases import check_expert_ffn

    results: dict = {}
    import dataclasses

    split = gs.default_plan(torch.float32, torch.device("cpu"))  # the GPU's plan: split dSwiGLU, dual dW13
    mm_wgrad = dataclasses.replace(gs.default_plan(torch.float32, torch.device("cpu")), wgrad="grouped_mm")
    roles = ("gate_up", "down", "dact", "dx", "wgrad13", "wgrad2")
    # the Hopper variants (TMA descriptors; persistent, flattened), emulated by the interpreter
    hopper = {
        "tma": dataclasses.replace(split, **{r: dataclasses.replace(getattr(split, r), tma=True) for r in roles}),
        "tma_persistent": dataclasses.replace(split, dual_wgrad13=False, **{
            r: dataclasses.replace(getattr(split, r), tma=True, persistent=True, flatten=r in ("down", "dx"))
            for r in roles}),
    }
    from ray_moe.kernels import grouped_tma

    launches: dict[str, int] = {}
    for fn_name in ("launch_rows_tma", "launch_wgrad_tma"):  # count what really ran through descriptors
        def counted(*a, _fn=getattr(grouped_tma, fn_name), _name=fn_name, **kw):
            launches[_name] = launches.get(_name, 0) + 1
            return _fn(*a, **kw)

        setattr(grouped_tma, fn_name, counted)
    epilogue_plans = {"default": None, "tma_persistent": hopper["tma_persistent"],
                      "one_dot": dataclasses.replace(split, gate_up=dataclasses.replace(split.gate_up, one_dot=True))}
    from ray_moe.model.experts import SWIGLU

    for variant, (plan_name, biases, kind, names) in EPILOGUE_CASES.items():
        for name in names:
            case = random_case(*INTERP_CASES[name], torch.float32, "cpu", seed=13, biases=biases)
            act = _clamped() if kind == "clamped_swiglu" else SWIGLU
            results[f"epilogue_{variant}/{name}"] = check_expert_ffn(case, plan=epilogue_plans[plan_name], act=act)
    results["moe_layer_bias_clamped"] = _moe_layer_check()
    for name, args in INTERP_CASES.items():
        case = random_case(*args, torch.float32, "cpu", seed=11)
        if name == "tile_multiples":
            launches.clear()
            check_expert_ffn(case, plan=hopper["tma"])
            results["tma_launches/tile_multiples"] = dict(launches)
        results[f"expert_ffn/{name}"] = check_expert_ffn(case)
        plans = {"expert_ffn_tma": hopper["tma"],
                 "expert_ffn_tma_persistent": hopper["tma_persistent"], "expert_ffn_mm_wgrad": mm_wgrad,
                 "expert_ffn_one_dot": dataclasses.replace(split, gate_up=dataclasses.replace(split.gate_up, one_dot=True))}
        for variant, plan in plans.items():
            if name not in VARIANT_CASES[variant]:
                continue
            try:
                results[f"{variant}/{name}"] = check_expert_ffn(case, plan=plan)
            except ValueError as exc:  # rows that are not 16-byte multiples: torch._grouped_mm's rule
                if variant != "expert_ffn_mm_wgrad":
                    raise
                results[f"{variant}/{name}"] = {"error": str(exc)}
        K, S = case["slot"].shape[1], case["w13"].shape[0]
        lay, ref = pair_layout(case["slot"], S), pair_layout_reference(case["slot"], S)
        results[f"pair_layout/{name}"] = all(torch.equal(a, b) for a, b in zip(lay, ref))
        act, h13 = gs.gate_up_swiglu(case["x"], lay, K, case["w13"])
        act_r, h13_r = gs.gate_up_swiglu_reference(case["x"], lay, K, case["w13"])
        nv = int(lay.offsets[-1])
        y = gs.down_scaled(act, lay, K, case["weight"], case["w2"])
        y_r = gs.down_scaled_reference(act, lay, K, case["weight"], case["w2"])
        results[f"kernels/{name}"] = {
            "act": rel_err(act[:nv], act_r[:nv]),
            "h13": rel_err(h13[:nv], h13_r[:nv]),
            "y": rel_err(y[:nv], y_r[:nv]),
            "gather_sum": rel_err(gather_sum(y, lay, K), gather_sum_reference(y, lay, K)),
            # the pair rows of x: equal (a copy) on the valid positions, which are all it writes
            "gather_pair_rows": float(not torch.equal(gather_pair_rows(case["x"], lay, K)[:nv],
                                                      gather_pair_rows_reference(case["x"], lay, K))),
        }
    topk = {}
    for T, E, K in [(9, 6, 1), (9, 6, 2), (17, 10, 3), (5, 16, 4)]:
        logits = torch.randn(T, E, requires_grad=True)
        w, i = topk_softmax(logits, K)
        wr, ir = topk_softmax_reference(logits, K)
        g = torch.randn_like(w)
        (a,) = torch.autograd.grad(w, logits, g)
        (b,) = torch.autograd.grad(wr, logits, g)
        topk[f"{T}x{E}k{K}"] = {"ids": bool(torch.equal(i, ir)), "w": rel_err(w, wr), "grad_abs": (a - b).abs().max().item()}
    results["topk_softmax"] = topk
    results["zero_tail"] = _zero_tail_check()
    return results


def _moe_layer_check() -> dict:
    """A gpt-oss-like MoELayer (expert biases, clamped activation) at one rank with
    ``expert_impl: triton`` (the fused router too) against the same layer on the loop path:
    output and every parameter's gradient."""
    import dataclasses

    import ray_moe.kernels as kernels
    from ray_moe.comm.local import LocalTransport
    from ray_moe.model.moe import MoELayer, MoELayerSpec

    calls = []
    triton_ffn = kernels.expert_ffn_triton

    def counted(*a, **kw):
        calls.append(kw.get("b13") is not None)
        return triton_ffn(*a, **kw)

    kernels.expert_ffn_triton = counted  # experts.expert_ffn imports it from the package at each call

    spec = MoELayerSpec(24, 6, 2, 16, expert_bias=True, activation=_clamped(), expert_impl="loop")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, 24, generator=g)
    runs = {}
    for impl in ("loop", "triton"):
        layer = MoELayer(dataclasses.replace(spec, expert_impl=impl), LocalTransport())
        with torch.no_grad():
            for p in (layer.b13, layer.b2):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
        out, _ = layer(x)
        out.square().sum().backward()
        runs[impl] = [out] + [p.grad for p in (layer.router, *layer.expert_params())]
    kernels.expert_ffn_triton = triton_ffn
    return {"errors": [rel_err(a, b) for a, b in zip(runs["triton"], runs["loop"])], "triton_calls_with_bias": calls}


def _zero_tail_check() -> dict:
    """swiglu_backward_rows (split form) with more empty positions past offsets[S] than ZERO_TAIL,
    as on an EP rank: the valid rows equal the reference, dh13 and aw are zero for ZERO_TAIL rows
    past offsets[S], dw for every one."""
    from ray_moe.kernels import grouped_swiglu as gs
    from ray_moe.kernels.routing import pair_layout

    g = torch.Generator().manual_seed(3)
    R, K, S, H, I = 160, 8, 4, 16, 8
    slot = torch.randint(0, S, (R, K), generator=g)
    slot[torch.rand(R, K, generator=g) < 0.9] = -1
    x, go = torch.randn(R, H, generator=g), torch.randn(R, H, generator=g)
    w13, w2 = torch.randn(S, H, 2 * I, generator=g), torch.randn(S, I, H, generator=g)
    weight = torch.rand(R, K, generator=g) * (slot >= 0)
    lay = pair_layout(slot, S)
    nv, tail = int(lay.offsets[-1]), gs.ZERO_TAIL
    _, h13 = gs.gate_up_swiglu(x, lay, K, w13)
    dh13, aw, dw = gs.swiglu_backward_rows(go, lay, K, weight, w2, h13)
    ref = gs.swiglu_backward_rows_reference(go, lay, K, weight, w2, h13)
    return {
        "tail_fits": float(not R * K > nv + tail),  # the case must leave rows past the tail
        "dh13": rel_err(dh13[:nv], ref[0][:nv]), "aw": rel_err(aw[:nv], ref[1][:nv]),
        "dw": rel_err(dw[:nv], ref[2][:nv]),
        "dh13_tail": float(dh13[nv:nv + tail].abs().max()), "aw_tail": float(aw[nv:nv + tail].abs().max()),
        "dw_past": float(dw[nv:].abs().max()),
    }


INTERPRETER_CHECKS = (sys.executable, os.path.abspath(__file__))  # this file as a script: run_interpreter_checks


@pytest.fixture(scope="module")
def interpreter_results(interpreter_scripts) -> dict:
    return interpreter_scripts.json_or_skip(*INTERPRETER_CHECKS)


@pytest.mark.interpreter_script(*INTERPRETER_CHECKS)
@pytest.mark.parametrize("name", sorted(INTERP_CASES))
def test_triton_expert_ffn_under_interpreter(interpreter_results, name):
    variants = ["expert_ffn"] + [v for v, names in VARIANT_CASES.items() if name in names and v != "expert_ffn_mm_wgrad"]
    for variant in variants:
        errs = interpreter_results[f"{variant}/{name}"]
        for key in ("out", "dx", "dweight", "dw13", "dw2"):
            assert errs[key] < 1e-5, (variant, key, errs)
        assert errs["empty_slot_grad"] == 0.0, variant
    if name in VARIANT_CASES["expert_ffn_mm_wgrad"]:
        mm = interpreter_results[f"expert_ffn_mm_wgrad/{name}"]
        H, I = INTERP_CASES[name][3:5]
        if H % 4 or I % 4:  # float32 rows of H or I elements are not 16-byte multiples
            assert "multiple of 16 bytes" in mm["error"], mm
        else:
            assert all(mm[k] < 1e-5 for k in ("out", "dx", "dweight", "dw13", "dw2")), mm
            assert mm["empty_slot_grad"] == 0.0, mm
    assert interpreter_results[f"pair_layout/{name}"]
    assert all(v < 1e-5 for v in interpreter_results[f"kernels/{name}"].values()), interpreter_results[f"kernels/{name}"]


@pytest.mark.interpreter_script(*INTERPRETER_CHECKS)
@pytest.mark.parametrize("variant,name", [(v, n) for v, (*_, names) in EPILOGUE_CASES.items() for n in names])
def test_triton_biases_and_clamp_under_interpreter(interpreter_results, variant, name):
    """gpt-oss's experts on the Triton kernels (bias epilogues, the clamped activation and its
    derivative, the bias gradients by per-slot sums) equal the float64 loop path: output and every
    gradient; experts with no pairs get exactly zero weight and bias gradients."""
    errs = interpreter_results[f"epilogue_{variant}/{name}"]
    keys = ("out", "dx", "dweight", "dw13", "dw2") + (("db13", "db2") if EPILOGUE_CASES[variant][1] else ())
    for key in keys:
        assert errs[key] < 1e-5, (key, errs)
    assert errs["empty_slot_grad"] == 0.0, errs
    if name in ("random", "k1_sparse"):
        assert errs["n_empty_slots"] > 0, errs  # the case has experts with no pairs
    if EPILOGUE_CASES[variant][2] == "clamped_swiglu":
        assert 0.05 < errs["clamped_share"] < 0.95, errs  # both sides of the clamps were exercised


@pytest.mark.interpreter_script(*INTERPRETER_CHECKS)
def test_moe_layer_with_biases_and_clamp_runs_triton_under_interpreter(interpreter_results):
    """The layer no longer falls back to grouped_mm: expert_impl triton with expert biases and the
    clamped activation equals the loop path (output, router and expert parameter gradients)."""
    r = interpreter_results["moe_layer_bias_clamped"]
    assert r["triton_calls_with_bias"] == [True], r  # one Triton call, with the biases
    assert len(r["errors"]) == 6 and all(e < 1e-5 for e in r["errors"]), r


@pytest.mark.interpreter_script(*INTERPRETER_CHECKS)
def test_tma_variants_run_through_descriptors_under_interpreter(interpreter_results):
    """With H and I multiples of the tiles every GEMM of a training step takes the descriptor
    kernels (gate_up, down, dact, dx; dW13, dW2), not the pointer fallback."""
    assert interpreter_results["tma_launches/tile_multiples"] == {"launch_rows_tma": 4, "launch_wgrad_tma": 2}


def test_sonic_layout_round_trip_matches_the_oracle(monkeypatch):
    """bench layer's SonicMoE adapter: weights converted to SonicMoE's layout (router [E, H], c_fc
    [E, 2I, H] gate/up interleaved, c_proj [E, H, I]) and its gradients converted back give the
    oracle's output and gradients, run here through a pure-torch stand-in of its layer function."""
    import types

    import torch.nn.functional as F

    from ray_moe.bench.layer.problem import LayerShape, layer_problem
    from ray_moe.bench.layer.sonic import SonicLayer
    from ray_moe.model.experts import reference_moe

    def stand_in(x, router_w, w1, b1, w2, b2, K, stream_id, activation_type, is_inference_mode_enabled=False):
        logits = F.linear(x, router_w)
        top, ids = torch.topk(logits, K, dim=-1)
        w = torch.softmax(top, dim=-1)  # softmax over the top-k logits
        out = torch.zeros_like(x)
        for e in range(router_w.shape[0]):
            tok, k = (ids == e).nonzero(as_tuple=True)
            h = x[tok] @ w1[:, :, e].t()  # w1: [2I, H, E], rows interleaved gate, up
            y = (F.silu(h[:, 0::2]) * h[:, 1::2]) @ w2[:, :, e].t()  # w2: [H, I, E]
            out = out.index_add(0, tok, y * w[tok, k].unsqueeze(1))
        return out, logits, None

    enums = types.SimpleNamespace(ActivationType=types.SimpleNamespace(SWIGLU="swiglu"))
    monkeypatch.setitem(sys.modules, "sonicmoe", types.ModuleType("sonicmoe"))
    monkeypatch.setitem(sys.modules, "sonicmoe.enums", enums)
    monkeypatch.setitem(sys.modules, "sonicmoe.functional", types.SimpleNamespace(moe_TC_softmax_topk_layer=stand_in))
    shape = LayerShape(T=40, H=24, I=8, E=6, K=2)
    prob = layer_problem(shape, torch.device("cpu"), torch.float64, seed=0)
    prob["router"] = prob["router"].double()
    sonic = SonicLayer(prob, shape.K)
    x = prob["x"].clone().requires_grad_()
    out = sonic(x)
    got = (torch.autograd.grad(out, x, prob["grad"], retain_graph=True)[0],
           *sonic.grads_in_ray_layout(*torch.autograd.grad(out, sonic.params, prob["grad"])))
    leaves = [t.clone().requires_grad_() for t in (prob["x"], prob["router"], prob["w13"], prob["w2"])]
    ref, _, _ = reference_moe(*leaves, shape.K)
    want = torch.autograd.grad(ref, leaves, prob["grad"])
    # the oracle routes with float32 logits (route()), the rest is float64 on both sides
    assert rel_err(out, ref) < 1e-6
    for a, b, name in zip(got, want, ("dx", "drouter", "dw13", "dw2")):
        assert rel_err(a, b) < 1e-6, name


def test_profile_timeline_orders_kernels_and_finds_idle_gaps():
    """bench layer's profile timeline: kernels in start order, short ones merged, idle gaps."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from ray_moe.bench.layer.profiling import _timeline_rows

    spans = [(1000, 5000), (0, 500), (510, 530), (540, 560), (5001, 5002)]  # microseconds, out of order
    events = [NS(device_type=DeviceType.CUDA, name=f"k{s}", time_range=NS(start=s, end=e)) for s, e in spans]
    events.append(NS(device_type=DeviceType.CPU, name="cpu op", time_range=NS(start=0, end=6000)))
    rows = _timeline_rows(NS(events=lambda: events), "t")
    assert [r["what"] for r in rows[:-1]] == ["k0", "2 short kernels", "(device idle)", "k1000", "1 short kernels"]
    assert rows[2]["ms"] == pytest.approx(0.44) and rows[-1]["ms"] == pytest.approx(5.002)
    assert rows[-1]["note"]["idle ms"] == pytest.approx(0.461)


def test_steady_analysis_splits_steps_and_finds_device_waits():
    """bench layer's steady section: kernels split into steps, idle per step, the host API calls,
    and the op (with its stack) that waited on the device."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from ray_moe.bench.layer.profiling import _steady_analysis

    def ev(name, s, e, dev=DeviceType.CUDA, thread=1, stack=()):
        return NS(name=name, device_type=dev, time_range=NS(start=s, end=e), thread=thread, stack=list(stack))

    events = [ev("k", 0, 1000), ev("k", 1500, 2000), ev("k", 3000, 4000), ev("k", 4000, 4500),
              ev("aten::item", 2000, 2900, DeviceType.CPU, stack=["ray_moe/x.py(3): f", "torch/y.py"]),
              ev("cudaStreamSynchronize", 2100, 2850, DeviceType.CPU),
              ev("cudaLaunchKernel", 10, 20, DeviceType.CPU), ev("cudaLaunchKernel", 30, 45, DeviceType.CPU)]
    rows = {r["what"]: r for r in _steady_analysis(events, 2, "s")}
    assert rows["step 1: span first → last kernel"]["note"] == {"kernel sum ms": 1.5, "idle ms": 0.5}
    assert rows["step 2: span first → last kernel"]["note"]["gap before ms"] == 1.0
    assert rows["host API cudaLaunchKernel"]["calls"] == 2
    wait = rows["device wait: cudaStreamSynchronize"]
    assert wait["ms"] == 0.75 and wait["note"] == {"in op": "aten::item", "stack": ["ray_moe/x.py(3): f"]}


@pytest.mark.interpreter_script(*INTERPRETER_CHECKS)
def test_swiglu_backward_zeroes_a_tail_past_the_valid_positions(interpreter_results):
    """An EP rank's empty positions: the split SwiGLU backward equals the reference on the valid
    ones and zeroes ZERO_TAIL rows past them (what a weight-gradient tile may read), not all."""
    r = interpreter_results["zero_tail"]
    assert r["tail_fits"] == 0.0, r
    assert all(r[k] < 1e-5 for k in ("dh13", "aw", "dw")), r
    assert r["dh13_tail"] == r["aw_tail"] == r["dw_past"] == 0.0, r


@pytest.mark.interpreter_script(*INTERPRETER_CHECKS)
def test_triton_topk_softmax_under_interpreter(interpreter_results):
    for case, r in interpreter_results["topk_softmax"].items():
        assert r["ids"] and r["w"] < 1e-6 and r["grad_abs"] < 1e-6, (case, r)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run through pytest (sets TRITON_INTERPRET=1 for this subprocess)")
    print(json.dumps(run_interpreter_checks()))
