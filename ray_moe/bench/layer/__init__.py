"""``ray-moe bench layer``: expert compute, routing/permutation, saved activations, the whole layer
beside SonicMoE, profiles, and expert-parallel rows.

The sections live in one module each; this one parses the flags and runs them in order:

  - :mod:`.problem`: the shape, inputs, weights and timing helpers the sections share;
  - :mod:`.expert`: single-GPU expert-side rows (``kernels``, ``expert``, ``ffn``, ``routing``, ``saved``);
  - :mod:`.sonic`: the whole layer beside SonicMoE (``layer``, ``small``; ``--sonic-precompile``);
  - :mod:`.profiling`: ``profile``, ``steady``, ``wgrad``, ``rows``;
  - :mod:`.fp8`: ``fp8``, each FP8 kernel's time beside bf16's, the FP8 GEMM sweep (``--fp8-sweep``),
    the MoE layer and the experts in FP8 beside bf16 and torchao's FP8 path;
  - EP rows (several GPUs, or a CPU cluster) come from :mod:`ray_moe.bench.ep_layer` (``ep``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
from dataclasses import asdict

import torch

from ray_moe import usage
from ray_moe.bench.layer.expert import (
    GEMM_ROLES,
    epilogue_rows,
    expert_compute_rows,
    expert_ffn_rows,
    kernel_rows,
    routing_rows,
    saved_bytes_rows,
)
from ray_moe.bench.layer.fp8 import FP8_GEMMS, fp8_ceiling_rows, fp8_kernel_rows, fp8_layer_rows, fp8_sweep_rows
from ray_moe.bench.layer.problem import LayerShape, make_inputs
from ray_moe.bench.layer.profiling import profile_rows, row_gemm_backend_rows, steady_rows, wgrad_backend_rows
from ray_moe.bench.layer.sonic import (
    SONIC_PRECOMPILE_ENV,
    copy_bandwidth_gbs,
    small_t_rows,
    sonic_import_error,
    sonic_layer_rows,
    sonic_precompile,
)


def ep_rows(shape: LayerShape, args: argparse.Namespace) -> list[dict]:
    """Expert-parallel rows over a Ray worker group (see :mod:`ray_moe.bench.ep_layer`)."""
    from ray_moe.bench.ep_layer import ep_layer_rows

    return ep_layer_rows(shape.T, shape.H, shape.I, shape.E, shape.K, args.world_size,
                         transport=args.transport, address=args.address, dtype=args.dtype,
                         impl=args.impl, iters=args.ep_iters, device=args.device,
                         force_remote_path=args.force_remote_path,
                         comm_programs=tuple(int(g) for g in args.ep_programs.split(",")),
                         interleave=tuple(None if v == "default" else bool(int(v))
                                          for v in args.ep_interleave.split(",")),
                         profile=args.ep_profile, profile_steps=args.ep_profile_steps,
                         trace_dir=args.ep_trace_dir, rounds=args.ep_rounds)


def _print_table(rows: list[dict]) -> None:
    """One table per kind of row (the rows of a kind share columns: a profile's kernels do not
    share the timing rows'), in order of first appearance. Per-step lists stay in the JSON only."""
    from tabulate import tabulate

    kinds: dict[str, list[dict]] = {}
    for r in rows:
        section = str(r.get("section", ""))
        kinds.setdefault(section if section.startswith(("ep profile", "ep timeline")) else "", []).append(r)
    for group in kinds.values():
        cols: list[str] = []
        for r in group:
            cols += [k for k, v in r.items() if k not in cols and not isinstance(v, list)]
        print(tabulate([[r.get(c, "") for c in cols] for r in group], headers=cols, floatfmt=".3f"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = usage.ArgumentParser(prog="ray-moe bench layer", description=__doc__.splitlines()[0])
    for name, default in asdict(LayerShape()).items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-ms", type=int, default=100)
    p.add_argument("--rep-ms", type=int, default=400)
    p.add_argument("--sections", default="kernels,expert,ffn,routing,saved",
                   help="comma list of kernels,expert,ffn,routing,saved,layer,small,profile,steady,wgrad,fp8,rows,ep,epilogue (kernels runs first;"
                   " with --sweep the fastest tiles it finds are used by expert and ffn). layer: the whole"
                   " MoELayer (W=1) vs SonicMoE, training step; small: inference forward at --small-T vs SonicMoE"
                   " as weight bytes/s against the copy bandwidth; profile: kernel time of one training step;"
                   " steady: training steps back to back with the host side (device idle, waits, API calls);"
                   " wgrad: the weight-gradient GEMMs alone per backend (triton, grouped_mm, quack);"
                   " fp8: each kernel of an FP8 expert step alone beside bf16's (quantise, up, down, dX, dW),"
                   " then the layer and the experts with moe.expert_precision fp8 beside bf16 and torchao's"
                   " FP8 rowwise grouped GEMM (speed-ups and errors, one run);"
                   " rows: the four row GEMMs alone, ray_moe's default plan beside SonicMoE's quack kernels;"
                   " ep: the expert-parallel layer on --world-size ranks;"
                   " epilogue: the expert side with gpt-oss's biases and clamped activation beside SwiGLU")
    p.add_argument("--layer-E", default=None, help="layer/small/profile: comma list of E (default: --E)")
    p.add_argument("--small-T", default="128,1024", help="small: comma list of token counts")
    p.add_argument("--impls", default="ray_moe,sonicmoe", help="layer/small/profile: which layers to run")
    p.add_argument("--sonic-mode", default="full", choices=["full", "forward"],
                   help="layer: SonicMoE forward+backward, or its forward only (its backward GEMMs autotune"
                        " for over ten minutes on a fresh machine)")
    p.add_argument("--sweep", action="store_true", help="time alternative tile configs per kernel")
    p.add_argument("--sweep-roles", default=None,
                   help="with --sweep: comma list of the GEMM roles to sweep (gate_up, down, dact, dx, wgrad13,"
                        " wgrad2; default all); the others keep their default tiles, so the ffn section's"
                        " swept-vs-default A/B measures these roles' tiles alone")
    p.add_argument("--fp8-sweep", action="store_true",
                   help="fp8: time every candidate config (tiles, stages, warps, promotion form, persistent or"
                        " grid) of each FP8 GEMM at the shape, print each winner and its FP8_TILES entry, and"
                        " add the expert side on the winners to the fp8 rows")
    p.add_argument("--fp8-parts", default="kernels,layer",
                   help="fp8: comma list of what the section runs: kernels (each kernel alone beside bf16's),"
                        " layer (the layer and expert rows), ceiling (a library's FP8 GEMM beside bf16's on the"
                        " up-projection's FLOPs as one dense GEMM); --fp8-sweep adds the sweep between them. A sweep of"
                        " all six GEMMs compiles ~50 kernels: split it over runs with --fp8-sweep-gemms and"
                        " --fp8-parts '' (the sweep alone); the Triton cache keeps what one run compiled")
    p.add_argument("--fp8-sweep-gemms", default=None,
                   help=f"with --fp8-sweep: comma list of the FP8 GEMMs to sweep ({', '.join(FP8_GEMMS)};"
                        " default all)")
    p.add_argument("--sonic-precompile", default=None, metavar="DIR",
                   help="no GPU needed: compile every quack GEMM config SonicMoE's autotuner times on sm_90a"
                        " into DIR (carry it as the device's QUACK_CACHE_DIR), then exit")
    p.add_argument("--sonic-precompile-limit", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write the rows and the setup here")
    p.add_argument("--world-size", type=int, default=0,
                   help="with the 'ep' section: ranks of the expert-parallel group (T is global)")
    p.add_argument("--transport", default="auto", help="ep: auto, nvshmem, nccl, gloo")
    p.add_argument("--address", default=None, help="ep: Ray address (default: local cluster)")
    p.add_argument("--impl", default="auto", help="ep: expert impl (auto, triton, grouped_mm, loop)")
    p.add_argument("--device", default="auto", help="ep: auto, cuda, cpu")
    p.add_argument("--ep-iters", type=int, default=10)
    p.add_argument("--ep-rounds", type=int, default=1,
                   help="ep: run the variants this many times, every other round in reverse order, and report"
                        " each timing's median over the rounds (cancels a GPU's drift as it heats)")
    p.add_argument("--ep-programs", default="0",
                   help="ep/nvshmem: comma list of programs (SMs) for the exchange kernels (0: every SM)")
    p.add_argument("--ep-interleave", default="default",
                   help="ep/nvshmem: comma list of 0/1/default: the exchange without / with Tuning.interleave (the"
                        " receiving side's work between the sends) or as the buffer's Tuning has it, side by side")
    p.add_argument("--force-remote-path", action="store_true", help="ep/nvshmem: use the inter-node path")
    p.add_argument("--ep-profile", action="store_true",
                   help="ep: the kernels of one step of every EP variant (rank 0) against a rank's own compute")
    p.add_argument("--ep-trace-dir", default=None,
                   help="ep: with --ep-profile, keep every rank's Chrome trace of each variant in this directory"
                        " (python -m ray_moe.bench.timeline TRACE prints its streams' kernels in time order)")
    p.add_argument("--ep-profile-steps", type=int, default=1,
                   help="ep: with --ep-profile, profile this many steps back to back (steady state), per step")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


SECTIONS = ("kernels", "expert", "ffn", "routing", "saved", "layer", "small", "profile", "steady", "wgrad", "rows",
            "fp8", "ep", "epilogue")


def _check_int_list(p: argparse.ArgumentParser, flag: str, value: str, low: int) -> None:
    """``value`` must be comma-separated integers ≥ ``low``, else one line naming ``flag``."""
    try:
        ints = [int(v) for v in value.split(",")]
    except ValueError:
        p.error(f"{flag}={value!r} must be comma-separated integers")
    if any(v < low for v in ints):
        p.error(f"{flag}={value} must be integers >= {low}")


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad values end here with one line naming the flag and what it allows (exit code 2)."""
    for name in asdict(LayerShape()):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.K > args.E:
        p.error(f"--K {args.K} is larger than --E {args.E}")
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {', '.join(sorted(unknown))}; known: {', '.join(SECTIONS)}")
    if args.sweep_roles is not None:
        if not args.sweep:
            p.error("--sweep-roles needs --sweep (it names the roles the sweep times)")
        bad = set(args.sweep_roles.split(",")) - set(GEMM_ROLES)
        if bad:
            p.error(f"--sweep-roles: unknown {', '.join(sorted(bad))}; known: {', '.join(GEMM_ROLES)}")
    if args.fp8_sweep and "fp8" not in args.sections.split(","):
        p.error("--fp8-sweep needs 'fp8' in --sections (it times the FP8 GEMMs of that section)")
    parts = set(filter(None, args.fp8_parts.split(",")))
    known = {"kernels", "layer", "ceiling"}
    if parts - known:
        p.error(f"--fp8-parts: unknown {', '.join(sorted(parts - known))}; known: {', '.join(sorted(known))}"
                " (--fp8-sweep adds the sweep)")
    if args.fp8_sweep_gemms is not None:
        if not args.fp8_sweep:
            p.error("--fp8-sweep-gemms needs --fp8-sweep (it names the GEMMs the sweep times)")
        bad = set(args.fp8_sweep_gemms.split(",")) - set(FP8_GEMMS)
        if bad:
            p.error(f"--fp8-sweep-gemms: unknown {', '.join(sorted(bad))}; known: {', '.join(FP8_GEMMS)}")
    for flag in ("ep_iters", "ep_rounds", "ep_profile_steps", "warmup_ms", "rep_ms"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if "ep" in args.sections.split(","):
        if args.world_size < 1:
            p.error("--sections ep needs --world-size >= 1 (the ranks of the expert-parallel group)")
        if args.T % args.world_size:
            p.error(f"--T {args.T} is not divisible by --world-size {args.world_size} (T is the global token count)")
        _check_int_list(p, "--ep-programs", args.ep_programs, 0)
        if any(v not in ("0", "1", "default") for v in args.ep_interleave.split(",")):
            p.error(f"--ep-interleave={args.ep_interleave} must be a comma list of 0, 1, default")


def main(argv: list[str]) -> int:
    """CLI entry: ``ray-moe bench layer [--T ...] [--json out.json]``. Returns the exit code."""
    args = parse_args(argv)
    shape = LayerShape(args.T, args.H, args.I, args.E, args.K)
    if args.sonic_precompile:
        for k, v in SONIC_PRECOMPILE_ENV.items():  # read when cutlass / quack are first imported
            os.environ.setdefault(k, v)
        counts = sonic_precompile(shape, args.sonic_precompile, args.sonic_precompile_limit)
        print(json.dumps(counts, indent=1))
        return 1 if any(c["failed"] or not c["configs"] for c in counts.values()) else 0
    sections = set(args.sections.split(","))
    sweep_roles = tuple(args.sweep_roles.split(",")) if args.sweep_roles else GEMM_ROLES
    if sections == {"ep"}:  # the EP rows alone also run on CPU clusters (gloo)
        rows = ep_rows(shape, args)
        _print_table(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"setup": {"shape": asdict(shape), "world_size": args.world_size}, "rows": rows}, f, indent=1)
        return 0
    if not torch.cuda.is_available():
        print("bench layer needs a CUDA GPU (only --sections ep runs without one)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    needs_inp = sections & {"kernels", "expert", "ffn", "routing", "saved", "ep", "epilogue"}
    inp = make_inputs(shape, device, getattr(torch, args.dtype), args.seed) if needs_inp else None
    rows: list[dict] = []
    plan = None
    if "kernels" in sections:
        new, plan = kernel_rows(shape, inp, args.warmup_ms, args.rep_ms, args.sweep, sweep_roles)
        _print_table(new)
        print(f"plan used below: {plan}\n", flush=True)
        rows += new
        rows.append({"section": "plan", "what": repr(plan)})
        _write_json(args.json, shape, args, rows)
    steps = [
        ("expert", lambda: expert_compute_rows(shape, inp, args.warmup_ms, args.rep_ms, plan)),
        ("ffn", lambda: expert_ffn_rows(shape, inp, args.warmup_ms, args.rep_ms, plan)),
        ("routing", lambda: routing_rows(shape, inp, args.warmup_ms, args.rep_ms)),
        ("saved", lambda: saved_bytes_rows(shape, inp)),
        ("epilogue", lambda: epilogue_rows(shape, inp, args.warmup_ms, args.rep_ms)),
    ]
    for name, step in steps:
        if name in sections:
            new = step()
            _print_table(new)
            print(flush=True)
            rows += new
            _write_json(args.json, shape, args, rows)
            torch.cuda.empty_cache()
    layer_es = [int(e) for e in (args.layer_E or str(shape.E)).split(",")]
    fp8_winners: dict[int, dict] = {}  # E → the FP8 sweep's winners, for that E's fp8 layer rows
    fp8_parts = set(args.fp8_parts.split(","))

    def fp8_sweep(eshape: LayerShape) -> list[dict]:
        gemms = tuple(args.fp8_sweep_gemms.split(",")) if args.fp8_sweep_gemms else tuple(FP8_GEMMS)
        new, fp8_winners[eshape.E] = fp8_sweep_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms, gemms)
        return new

    impls = tuple(args.impls.split(","))
    dtype = getattr(torch, args.dtype)
    if sections & {"layer", "small", "profile", "steady", "wgrad", "rows", "fp8"}:
        inp = None
        torch.cuda.empty_cache()
        print(f"device: {torch.cuda.get_device_name()}; sonicmoe: {sonic_import_error() or 'imports'}", flush=True)
    if "small" in sections:
        copy_gbs = copy_bandwidth_gbs()
        rows.append({"section": "small T", "what": "device copy bandwidth (read + write)", "GB/s": copy_gbs})
        print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    for name_, E in [(n, e) for n in ("layer", "small", "profile", "steady", "wgrad", "rows", "fp8") for e in layer_es]:
        eshape = LayerShape(shape.T, shape.H, shape.I, E, shape.K)
        for name, step in (
            ("layer", lambda eshape=eshape: sonic_layer_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms, impls,
                                               args.sonic_mode)),
            ("small", lambda eshape=eshape: small_t_rows(eshape, [int(t) for t in args.small_T.split(",")], dtype, args.seed,
                                           args.warmup_ms, args.rep_ms, copy_gbs, impls)),
            ("profile", lambda eshape=eshape: profile_rows(eshape, dtype, args.seed, impls=impls)),
            ("steady", lambda eshape=eshape: steady_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms, impls=impls)),
            ("wgrad", lambda eshape=eshape: wgrad_backend_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms)),
            ("rows", lambda eshape=eshape: row_gemm_backend_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms)),
            ("fp8", (lambda eshape=eshape: fp8_ceiling_rows(eshape, args.warmup_ms, args.rep_ms, args.seed))
             if "ceiling" in fp8_parts else None),
            ("fp8", (lambda eshape=eshape: fp8_kernel_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms))
             if "kernels" in fp8_parts else None),
            ("fp8", (lambda eshape=eshape: fp8_sweep(eshape)) if args.fp8_sweep else None),
            ("fp8", (lambda eshape=eshape: fp8_layer_rows(eshape, dtype, args.seed, args.warmup_ms, args.rep_ms,
                                                          tiles=fp8_winners.get(eshape.E)))
             if "layer" in fp8_parts else None),
        ):
            if name in sections and name == name_ and step is not None:
                try:
                    new = step()
                except Exception as exc:  # one failing comparison must not lose the others' rows
                    traceback.print_exc()
                    new = [{"section": f"{name} E={E}", "what": "failed",
                            "note": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}]
                _print_table(new)
                print(flush=True)
                rows += new
                _write_json(args.json, shape, args, rows)
                torch.cuda.empty_cache()
    if "ep" in sections and args.world_size > 0:
        inp = None
        torch.cuda.empty_cache()
        new = ep_rows(shape, args)
        _print_table(new)
        rows += new
    _write_json(args.json, shape, args, rows)
    return 0


def _write_json(path: str | None, shape: LayerShape, args: argparse.Namespace, rows: list[dict]) -> None:
    """The rows so far and the setup (rewritten after each section, so a cut-off run keeps them)."""
    if not path:
        return
    setup = {
        "shape": asdict(shape), "dtype": args.dtype, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "python": platform.python_version(),
    }
    try:
        import triton

        setup["triton"] = triton.__version__
    except ImportError:
        pass
    with open(path, "w") as f:
        json.dump({"setup": setup, "rows": rows}, f, indent=1, default=str)
