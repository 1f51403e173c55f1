"""GPU checks of the FP8 experts (kernels.fp8_quant, kernels.fp8_grouped, kernels.fp8_expert_ffn):
quantisation bit for bit against the torch references; every GEMM against a float32 reference of
the same quantised inputs (tight); the whole FP8 path against the bf16 Triton path and float32
(stated bounds); the Triton path against the CPU path's emulation; the MoE layer; CUDA-graph
replay equal to eager, weights updated between replays included. Run on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from ray_moe.device import capture_graph
from ray_moe.kernels import fp8_grouped as G
from ray_moe.kernels import fp8_quant as Q
from tests.kernel_cases import random_case

pytestmark = pytest.mark.gpu

CASES = [
    # R, K, S, H, I, pattern
    (512, 4, 8, 1024, 384, "random"),
    (300, 8, 16, 200, 128, "random"),  # H not a multiple of 128
    (16, 2, 64, 256, 256, "sparse"),  # experts with 0 or 1 pair
    (257, 2, 4, 384, 128, "all_one_expert"),
    (333, 1, 8, 512, 256, "random"),  # K = 1
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == Q.FP8_DTYPE else torch.equal(a, b)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("R,K,S,H,I,pattern", CASES)
def test_quantisation_is_bit_exact(R, K, S, H, I, pattern):
    case = random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", 0)
    x = case["x"] * torch.logspace(-3, 3, H, device="cuda", dtype=torch.bfloat16)
    x[0, :128] = 0
    for a, b in zip(Q.quantize_rows(x), Q.quantize_rows_reference(x)):
        assert _same(a, b)
    for w in (case["w13"], case["w2"]):
        for a, b in zip(Q.quantize_blocks(w), Q.quantize_blocks_reference(w)):
            assert _same(a, b)
    from ray_moe.kernels.routing import pair_layout

    layout = pair_layout(case["slot"], S)
    used = int(Q.group_tiles(layout.offsets)[-1])
    dh = torch.randn(R * K, 2 * I, device="cuda", dtype=torch.bfloat16)
    for src, gather in ((x, True), (dh, False)):
        (qt, st), (qr, sr) = Q.quantize_cols(src, layout, K, gather), Q.quantize_cols_reference(src, layout, K, gather)
        assert _same(st[:, :used], sr[:, :used]) and _same(qt[:, :used * 128], qr[:, :used * 128])


@pytest.mark.parametrize("R,K,S,H,I,pattern", CASES)
def test_fused_swiglu_backward_equals_the_unfused_kernels(R, K, S, H, I, pattern):
    """The SwiGLU backward writing dh13 and aw only quantised (one kernel) against the elementwise
    kernel followed by the three quantisations (bit for bit but for the rare E4M3 step that a
    differently contracted multiply-add moves), and x's column tiles made from its FP8 rows on load
    bit for bit those of the dequantised copy."""
    from ray_moe.kernels import fp8_swiglu as SW
    from ray_moe.kernels.grouped_swiglu import gated_act_backward_rows
    from ray_moe.kernels.routing import pair_layout

    case = random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", 0)
    layout = pair_layout(case["slot"], S)
    n, used = int(layout.offsets[-1]), int(Q.group_tiles(layout.offsets)[-1])
    g = torch.randn(R * K, I, device="cuda", dtype=torch.bfloat16)
    h13 = torch.randn(R * K, 2 * I, device="cuda", dtype=torch.bfloat16)
    weight = case["weight"].float().contiguous()
    out = SW.swiglu_bwd_fp8(g, h13, weight, layout)
    dh13, aw = torch.empty_like(h13), torch.empty_like(g)
    dw = torch.empty(R * K, device="cuda")
    gated_act_backward_rows(g, h13, weight, layout, dh13, aw, dw)

    def agree(a, b):  # quantised values: equal but for a rare one-step move
        assert (a[0].view(torch.uint8) != b[0].view(torch.uint8)).float().mean() < 1e-4
        assert _rel(Q.dequantize_rows(*a), Q.dequantize_rows(*b)) < 1e-3

    q, s = Q.quantize_rows(dh13)
    agree((out.dh13_rows[0][:n], out.dh13_rows[1][:n]), (q[:n], s[:n]))
    for got, src in ((out.dh13_cols, dh13), (out.aw_cols, aw)):
        qt, st = Q.quantize_cols(src, layout, K, False)
        agree((got[0][:, :used * 128], got[1][:, :used]), (qt[:, :used * 128], st[:, :used]))
    assert _rel(out.dw_pos[:n], dw[:n]) < 1e-5 and not out.dw_pos[n:].any()
    xq, xs = Q.quantize_rows(case["x"])
    a = Q.quantize_cols(xq, layout, K, True, xs, torch.bfloat16)
    b = Q.quantize_cols(Q.dequantize_rows(xq, xs).bfloat16(), layout, K, True)
    assert _same(a[0][:, :used * 128], b[0][:, :used * 128]) and _same(a[1][:, :used], b[1][:, :used])


def test_quantisation_reference_is_the_same_on_every_device():
    """The reference's scale is amax / 448 correctly rounded on the GPU as on the CPU (a tensor
    divisor: torch multiplies by a Python scalar divisor's float32 reciprocal on CUDA, one
    rounding off for about half of all amax values), and the kernels equal it bit for bit there,
    rows, columns and blocks, on amax values where the two roundings differ."""
    g = torch.Generator().manual_seed(5)
    amax = torch.rand(256, generator=g) * 100
    assert (amax / 448 != amax * torch.tensor(1 / 448)).any()  # the values do tell the two roundings apart
    x = amax[:, None] * torch.linspace(1.0, -0.5, 384)  # a row's first tile peaks at its column 0: amax
    want = (amax.double() / 448).float()
    for dt in (torch.float32, torch.bfloat16):
        xd = x.to(dt)
        ref_cpu = Q.quantize_rows_reference(xd)
        ref_gpu = Q.quantize_rows_reference(xd.cuda())
        kernel = Q.quantize_rows(xd.cuda())
        for a, b, c in zip(ref_cpu, ref_gpu, kernel):
            assert _same(a.cuda(), b) and _same(b, c)
        if dt == torch.float32:
            assert torch.equal(ref_gpu[1][:, 0].cpu(), want)
        w = xd[:, :256].reshape(2, 128, 256).contiguous()
        for a, b, c in zip(Q.quantize_blocks_reference(w), Q.quantize_blocks_reference(w.cuda()),
                           Q.quantize_blocks(w.cuda())):
            assert _same(a.cuda(), b) and _same(b, c)


@pytest.mark.parametrize("cfg", [
    dict(block_m=128, block_n=128, num_warps=8, num_stages=3, promote="acc"),
    dict(block_m=64, block_n=128, num_warps=4, num_stages=3, promote="row", persistent=2),
    dict(block_m=64, block_n=128, num_warps=8, num_stages=4, promote="outer"),
    dict(block_m=64, block_n=256, num_warps=8, num_stages=3, promote="outer"),
    dict(block_m=64, block_n=128, num_warps=8, num_stages=4, promote="outer", one_dot=True),
], ids=["acc-128", "row-persistent", "outer", "outer-256", "one-dot"])
def test_the_sweeps_gemm_forms_against_float32(cfg):
    """Each promotion form and schedule the sweep may choose, every row GEMM it applies to, against
    the float32 reference of the same quantised inputs (as tight as the default's check), through
    descriptors where they apply; the wgrad kernel's other tiles likewise."""
    from ray_moe.kernels.routing import pair_layout

    F = G.Fp8GemmConfig
    cfg = F(**cfg)
    R, K, S, H, I = 300, 8, 16, 200, 256  # H not a multiple of 128: a ragged last chunk
    case = random_case(R, K, S, H, I, "random", torch.bfloat16, "cuda", 4)
    layout = pair_layout(case["slot"], S)
    n = int(layout.offsets[-1])
    bf = torch.bfloat16
    xq, xs = Q.quantize_rows(case["x"])
    q13, q13t, s13 = Q.quantize_blocks(case["w13"])
    q2, q2t, s2 = Q.quantize_blocks(case["w2"])
    if cfg.block_n == 128:
        _, _, h13 = G.fp8_gate_up(xq, xs, q13t, s13.transpose(1, 2), layout, K, bf, cfg=cfg)
        _, _, h13r = G.fp8_gate_up_reference(xq, xs, q13t, s13.transpose(1, 2), layout, K, bf)
        assert ((h13[:n].float() - h13r[:n].float()).abs() <= h13r[:n].float().abs() * 2 ** -7 + 1e-6).all()
    if cfg.one_dot:
        return
    aq, asc = Q.quantize_rows(torch.randn(R * K, I, device="cuda", dtype=bf))
    y = G.fp8_down(aq, asc, q2t, s2.transpose(1, 2), layout, K, case["weight"], torch.float32, cfg=cfg)
    assert _rel(y[:n], G.fp8_down_reference(aq, asc, q2t, s2.transpose(1, 2), layout, K, case["weight"],
                                            torch.float32)[:n]) < 1e-5
    gq, gs = Q.quantize_rows(torch.randn(R, H, device="cuda", dtype=bf))
    g = G.fp8_rows(gq, gs, q2, s2, layout, K, True, torch.float32, cfg=cfg)
    assert _rel(g[:n], G.fp8_rows_reference(gq, gs, q2, s2, layout, K, True, torch.float32)[:n]) < 1e-5
    dh = torch.randn(R * K, 2 * I, device="cuda", dtype=bf)
    dq, ds = Q.quantize_rows(dh)
    dx = G.fp8_rows(dq, ds, q13, s13, layout, K, False, torch.float32, cfg=cfg)
    assert _rel(dx[:n], G.fp8_rows_reference(dq, ds, q13, s13, layout, K, False, torch.float32)[:n]) < 1e-5
    wcfg = F(cfg.block_m, min(cfg.block_n, 128), cfg.num_warps, cfg.num_stages)
    args = (*Q.quantize_cols(case["x"], layout, K, True), *Q.quantize_cols(dh, layout, K, False),
            Q.group_tiles(layout.offsets), torch.float32)
    assert _rel(G.fp8_wgrad(*args, cfg=wcfg), G.fp8_wgrad_reference(*args)) < 1e-5


@pytest.mark.parametrize("tma", [False, None], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("R,K,S,H,I,pattern", CASES)
def test_gemms_against_float32_of_the_same_quantised_inputs(R, K, S, H, I, pattern, tma):
    from ray_moe.kernels.routing import pair_layout

    case = random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", 1)
    layout = pair_layout(case["slot"], S)
    n = int(layout.offsets[-1])
    bf = torch.bfloat16
    xq, xs = Q.quantize_rows(case["x"])
    q13, q13t, s13 = Q.quantize_blocks(case["w13"])
    q2, q2t, s2 = Q.quantize_blocks(case["w2"])
    aq, asc, h13 = G.fp8_gate_up(xq, xs, q13t, s13.transpose(1, 2), layout, K, bf, tma=tma)
    _, _, h13r = G.fp8_gate_up_reference(xq, xs, q13t, s13.transpose(1, 2), layout, K, bf)
    assert ((h13[:n].float() - h13r[:n].float()).abs() <= h13r[:n].float().abs() * 2 ** -7 + 1e-6).all()
    gate, up = h13[:n].float().chunk(2, 1)
    qa, sa = Q.quantize_rows_reference(torch.nn.functional.silu(gate) * up)
    assert (aq[:n].float() != qa.float()).float().mean() < 0.01  # sigmoid's rounding may flip a few
    assert _rel(Q.dequantize_rows(aq[:n], asc[:n]), Q.dequantize_rows(qa, sa)) < 1e-2
    y = G.fp8_down(aq, asc, q2t, s2.transpose(1, 2), layout, K, case["weight"], torch.float32, tma=tma)
    yr = G.fp8_down_reference(aq, asc, q2t, s2.transpose(1, 2), layout, K, case["weight"], torch.float32)
    assert _rel(y[:n], yr[:n]) < 1e-5
    gq, gs = Q.quantize_rows(torch.randn(R, H, device="cuda", dtype=bf))
    g = G.fp8_rows(gq, gs, q2, s2, layout, K, True, torch.float32, tma=tma)
    assert _rel(g[:n], G.fp8_rows_reference(gq, gs, q2, s2, layout, K, True, torch.float32)[:n]) < 1e-5
    dh = torch.randn(R * K, 2 * I, device="cuda", dtype=bf)
    dq, ds = Q.quantize_rows(dh)
    dx = G.fp8_rows(dq, ds, q13, s13, layout, K, False, torch.float32, tma=tma)
    assert _rel(dx[:n], G.fp8_rows_reference(dq, ds, q13, s13, layout, K, False, torch.float32)[:n]) < 1e-5
    args = (*Q.quantize_cols(case["x"], layout, K, True), *Q.quantize_cols(dh, layout, K, False),
            Q.group_tiles(layout.offsets), torch.float32)
    dw, dwr = G.fp8_wgrad(*args, tma=tma), G.fp8_wgrad_reference(*args)
    assert _rel(dw, dwr) < 1e-5
    empty = (layout.offsets[1:] == layout.offsets[:-1]).cpu()
    assert dw[empty].abs().max().item() == 0 if empty.any() else True


def _grads(fn, case, go):
    leaves = [case[n].clone().requires_grad_() for n in ("x", "weight", "w13", "w2")]
    out = fn(leaves[0], case["slot"], *leaves[1:])
    return (out, *torch.autograd.grad(out, leaves, go))


@pytest.mark.parametrize("R,K,S,H,I,pattern", CASES)
def test_fp8_path_against_bf16_and_float32(R, K, S, H, I, pattern):
    """Stated bounds: against float32, the FP8 output and every gradient within 8 % (relative
    Frobenius; E4M3 keeps 3 mantissa bits, ~3.6 % RMS per rounded operand), bf16's within 1 %; and
    the Triton path equals its CPU-path emulation (the references on the same device) within 4 %:
    float32 round-off between the two (summation order, sigmoid) moves a few values across an E4M3
    rounding boundary (one step is 6-12 %) at every quantisation of the chain (act, dh13); under
    Triton's interpreter, whose bf16 casts truncate, the x gradient came to 2.0 %."""
    from ray_moe.kernels import expert_ffn_triton
    from ray_moe.kernels.fp8_expert_ffn import REFERENCE_OPS, expert_ffn_fp8
    from ray_moe.model.experts import expert_ffn

    case = random_case(R, K, S, H, I, pattern, torch.bfloat16, "cuda", 2)
    go = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    exact = _grads(lambda x, s, w, a, b: expert_ffn(x.float(), s, w, a.float(), b.float(), impl="loop"), case,
                   go.float())
    fp8 = _grads(expert_ffn_fp8, case, go)
    bf16 = _grads(expert_ffn_triton, case, go)
    emul = _grads(lambda *a: expert_ffn_fp8(*a, ops=REFERENCE_OPS), case, go)
    for name, e, f, b, m in zip(("out", "x", "weight", "w13", "w2"), exact, fp8, bf16, emul):
        assert _rel(b, e) < 1e-2, name
        assert _rel(f, e) < 0.08, name
        assert _rel(f, m) < 4e-2, name


def test_cuda_graph_replay_equals_eager_and_sees_updated_weights():
    from ray_moe.kernels.fp8_expert_ffn import Fp8WeightCache, expert_ffn_fp8

    R, K, S, H, I = 1024, 4, 8, 512, 256
    static = random_case(R, K, S, H, I, "random", torch.bfloat16, "cuda", 3)
    leaves = {n: static[n].clone().requires_grad_() for n in ("x", "weight", "w13", "w2")}
    slot = static["slot"].clone()
    grad_out = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    cache = Fp8WeightCache()

    def step():
        out = expert_ffn_fp8(leaves["x"], slot, leaves["weight"], leaves["w13"], leaves["w2"], cache=cache)
        return (out, *torch.autograd.grad(out, list(leaves.values()), grad_out))

    graph, captured = capture_graph(step, warmup=1)
    for seed in (10, 11):  # new values, weights included (as after an update), then replay and compare
        fresh = random_case(R, K, S, H, I, "random", torch.bfloat16, "cuda", seed)
        with torch.no_grad():
            for n, t in leaves.items():
                t.copy_(fresh[n])
            slot.copy_(fresh["slot"])
        graph.replay()
        eager = step()
        for a, b in zip(captured, eager):
            assert torch.equal(a, b)


def test_moe_layer_in_fp8_against_the_oracle():
    from ray_moe.comm.local import LocalTransport
    from ray_moe.model.experts import reference_moe
    from ray_moe.model.moe import MoELayer, MoELayerSpec

    layer = MoELayer(MoELayerSpec(512, 16, 4, 256, dtype=torch.bfloat16, expert_precision="fp8", seed=1),
                     LocalTransport(), device="cuda")
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, _ = layer(x)
    out.float().sum().backward()
    x_ref = x.detach().float().requires_grad_()
    w13, w2 = (layer.w13.detach().float().requires_grad_(), layer.w2.detach().float().requires_grad_())
    ref, _, _ = reference_moe(x_ref, layer.router.detach(), w13, w2, 4)
    ref.sum().backward()
    assert _rel(out, ref) < 0.08
    assert _rel(x.grad, x_ref.grad) < 0.1 and _rel(layer.w13.grad, w13.grad) < 0.1 and _rel(layer.w2.grad, w2.grad) < 0.1
    assert layer.fp8_weights.quantizations == 1


def test_the_update_kernel_moves_the_version_the_weight_cache_keys_on():
    """The one-pass AdamW kernel writes the compute weights from Triton: it bumps their version
    counter, so the FP8 copies are remade after every update (else they would go stale)."""
    from ray_moe.kernels.fp8_expert_ffn import Fp8WeightCache
    from ray_moe.worker.adamw_kernel import adamw_step

    w13 = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    cache = Fp8WeightCache()
    before = cache.get(w13, w2).w13.clone()
    master = w13.float()
    moments = (torch.zeros_like(master), torch.zeros_like(master))
    adamw_step(torch.ones_like(w13), master, *moments, w13, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
               weight_decay=0.0, step=1)
    after = cache.get(w13, w2)
    assert cache.quantizations == 2 and not torch.equal(after.w13.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("R,slot_value", [(0, 0), (5, -1)])
def test_no_rows_and_no_valid_pairs(R, slot_value):
    from ray_moe.kernels.fp8_expert_ffn import expert_ffn_fp8

    x = torch.randn(R, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w13 = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    slot = torch.full((R, 2), slot_value, device="cuda")
    out = expert_ffn_fp8(x, slot, torch.zeros(R, 2, device="cuda"), w13, w2)
    out.float().sum().backward()
    assert out.shape == (R, 256) and out.abs().sum().item() == 0
    assert w13.grad.abs().sum().item() == 0 and w2.grad.abs().sum().item() == 0
