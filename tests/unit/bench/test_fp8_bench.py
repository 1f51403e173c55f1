"""bench layer's FP8 section: torchao's side permutes the pairs into groups padded to 16 rows (what
``torch._scaled_grouped_mm`` needs) and back; checked here with a float32 grouped GEMM standing in
for torchao's (it leaves NaN outside the groups, as an unset output would hold), against the
float32 experts, values and gradients. The per-kernel breakdown and the FP8 GEMM sweep run their
kernels under Triton's interpreter with a stand-in clock: every kind of kernel has its row, the
winners are keyed as FP8_TILES and printed as its entries, the experts on the winners equal
the chooser's, and the library ceiling's rows are timed only where their outputs check out. The sweep's flags fail with one line."""

from __future__ import annotations

import sys

import pytest
import torch

from ray_moe.bench.layer import parse_args
from ray_moe.bench.layer.fp8 import torchao_expert_ffn, torchao_rowwise_mm
from ray_moe.model.experts import expert_ffn


def _grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    assert all(int(o) % 16 == 0 for o in offs)  # the FP8 grouped GEMM's alignment rule
    out = torch.full((a.shape[0], b_t.shape[2]), float("nan"))
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        out[lo:hi] = a[lo:hi] @ b_t[e]
        lo = hi
    return out


def test_torchao_side_permutation_matches_the_experts():
    g = torch.Generator().manual_seed(0)
    R, K, E, H, I = 30, 2, 4, 32, 16
    slot = torch.randint(0, E, (R, K), generator=g)
    slot[:, 1] = torch.where(slot[:, 1] == slot[:, 0], -1, slot[:, 1])
    slot[slot == 2] = -1  # an expert with no rows
    leaves = [torch.randn(R, H, generator=g), torch.rand(R, K, generator=g), torch.randn(E, H, 2 * I, generator=g),
              torch.randn(E, I, H, generator=g)]
    leaves = [t.requires_grad_() for t in leaves]
    x, w, w13, w2 = leaves
    w13_t = w13.detach().transpose(1, 2).contiguous().requires_grad_()
    w2_t = w2.detach().transpose(1, 2).contiguous().requires_grad_()
    got = torchao_expert_ffn(x, slot, w, w13_t, w2_t, _grouped_mm)
    want = expert_ffn(x, slot, w, w13, w2, impl="loop")
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    go = torch.randn(R, H, generator=g)
    ga = torch.autograd.grad(got, [x, w, w13_t, w2_t], go)
    gb = torch.autograd.grad(want, [x, w, w13, w2], go)
    for a, b in zip(ga, (gb[0], gb[1], gb[2].transpose(1, 2), gb[3].transpose(1, 2))):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-3)


def test_torchao_absence_is_a_row_not_an_error():
    mm, why = torchao_rowwise_mm()
    assert (mm is None) == bool(why)


_SWEEP_SCRIPT = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
import ray_moe.bench.layer.fp8 as B
from ray_moe.bench.layer.problem import LayerShape
from ray_moe.kernels import fp8_grouped as G
from ray_moe.kernels.fp8_expert_ffn import TRITON_OPS, expert_ffn_fp8
clock = iter(range(10 ** 6, 0, -1))  # each later timing shorter: the last candidate that checks out wins
B.median_ms = lambda fn, warmup, rep: (fn(), float(next(clock)))[1]
ops = TRITON_OPS
shape, cpu = LayerShape(T=16, H=128, I=128, E=3, K=2), torch.device("cpu")
rows = B.fp8_kernel_rows(shape, torch.bfloat16, 0, 1, 1, device=cpu, ops=ops)
assert {r["kind"] for r in rows} == {"quantise", "up", "down", "dX", "dW", "other", "all", "fusion"}
parts = [r for r in rows if not r["what"].startswith("total") and r["kind"] != "fusion"]
fusions = [r for r in rows if r["kind"] == "fusion"]
assert len(fusions) == 2 and all(r["fused speed-up"] > 0 and "share" not in r for r in fusions)
assert abs(sum(r["share"] for r in parts) - 1) < 1e-9
assert all("fp8 TFLOP/s" in r and "bf16 ms" in r for r in parts if r["kind"] in ("up", "down", "dW"))
F = G.Fp8GemmConfig
cands = {"down": (F(16, 64, 4, 1), F(32, 128, 4, 1, promote="acc")), "wgrad": (F(32, 32, 4, 1), F(16, 64, 4, 1))}
out, win = B.fp8_sweep_rows(shape, torch.bfloat16, 0, 1, 1, ("down", "wgrad2"), device=cpu, candidates=cands.get,
                            ops=ops)
assert win == {("down", 128, 128): cands["down"][-1], ("wgrad", 128, 128): cands["wgrad"][-1]}, win
assert [r["what"] for r in out if r.get("winner")] == ["down 32x128 w4 s1 g8 acc", "wgrad2 16x64 w4 s1 g8 row"]
assert all(r["rel_err_vs_chosen"] < 5e-3 for r in out if "rel_err_vs_chosen" in r)
entries = [r["FP8_TILES entry"] for r in out if "FP8_TILES entry" in r]
assert entries == ["('down', 128, 128): _F(32, 128, 4, 1, promote='acc'),", "('wgrad', 128, 128): _F(16, 64, 4, 1),"]
_F = F
assert eval(entries[0].split(": ", 1)[1].rstrip(","))  == cands["down"][-1]  # the printed entry is the config
# the experts on the winners (tiled_ops) equal the chooser's path within bf16 round-off
g = torch.Generator().manual_seed(1)
x = torch.randn(24, 128, generator=g).bfloat16()
slot = torch.randint(0, 3, (24, 2), generator=g)
w = torch.rand(24, 2, generator=g)
w13 = (torch.randn(3, 128, 256, generator=g) / 12).bfloat16()
w2 = (torch.randn(3, 128, 128, generator=g) / 12).bfloat16()
a = expert_ffn_fp8(x, slot, w, w13, w2, ops=TRITON_OPS).float()
b = expert_ffn_fp8(x, slot, w, w13, w2, ops=B.tiled_ops(win)).float()
assert ((a - b).norm() / a.norm()).item() < 1e-2
# the library ceiling: the bf16 row, then each FP8 row timed only where its output checked out
ceil = B.fp8_ceiling_rows(LayerShape(T=64, H=256, I=128, E=2, K=2), 1, 1, device=cpu)
assert ceil[0]["what"] == "bf16 torch.mm" and len(ceil) == 4, ceil
assert all(r.get("rel_err_vs_f32", 1) <= 1e-2 or r.get("note") for r in ceil[1:]), ceil
assert any(r["what"].startswith("rowwise FP8") and "ms" in r for r in ceil), ceil  # torch runs it on the CPU
print("fp8 bench sweep ok")
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _SWEEP_SCRIPT)
def test_fp8_kernel_breakdown_and_sweep_under_the_interpreter(interpreter_scripts):
    interpreter_scripts.assert_prints(_SWEEP_SCRIPT, "fp8 bench sweep ok")


@pytest.mark.parametrize("argv, says", [
    (["--fp8-sweep"], "--fp8-sweep needs 'fp8' in --sections"),
    (["--sections", "fp8", "--fp8-sweep-gemms", "down"], "--fp8-sweep-gemms needs --fp8-sweep"),
    (["--sections", "fp8", "--fp8-sweep", "--fp8-sweep-gemms", "down,up"],
     "--fp8-sweep-gemms: unknown up; known: gate_up"),
    (["--sections", "fp8", "--fp8-parts", "kernels,sweep"], "--fp8-parts: unknown sweep; known: ceiling, kernels, layer"),
])
def test_fp8_sweep_flags_name_what_is_wrong(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_fp8_sweep_flags_pass():
    args = parse_args(["--sections", "fp8", "--fp8-sweep", "--fp8-sweep-gemms", "down,wgrad2", "--fp8-parts", ""])
    assert args.fp8_sweep and args.fp8_sweep_gemms == "down,wgrad2" and args.fp8_parts == ""
