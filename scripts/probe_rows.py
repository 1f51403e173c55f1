"""Probe (session 17): the same expert FLOPs laid out as a rank's own tokens (every k local) and as
EP's received rows (about half the k of each row local) time differently. Which factor does it?"""
import json
import os
import sys

import torch
import triton

from ray_moe.kernels.expert_ffn import expert_ffn_triton
from ray_moe.kernels.grouped_swiglu import default_plan, down_scaled, gate_up_swiglu
from ray_moe.kernels.routing import pair_layout

H, I, S, K = 4096, 1536, 32, 8
dev = torch.device("cuda")
torch.manual_seed(0)
w13 = (torch.randn(S, H, 2 * I, device=dev) * 0.02).bfloat16().requires_grad_()
w2 = (torch.randn(S, I, H, device=dev) * 0.02).bfloat16().requires_grad_()


def slots(R: int, valid_frac: float, order: str) -> torch.Tensor:
    """[R, K] distinct slots per row, each k kept with probability valid_frac (else -1)."""
    s = torch.rand(R, S, device=dev).argsort(1)[:, :K].int()
    if valid_frac < 1:
        keep = torch.rand(R, K, device=dev) < valid_frac
        s = torch.where(keep, s, -1)
    if order == "rows_sorted_by_first":  # rows grouped by their first slot
        s = s[s[:, 0].argsort()]
    return s.contiguous()


def case(name, R, frac, order="random", zeros_x=False):
    x = torch.randn(R, H, device=dev).bfloat16() if not zeros_x else torch.zeros(R, H, device=dev).bfloat16()
    sl = slots(R, frac, order)
    wt = torch.where(sl >= 0, torch.rand(R, K, device=dev), 0.0).float()
    lay = pair_layout(sl, S)
    pairs = int((sl >= 0).sum())
    plan = default_plan(torch.bfloat16, dev)
    t_gu = triton.testing.do_bench(lambda: gate_up_swiglu(x, lay, K, w13, True, plan.gate_up), warmup=25, rep=200)
    act, _ = gate_up_swiglu(x, lay, K, w13, True, plan.gate_up)
    t_dn = triton.testing.do_bench(lambda: down_scaled(act, lay, K, wt, w2, plan.down), warmup=25, rep=200)
    xr = x.detach().requires_grad_()

    def step():
        out = expert_ffn_triton(xr, sl, wt, w13, w2, plan)
        out.backward(torch.ones_like(out))
    t_step = triton.testing.do_bench(step, warmup=25, rep=300, grad_to_none=[xr, w13, w2])
    fl = 2 * pairs * H * 2 * I
    rec = dict(name=name, R=R, pairs=pairs, gate_up_ms=t_gu, gate_up_tflops=fl / t_gu / 1e9, down_ms=t_dn,
               down_tflops=fl / 2 / t_dn / 1e9, step_ms=t_step)
    print(json.dumps(rec), flush=True)
    return rec


out = []
out.append(case("own tokens: R=16384, all k local", 16384, 1.0))
out.append(case("EP rows: R=32768, half the k local", 32768, 0.5))
out.append(case("own tokens again", 16384, 1.0))
out.append(case("EP chunk: R=16384, half the k local", 16384, 0.5))
out.append(case("own half: R=8192, all k local", 8192, 1.0))
out.append(case("EP rows, x zeros", 32768, 0.5, zeros_x=True))
out.append(case("own tokens, x zeros", 16384, 1.0, zeros_x=True))
out.append(case("EP rows: R=65536, a quarter of the k local", 65536, 0.25))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_rows.json"), "w"), indent=1)
