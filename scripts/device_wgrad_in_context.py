"""The expert side's forward+backward (``expert_ffn``, Triton) with the weight gradients through
Triton or quack, alternated twice: do_bench median, one step's host launch time, and the kernels of
one profiled step. On the GPU machine, with SonicMoE's bundle (quack):

    . .sonicbundle/setup.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/device_wgrad_in_context.py 128

(docs/BENCHMARKS.md, issue 16 session 5: why the chooser's single samples had picked triton)."""
from __future__ import annotations

import sys
import time

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from ray_moe.bench.layer.problem import LayerShape, layer_problem
from ray_moe.model.experts import expert_ffn
from ray_moe.model.router import route


def main(E: int) -> None:
    shape = LayerShape(E=E)
    prob = layer_problem(shape, torch.device("cuda"), torch.bfloat16, 0)
    with torch.no_grad():
        w, ids, _ = route(prob["x"], prob["router"], shape.K, need_probs=False)
    slot, weight = ids.to(torch.int32), w.float()
    leaves = [t.detach().requires_grad_() for t in (prob["x"], weight, prob["w13"], prob["w2"])]
    grad = prob["grad"]
    for wgrad in ("triton", "quack", "triton", "quack"):
        def step(wgrad: str = wgrad) -> None:
            y = expert_ffn(leaves[0], slot, leaves[1], leaves[2], leaves[3], impl="triton", wgrad=wgrad)
            torch.autograd.grad(y, leaves, grad)

        step()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(step, warmup=50, rep=400, return_mode="median")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"wgrad={wgrad}: fwd+bwd {ms:.2f} ms (do_bench median); one step: host launch "
              f"{1e3 * (t1 - t0):.2f} ms, to done {1e3 * (t2 - t0):.2f} ms", flush=True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total: dict[str, float] = {}
        for e in kernels:
            total[e.name[:70]] = total.get(e.name[:70], 0.0) + e.device_time_total / 1e3
        for name, t in sorted(total.items(), key=lambda kv: -kv[1])[:12]:
            print(f"   {t:8.3f} ms  {name}")
        span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3
        print(f"   sum {sum(total.values()):.2f} ms over {len(kernels)} kernels; first start to last end {span:.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 128)
