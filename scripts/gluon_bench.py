"""Time the Gluon warp-specialised down-projection (ray_moe/kernels/gluon_grouped.py) against the
Triton down kernel as the expert FFN runs it (``grouped_swiglu.down_scaled``, its default Hopper
config: TMA, persistent, flattened, scale epilogue), the same Triton kernel with the plain epilogue
(the Gluon kernel's exact problem), and ``torch._grouped_mm``; with the max error of each against
the float32 reference. Run on the GPU machine (sm_90, Triton 3.6):

    PYTHONPATH=.:$PYTHONPATH python scripts/gluon_bench.py --json /tmp/gluon_bench.json
    PYTHONPATH=.:$PYTHONPATH python scripts/gluon_bench.py --configs 128x256x64:3:8:8:tma:40 --shapes e128

Shapes (balanced random top-8 routing of T tokens over E experts, P = 8T rows):
``e128``: P=262144, I=1536, H=4096, E=128; ``e64``: the same with E=64;
``qwen``: T=16384 (P=131072), I=768, H=2048, E=128.
Configs: ``BMxBNxBK:stages:warps:group_m:epi:producer_regs`` (GluonDownConfig.parse), or
``sweep`` for gluon_grouped.SWEEP_CONFIGS (the default), ``default`` for the launcher's default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

SHAPES = {
    # name: (T tokens, top_k, I, H, E)
    "e128": (32768, 8, 1536, 4096, 128),
    "e64": (32768, 8, 1536, 4096, 64),
    "qwen": (16384, 8, 768, 2048, 128),
}


def _problem(T: int, K: int, I: int, H: int, E: int, seed: int):
    """Balanced random routing (each token to K distinct experts, uniform), through the project's
    pair layout: act [P, I], w2 [E, I, H] bf16, the layout, routing weights [T, K] float32."""
    from ray_moe.kernels.routing import pair_layout

    g = torch.Generator(device="cuda").manual_seed(seed)
    slot = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices.to(torch.int32).contiguous()
    layout = pair_layout(slot, E)
    P = T * K
    act = torch.randn(P, I, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = (torch.randn(E, I, H, device="cuda", generator=g) / I ** 0.5).to(torch.bfloat16)
    weight = torch.softmax(torch.randn(T, K, device="cuda", generator=g), dim=1).float().contiguous()
    return act, w2, layout, weight


def _max_err(out: torch.Tensor, act: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
             scale: torch.Tensor | None = None) -> dict:
    """Max abs error and its ratio to max |ref| of ``out`` against the float32 reference, group by
    group (no [P, H] float32 copy). ``scale``: per-row factor applied to the reference."""
    bounds = offsets.tolist()
    err, ref_max = 0.0, 0.0
    for s in range(w2.shape[0]):
        lo, hi = bounds[s], bounds[s + 1]
        if hi == lo:
            continue
        ref = act[lo:hi].float() @ w2[s].float()
        if scale is not None:
            ref = ref * scale[lo:hi, None]
        err = max(err, (out[lo:hi].float() - ref).abs().max().item())
        ref_max = max(ref_max, ref.abs().max().item())
    return {"max_abs_err": err, "max_abs_ref": ref_max, "rel_max_err": err / max(ref_max, 1e-30)}


def _bench(fn, rep: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def _run_shape(shape: str, cfgs: list, args: argparse.Namespace) -> dict:
    """Check and time every candidate on one shape; prints a table, returns its JSON entry."""
    from ray_moe.kernels import gluon_grouped as gg
    from ray_moe.kernels.grouped_swiglu import EPI_PLAIN, _launch_rows, default_config, down_scaled

    T, K, I, H, E = SHAPES[shape]
    act, w2, layout, weight = _problem(T, K, I, H, E, seed=1)
    P = act.shape[0]
    offsets = layout.offsets
    valid = int(offsets[-1])
    flops = 2.0 * valid * I * H
    row_scale = weight.reshape(-1)[layout.sorted_pair.long()]  # position -> its pair's weight
    tri_cfg = default_config("down", act.dtype, act.device)
    out = torch.empty(P, H, device="cuda", dtype=torch.bfloat16)
    table = torch.empty(1 + gg.tile_table_capacity(P, E, 128), gg.TABLE_COLS, dtype=torch.int32, device="cuda")

    def triton_plain():
        _launch_rows(a=act, b=w2, b_strides=(w2.stride(0), w2.stride(1), w2.stride(2)), out=out, layout=layout,
                     top_k=K, gather_a=False, epilogue=EPI_PLAIN.value, n_cols=H, kd=I, half=0, cfg=tri_cfg)

    cands: dict = {
        "triton_down": (lambda: down_scaled(act, layout, K, weight, w2), row_scale),
        "triton_plain": (triton_plain, None),
    }
    if hasattr(torch, "_grouped_mm"):
        offs = offsets[1:].contiguous()
        cands["grouped_mm"] = (lambda: torch._grouped_mm(act, w2, offs=offs), None)
    for cfg in cfgs:
        if not gg.down_gluon_ok(act, w2, offsets, out, cfg):
            print(f"[{shape}] gluon {cfg.name()}: not runnable here (down_gluon_ok False)", flush=True)
            continue
        tab = table if cfg.block_m == 128 else None
        cands[f"gluon {cfg.name()}"] = (lambda cfg=cfg, tab=tab: gg.launch_down_gluon(act, w2, offsets, out, cfg, tab),
                                        None)

    rows: dict = {}
    for name, (fn, scale) in cands.items():  # compile, warm up, check
        t0 = time.time()
        try:
            res = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - one failing candidate should not end the sweep
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"[{shape}] {name}: FAILED {rows[name]['error'][:300]}", flush=True)
            continue
        rows[name] = {"first_call_s": time.time() - t0, "ms": []}
        if not args.no_check:
            got = res if isinstance(res, torch.Tensor) else out
            rows[name].update(_max_err(got, act, w2, offsets, scale))
    for _ in range(args.rounds):  # interleaved rounds: clocks drift under the power cap
        for name, (fn, _s) in cands.items():
            if "ms" in rows[name]:
                rows[name]["ms"].append(_bench(fn, args.rep))
    base = {k: min(rows[k]["ms"]) for k in ("triton_down", "triton_plain", "grouped_mm") if "ms" in rows.get(k, {})}
    print(f"\n[{shape}] T={T} K={K} P={P} valid={valid} I={I} H={H} E={E}", flush=True)
    print(f"{'candidate':42s} {'ms':>8s} {'TFLOP/s':>8s} {'vs triton_down':>15s} {'vs grouped_mm':>14s} {'rel max err':>12s}")
    for name, r in rows.items():
        if "ms" not in r:
            continue
        ms = min(r["ms"])
        r.update(best_ms=ms, tflops=flops / ms * 1e-9,
                 ratio_vs_triton_down=ms / base["triton_down"] if "triton_down" in base else None,
                 ratio_vs_grouped_mm=ms / base["grouped_mm"] if "grouped_mm" in base else None)
        fmt = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
        print(f"{name:42s} {ms:8.3f} {r['tflops']:8.1f} {fmt(r['ratio_vs_triton_down']):>15s} "
              f"{fmt(r['ratio_vs_grouped_mm']):>14s} {r.get('rel_max_err', float('nan')):12.2e}", flush=True)
    return {"T": T, "K": K, "P": P, "valid_rows": valid, "I": I, "H": H, "E": E,
            "triton_down_config": repr(tri_cfg), "candidates": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["sweep"], help="Gluon configs (see above)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds (min kept)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms of timing per sample)")
    ap.add_argument("--no-check", action="store_true", help="skip the error check")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    import triton

    from ray_moe.kernels import gluon_grouped as gg

    reason = gg.gluon_unavailable_reason()
    if reason:
        print(f"gluon unavailable: {reason}", file=sys.stderr)
        return 2
    specs: list[str] = []
    for c in args.configs:
        specs += list(gg.SWEEP_CONFIGS) if c == "sweep" else [gg.DEFAULT_CONFIG.name()] if c == "default" else [c]
    cfgs = [gg.GluonDownConfig.parse(s) for s in dict.fromkeys(specs)]
    dev = torch.cuda.get_device_name()
    print(f"device {dev}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    results: dict = {"device": dev, "torch": torch.__version__, "triton": triton.__version__, "shapes": {}}

    for shape in args.shapes:
        results["shapes"][shape] = _run_shape(shape, cfgs, args)
        torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
