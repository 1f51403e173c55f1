"""FP8 experts (DeepSeek-V3's block-scaled recipe): the quantisation references define the numerics;
the Triton kernels match them under Triton's interpreter (quantisation bit for bit, GEMMs to float32
round-off) and compile for sm_90 with FP8 wgmma; the CPU path (the references) matches the
per-pair oracle tightly and the float32 experts within FP8's error; the weight cache quantises once
per parameter version; the MoE layer with ``expert_precision="fp8"`` runs it."""

from __future__ import annotations

import sys

import pytest
import torch

from ray_moe.kernels import fp8_quant as Q
from tests.support import compile_for_sm90

_SCRIPT = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from ray_moe.kernels import fp8_quant as Q, fp8_grouped as G
from ray_moe.kernels.routing import pair_layout_reference
def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
g = torch.Generator().manual_seed(0)
# quantisation, bit for bit: values over six decades, a zero tile, ragged edges (300 = 2*128 + 44)
x = torch.randn(37, 300, generator=g) * torch.logspace(-3, 3, 300)
x[3, 128:256] = 0
x[4, :128] = torch.randn(128, generator=g) * torch.logspace(-8, 2, 128)  # underflow to ±0 inside a tile
x[5, :4] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30])
for dt in (torch.float32, torch.bfloat16):
    q, s = Q.quantize_rows(x.to(dt)); qr, sr = Q.quantize_rows_reference(x.to(dt))
    assert torch.equal(s, sr) and same(q, qr) and s[3, 1] == 1
    w = torch.randn(2, 200, 260, generator=g).to(dt)
    for a, b in zip(Q.quantize_blocks(w), Q.quantize_blocks_reference(w)):
        assert (torch.equal(a, b) if a.dtype == torch.float32 else same(a, b))
# a layout with an empty group and groups that start inside a 128-position tile
R, K, S, H, I = 100, 2, 4, 160, 128
slot = torch.randint(0, S, (R, K), generator=g)
slot[:, 1] = torch.where(slot[:, 1] == slot[:, 0], -1, slot[:, 1])
slot[slot == 2] = -1
lay = pair_layout_reference(slot, S)
n = int(lay.offsets[-1]); offs = lay.offsets.tolist()
assert offs[2] == offs[3] and any(o % 128 for o in offs[1:-1]), offs
dt = torch.bfloat16
x = torch.randn(R, H, generator=g).to(dt)
h = torch.randn(R * K, 2 * I, generator=g).to(dt)
tiles = Q.group_tiles(lay.offsets)
used = int(tiles[-1])
assert tiles.tolist() == [0] + torch.tensor([-(-(b - a) // 128) for a, b in zip(offs, offs[1:])]).cumsum(0).tolist()
for src, gather in ((x, True), (h, False)):
    (qt, st), (qr, sr) = Q.quantize_cols(src, lay, K, gather), Q.quantize_cols_reference(src, lay, K, gather)
    assert torch.equal(st[:, :used], sr[:, :used]) and same(qt[:, :used * 128], qr[:, :used * 128])
# from FP8 rows (row-strided views of packed wire rows), dequantised on load: bit for bit the
# quantisation of the dequantised copy, rounded to either dtype, and its reference
packed = Q.pack_rows(x, Q.quantize_rows)
xq_, xs_ = Q.packed_views(packed, H)
for rd in (torch.float32, torch.bfloat16):
    a = Q.quantize_cols(xq_, lay, K, True, xs_, rd)
    b = Q.quantize_cols(Q.dequantize_rows(xq_, xs_).to(rd), lay, K, True)
    r = Q.quantize_cols_reference(xq_, lay, K, True, xs_, rd)
    for got in (b, r):
        assert torch.equal(a[1][:, :used], got[1][:, :used]) and same(a[0][:, :used * 128], got[0][:, :used * 128])
w13 = (torch.randn(S, H, 2 * I, generator=g) / H ** 0.5).to(dt)
w2 = (torch.randn(S, I, H, generator=g) / I ** 0.5).to(dt)
weight = torch.rand(R, K, generator=g)
xq, xs = Q.quantize_rows(x)
q13, q13t, s13 = Q.quantize_blocks(w13); q2, q2t, s2 = Q.quantize_blocks(w2)
def close(a, b, tol=1e-5):
    err = ((a[:n].float() - b[:n].float()).norm() / b[:n].float().norm()).item()
    assert err < tol, err
# every GEMM through pointer loads and through TMA descriptors (emulated by the interpreter)
gq, gs = Q.quantize_rows(torch.randn(R, H, generator=g))
dq, ds = Q.quantize_rows(h)
for tma in (False, True):
    # up-projection + SwiGLU: g|u to 1 bf16 ulp; act quantised from the kernel's own g|u, bit for bit
    aq, asc, h13 = G.fp8_gate_up(xq, xs, q13t, s13.transpose(1, 2), lay, K, dt, tma=tma)
    _, _, h13r = G.fp8_gate_up_reference(xq, xs, q13t, s13.transpose(1, 2), lay, K, dt)
    assert ((h13[:n].float() - h13r[:n].float()).abs() <= h13r[:n].float().abs() * 2 ** -7 + 1e-6).all()  # one bf16 ulp
    gate, up = h13[:n].float().chunk(2, 1)
    qa, sa = Q.quantize_rows_reference(torch.nn.functional.silu(gate) * up)
    assert (aq[:n].float() != qa.float()).float().mean() < 0.01
    close(Q.dequantize_rows(aq[:n], asc[:n]), Q.dequantize_rows(qa, sa), 1e-2)
    close(G.fp8_down(aq, asc, q2t, s2.transpose(1, 2), lay, K, weight, torch.float32, tma=tma),
          G.fp8_down_reference(aq, asc, q2t, s2.transpose(1, 2), lay, K, weight, torch.float32))
    close(G.fp8_rows(gq, gs, q2, s2, lay, K, True, torch.float32, tma=tma),
          G.fp8_rows_reference(gq, gs, q2, s2, lay, K, True, torch.float32))
    close(G.fp8_rows(dq, ds, q13, s13, lay, K, False, torch.float32, tma=tma),
          G.fp8_rows_reference(dq, ds, q13, s13, lay, K, False, torch.float32))
    ops = (*Q.quantize_cols(x, lay, K, True), *Q.quantize_cols(h, lay, K, False), tiles, torch.float32)
    dw, dwr = G.fp8_wgrad(*ops, tma=tma), G.fp8_wgrad_reference(*ops)
    assert dw[2].abs().max() == 0 and ((dw - dwr).norm() / dwr.norm()).item() < 1e-5
    # against the unpadded float32 product of the same quantised values
    a, b = Q.dequantize_rows(*ops[:2]), Q.dequantize_rows(*ops[2:4])
    t = (tiles * 128).tolist()
    for s_ in range(S):
        dense = a[:, t[s_]:t[s_ + 1]] @ b[:, t[s_]:t[s_ + 1]].T
        assert torch.allclose(dw[s_], dense, rtol=1e-4, atol=1e-4)
# the tile, schedule and promotion variants the sweep chooses from (persistent programs, the
# one-dot SwiGLU form, 256-column tiles with the outer-product promotion, the in-place
# accumulation, other wgrad tiles): same results
F = G.Fp8GemmConfig
_, _, h13r = G.fp8_gate_up_reference(xq, xs, q13t, s13.transpose(1, 2), lay, K, dt)
for cfg in (F(16, 128, 4, 1, one_dot=True, promote="outer"), F(32, 128, 4, 1, persistent=1),
            F(16, 128, 4, 1, promote="acc")):
    aq, asc, h13 = G.fp8_gate_up(xq, xs, q13t, s13.transpose(1, 2), lay, K, dt, cfg=cfg)
    assert ((h13[:n].float() - h13r[:n].float()).abs() <= h13r[:n].float().abs() * 2 ** -7 + 1e-6).all(), cfg
for cfg in (F(16, 64, 4, 1, persistent=1, promote="acc", maxnreg=168), F(32, 256, 4, 1, promote="outer")):
    close(G.fp8_down(aq, asc, q2t, s2.transpose(1, 2), lay, K, weight, torch.float32, cfg=cfg),
          G.fp8_down_reference(aq, asc, q2t, s2.transpose(1, 2), lay, K, weight, torch.float32))
    close(G.fp8_rows(gq, gs, q2, s2, lay, K, True, torch.float32, cfg=cfg),
          G.fp8_rows_reference(gq, gs, q2, s2, lay, K, True, torch.float32))
    close(G.fp8_rows(dq, ds, q13, s13, lay, K, False, torch.float32, cfg=cfg),
          G.fp8_rows_reference(dq, ds, q13, s13, lay, K, False, torch.float32))
for cfg in (F(32, 64, 4, 1, maxnreg=168), F(64, 16, 4, 1)):
    dw = G.fp8_wgrad(*ops, cfg=cfg)
    assert dw[2].abs().max() == 0 and ((dw - dwr).norm() / dwr.norm()).item() < 1e-5
# the SwiGLU backward between the FP8 GEMMs, its outputs written quantised in one kernel: bit for
# bit the bf16 path's elementwise kernel followed by the three quantisations (float32 and bf16, a
# width of two column blocks), within FP8's error of the reference; only what is asked for is made
from ray_moe.kernels import fp8_swiglu as SW
from ray_moe.kernels.grouped_swiglu import gated_act_backward_rows
for fd, I2 in ((torch.float32, 128), (dt, 256)):
    G_ = torch.randn(R * K, I2, generator=g).to(fd)
    h2 = torch.randn(R * K, 2 * I2, generator=g).to(fd)
    out = SW.swiglu_bwd_fp8(G_, h2, weight, lay)
    # (the elementwise kernel in float32, rounded to G's dtype by torch: the interpreter truncates)
    dh = torch.empty(R * K, 2 * I2); aw = torch.empty(R * K, I2); dwp = torch.empty(R * K)
    gated_act_backward_rows(G_.float(), h2.float(), weight, lay, dh, aw, dwp)
    dh, aw = dh.to(fd), aw.to(fd)
    q, s_ = Q.quantize_rows(dh)
    assert same(out.dh13_rows[0][:n], q[:n]) and torch.equal(out.dh13_rows[1][:n], s_[:n])
    for got, src in ((out.dh13_cols, dh), (out.aw_cols, aw)):
        qt, st = Q.quantize_cols(src, lay, K, False)
        assert torch.equal(got[1][:, :used], st[:, :used]) and same(got[0][:, :used * 128], qt[:, :used * 128])
    assert (out.dw_pos[n:] == 0).all() and torch.allclose(out.dw_pos[:n], dwp[:n], rtol=1e-6, atol=1e-6)
    ref = SW.swiglu_bwd_fp8_reference(G_, h2, weight, lay)
    close(Q.dequantize_rows(*out.dh13_rows), Q.dequantize_rows(*ref.dh13_rows), 3e-2)
    for a, b in ((out.dh13_cols, ref.dh13_cols), (out.aw_cols, ref.aw_cols)):
        da, db = Q.dequantize_rows(a[0][:, :used * 128], a[1][:, :used]), Q.dequantize_rows(b[0][:, :used * 128], b[1][:, :used])
        assert ((da - db).norm() / db.norm()).item() < 3e-2
    close(out.dw_pos, ref.dw_pos, 1e-5)
    part = SW.swiglu_bwd_fp8(G_, h2, weight, lay, rows=False, cols13=False)
    assert part.dh13_rows is None and part.dh13_cols is None and same(part.aw_cols[0][:, :used * 128], out.aw_cols[0][:, :used * 128])
print("fp8 kernels ok")
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _SCRIPT)
def test_fp8_kernels_under_the_interpreter(interpreter_scripts):
    interpreter_scripts.assert_prints(_SCRIPT, "fp8 kernels ok")


def _signature(fn, types: dict, constexprs: dict) -> dict:
    return {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}


def test_fp8_quantisation_compiles_for_hopper():
    """The row quantisation compiled for sm_90: correctly rounded division (torch's, not
    ``div.full``) and the saturating round-to-nearest E4M3 cast."""
    c = dict(BLOCK_R=16, EXACT_CAST=False)
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    ptx = compile_for_sm90(Q._quantize_rows_kernel, _signature(Q._quantize_rows_kernel, types, c), c, num_warps=4)["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx


def test_the_fp8_step_compiles_for_hopper_at_the_gpu_tiles(monkeypatch):
    """Every launch of one FP8 expert step, forward and backward, as it runs on an H100 (the
    Hopper default tiles, B and A through TMA descriptors, the hardware E4M3 cast), and the GEMM
    forms the sweep picks from (one-dot, 128-row in-place promotion; persistent 256-column outer
    with a register cap), compiled for sm_90 through the launchers themselves: the arguments each
    launch passes fit its kernel, every GEMM is an FP8 wgmma, and each fits an H100's shared
    memory. (The interpreter runs the CPU's small tiles; this is the GPU's launch.)"""
    import dataclasses

    from ray_moe.kernels import fp8_grouped as G
    from ray_moe.kernels.fp8_expert_ffn import TRITON_OPS, expert_ffn_fp8
    from ray_moe.kernels.routing import pair_layout_reference
    from tests.support import H100_SHARED_BYTES, launches_compiled_for_sm90

    cuda = torch.device("cuda")  # (a device name: the chooser's Hopper tiles; nothing runs)
    chooser = G.fp8_config
    monkeypatch.setattr(G, "fp8_config", lambda role, dims, device, tiles=G.FP8_TILES: chooser(role, dims, cuda, tiles))
    # the layout computed for real: the backward indexes with it on the host
    ops = dataclasses.replace(TRITON_OPS, pair_layout=pair_layout_reference)
    g = torch.Generator().manual_seed(0)
    R, K, S, H, I = 64, 2, 4, 256, 128
    x = torch.randn(R, H, generator=g).bfloat16().requires_grad_()
    w13 = torch.randn(S, H, 2 * I, generator=g).bfloat16().requires_grad_()
    w2 = torch.randn(S, I, H, generator=g).bfloat16().requires_grad_()
    slot, weight = torch.randint(0, S, (R, K), generator=g), torch.rand(R, K, generator=g).requires_grad_()
    F = G.Fp8GemmConfig
    with launches_compiled_for_sm90() as compiled:
        expert_ffn_fp8(x, slot, weight, w13, w2, ops=ops).float().sum().backward()
        step = len(compiled)
        xq, xs = Q.quantize_rows(x.detach())
        q13, q13t, s13 = Q.quantize_blocks(w13.detach())
        q2, q2t, s2 = Q.quantize_blocks(w2.detach())
        lay = pair_layout_reference(slot, S)
        for cfg in (F(64, 128, 8, 4, one_dot=True, promote="outer"), F(128, 128, 8, 4, promote="acc")):
            G.fp8_gate_up(xq, xs, q13t, s13.transpose(1, 2), lay, K, torch.bfloat16, cfg=cfg)
        G.fp8_rows(*Q.quantize_rows(torch.randn(R * K, 2 * I)), q13, s13, lay, K, False, torch.bfloat16,
                   cfg=F(64, 256, 4, 3, persistent=2, promote="outer", maxnreg=168))
    names = [name for name, _ in compiled]
    assert {"_quantize_rows_kernel", "_quantize_blocks_kernel", "_quantize_cols_kernel", "_fp8_rows_kernel",
            "_fp8_wgrad_kernel", "_swiglu_bwd_fp8_kernel", "_gather_sum_kernel"} <= set(names[:step])
    assert names[:step].count("_fp8_rows_kernel") == 4 and names[:step].count("_fp8_wgrad_kernel") == 2
    for name, kernel in compiled:
        assert kernel.metadata.shared <= H100_SHARED_BYTES, (name, kernel.metadata.shared)
        if name in ("_fp8_rows_kernel", "_fp8_wgrad_kernel"):
            assert "wgmma.mma_async.sync.aligned" in kernel.asm["ptx"] and ".e4m3.e4m3" in kernel.asm["ptx"], name
    assert any("cp.async.bulk.tensor" in k.asm["ptx"] for n, k in compiled[:step] if n == "_fp8_rows_kernel")


def test_quantisation_references_define_the_numerics():
    x = torch.tensor([[0.0] * 128 + [448.0 * 3] + [1.0] * 127 + [-2.0, 1e-3]])
    q, s = Q.quantize_rows_reference(x)
    assert q.shape == x.shape and s.shape == (1, 3)
    assert torch.equal(s, torch.tensor([[1.0, 3.0, 2.0]]) / torch.tensor([[1.0, 1.0, 448.0]]))  # zero tile: 1; else amax / 448
    assert q.float()[0, 128] == 448 and q.float()[0, 256] == -448
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 384, generator=g) * torch.logspace(-4, 4, 384)
    q, s = Q.quantize_rows_reference(x)
    err = (Q.dequantize_rows(q, s) - x).abs()
    scale = s.repeat_interleave(128, 1)
    assert (err <= torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10)).all()  # E4M3: 3 mantissa bits, subnormals
    w = torch.randn(2, 130, 260, generator=g)
    q, qt, s = Q.quantize_blocks_reference(w)
    assert s.shape == (2, 2, 3) and torch.equal(qt.float(), q.float().transpose(1, 2))
    assert torch.equal(s[:, 1, 2], w[:, 128:, 256:].abs().amax((1, 2)) / 448)
    # the scale is amax / 448 correctly rounded (float64's quotient rounded once more is exact for
    # float32 division), not amax times a rounded 1/448 (what a scalar divisor gives on CUDA)
    amax = torch.rand(64, generator=g) * 100
    _, s = Q.quantize_rows_reference(amax[:, None] * torch.linspace(1.0, -0.5, 128))  # |row| peaks at column 0
    assert torch.equal(s[:, 0], (amax.double() / 448).float())
    assert not torch.equal(s[:, 0], amax * torch.tensor(1 / 448))


def test_fp8_gemm_configs_and_the_chooser():
    """One owner of the tiles: fp8_config reads the table for (role, dims) on CUDA, else the role's
    default (the sweep's first candidate); the interpreter's small tiles on the CPU; a config
    whose promotion form cannot serve its tile is refused; every candidate is a valid config."""
    from ray_moe.kernels import fp8_grouped as G

    F, cuda = G.Fp8GemmConfig, torch.device("cuda")  # (a device name: nothing runs)
    table = {("down", 4096, 1536): F(64, 128, 4, 3, promote="acc")}
    assert G.fp8_config("down", (4096, 1536), cuda, tiles=table) == table[("down", 4096, 1536)]
    for role in G.FP8_ROLES:
        cands = G.fp8_candidates(role)
        assert G.fp8_config(role, (4096, 1536) if role != "down" else (2048, 768), cuda, tiles=table) == cands[0]
        assert G.fp8_config(role, (1, 1), cuda) == cands[0]  # the committed table, at dims it has no entry for
        assert len(set(cands)) == len(cands)
        assert G.fp8_config(role, (1, 1), torch.device("cpu")).block_m == 16
    assert all(c.block_n == 128 for c in G.fp8_candidates("gate_up"))  # the act tile is one 1×128 scale tile
    assert {c.promote for c in G.fp8_candidates("dx")} == set(G.PROMOTIONS)
    assert any(c.persistent for c in G.fp8_candidates("down")) and any(c.one_dot for c in G.fp8_candidates("gate_up"))
    for bad in (dict(block_n=256), dict(one_dot=True), dict(promote="max"), dict(block_m=48), dict(num_warps=3),
                dict(maxnreg=300)):
        with pytest.raises(ValueError):
            F(**bad)
    assert F(64, 256, 8, 3, promote="outer").name == "64x256 w8 s3 g8 outer"
    assert F(64, 128, 4, 3, maxnreg=168).launch_options == dict(num_warps=4, num_stages=3, maxnreg=168)
    with pytest.raises(ValueError, match="unknown FP8 GEMM role"):
        G.fp8_config("up", (1, 1), cuda)


def _problem(R=24, K=2, S=3, H=96, I=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    slot = torch.randint(0, S, (R, K), generator=g)
    slot[:, 1] = torch.where(slot[:, 1] == slot[:, 0], -1, slot[:, 1])
    slot[slot == 1] = -1  # slot 1 gets no pairs
    x = torch.randn(R, H, generator=g)
    w13 = torch.randn(S, H, 2 * I, generator=g) / H ** 0.5
    w2 = torch.randn(S, I, H, generator=g) / I ** 0.5
    weight = torch.rand(R, K, generator=g) * (slot >= 0)
    return x, slot, weight, w13, w2, torch.randn(R, H, generator=g)


def test_cpu_path_matches_the_oracle_and_float32_within_fp8_error():
    from ray_moe.kernels.fp8_expert_ffn import expert_ffn_fp8
    from tests.references import expert_ffn_fp8_reference
    from ray_moe.model.experts import expert_ffn

    x, slot, weight, w13, w2, go = _problem()
    leaves = [t.clone().requires_grad_() for t in (x, weight, w13, w2)]
    out = expert_ffn_fp8(leaves[0], slot, *leaves[1:])
    ref = expert_ffn_fp8_reference(x, slot, weight, w13, w2)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-6
    exact_leaves = [t.clone().requires_grad_() for t in (x, weight, w13, w2)]
    exact = expert_ffn(exact_leaves[0], slot, *exact_leaves[1:], impl="loop")
    # E4M3 rounds each operand by up to 2^-4 relative: the output and every gradient within 10 %
    assert ((out - exact).norm() / exact.norm()).item() < 0.1
    got = torch.autograd.grad(out, leaves, go)
    want = torch.autograd.grad(exact, exact_leaves, go)
    for name, a, b in zip(("x", "weight", "w13", "w2"), got, want):
        err = ((a - b).norm() / b.norm()).item()
        assert 1e-3 < err < 0.1, (name, err)  # FP8's error, not float32's
    assert got[2][1].abs().max() == 0 and got[3][1].abs().max() == 0  # the empty slot


def test_no_rows_and_no_valid_pairs():
    """A rank may receive no rows, or rows none of whose pairs are its: zeros, zero weight
    gradients, no error (an error on one rank would leave the others waiting in the combine)."""
    from ray_moe.kernels.fp8_expert_ffn import expert_ffn_fp8

    for R, slot_value in ((0, 0), (5, -1)):
        x = torch.randn(R, 64, requires_grad=True)
        w13 = torch.randn(2, 64, 256, requires_grad=True)
        w2 = torch.randn(2, 128, 64, requires_grad=True)
        out = expert_ffn_fp8(x, torch.full((R, 2), slot_value), torch.zeros(R, 2), w13, w2)
        out.sum().backward()
        assert out.shape == (R, 64) and out.abs().sum() == 0
        assert w13.grad.abs().sum() == 0 and w2.grad.abs().sum() == 0


def test_weight_cache_quantises_once_per_parameter_version():
    from ray_moe.kernels.fp8_expert_ffn import Fp8WeightCache, expert_ffn_fp8

    x, slot, weight, w13, w2, _ = _problem()
    cache = Fp8WeightCache()
    a = expert_ffn_fp8(x, slot, weight, w13, w2, cache=cache)
    expert_ffn_fp8(x, slot, weight, w13, w2, cache=cache)
    assert cache.quantizations == 1
    with torch.no_grad():
        w2.mul_(2.0)  # an optimizer's in-place update bumps the version
    b = expert_ffn_fp8(x, slot, weight, w13, w2, cache=cache)
    assert cache.quantizations == 2
    assert torch.allclose(b, 2 * a, rtol=1e-5, atol=1e-6)  # powers of two scale exactly


def test_argument_rules():
    from ray_moe.kernels.fp8_expert_ffn import expert_ffn_fp8
    from ray_moe.model.experts import expert_ffn

    x, slot, weight, w13, w2, _ = _problem(I=96)
    with pytest.raises(ValueError, match="multiple of 128"):
        expert_ffn_fp8(x, slot, weight, w13, w2)
    with pytest.raises(ValueError, match="precision 'fp16' is not one of bf16, fp8"):
        expert_ffn(x, slot, weight, w13, w2, precision="fp16")
    from ray_moe.kernels.routing import pair_layout_reference

    lay = pair_layout_reference(slot, w13.shape[0])
    xq, xs = Q.quantize_rows_reference(x)
    for src, scale, dt in ((xq, None, torch.float32), (x, xs, torch.float32), (xq, xs, torch.float16)):
        with pytest.raises(ValueError, match="an FP8 src needs its row scales"):
            Q.quantize_cols(src, lay, 2, True, scale, dt)


def test_moe_layer_runs_its_experts_in_fp8():
    """One rank (LocalTransport): the layer with expert_precision fp8 gives the FP8 experts over its
    own routing exactly, the float32 oracle within FP8's error, one quantisation per weight version."""
    from ray_moe.comm.local import LocalTransport
    from ray_moe.kernels.fp8_expert_ffn import expert_ffn_fp8
    from ray_moe.model.experts import reference_moe
    from ray_moe.model.moe import MoELayer, MoELayerSpec

    with pytest.raises(ValueError, match="expert_precision='e5m2' is not one of bf16, fp8"):
        MoELayerSpec(32, 4, 2, 128, expert_precision="e5m2")
    layer = MoELayer(MoELayerSpec(32, 4, 2, 128, expert_precision="fp8", seed=3), LocalTransport())
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(1))
    out, _ = layer(x)
    out2, _ = layer(x)
    assert layer.fp8_weights.quantizations == 1 and torch.equal(out, out2)
    ref, weights, ids = reference_moe(x, layer.router, layer.w13, layer.w2, 2)
    assert ((out - ref).norm() / ref.norm()).item() < 0.1
    direct = expert_ffn_fp8(x, ids, weights, layer.w13, layer.w2)
    assert ((out - direct).norm() / direct.norm()).item() < 1e-6
    out.sum().backward()
    assert layer.w13.grad is not None and layer.w2.grad is not None and x.grad is None


@pytest.mark.parametrize("needs", [(False, True, True, True), (True, True, False, True), (True, True, True, False),
                                   (False, False, True, False)])
def test_backward_makes_only_the_gradients_asked_for(needs):
    """Each subset of (x, weight, w13, w2) asking for gradients gets exactly the full backward's
    (the SwiGLU backward then makes only the quantised tiles those need), the rest None."""
    from ray_moe.kernels.fp8_expert_ffn import expert_ffn_fp8

    x, slot, weight, w13, w2, go = _problem()
    full = [t.clone().requires_grad_() for t in (x, weight, w13, w2)]
    expert_ffn_fp8(full[0], slot, *full[1:]).backward(go)
    part = [t.clone().requires_grad_(n) for t, n in zip((x, weight, w13, w2), needs)]
    expert_ffn_fp8(part[0], slot, *part[1:]).backward(go)
    for f, p, n in zip(full, part, needs):
        assert (torch.equal(p.grad, f.grad) if n else p.grad is None)
