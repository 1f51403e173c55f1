"""Place a bf16 family parity miss: one family's bf16 model against transformers' float32 model, with
the expert implementation, the attention kernel and compilation swapped one at a time.

    python -m tests.gpu.bf16_paths gpt_oss [FAMILY ...] [--device cpu]

Prints, per variant, the logits' relative error and the four errors nearest their bound
(:func:`tests.hf_parity.bf16_bounds`, the GPU test's) and the TF32 settings, and writes all of it to
``$OUT/bf16_paths.json`` when OUT is set. A variant whose errors drop to transformers' own names the
path at fault. Variants: ``auto`` (the defaults: Triton experts and compiled blocks on a Hopper GPU),
``eager`` (blocks uncompiled), then eager with SDPA in place of flex attention, with the loop or
grouped_mm experts, and in float32 (TF32 off).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from types import SimpleNamespace

import torch

import ray_moe.model.attention as attention
from ray_moe.comm.local import LocalTransport
from tests.gpu.test_models_gpu import one_rank_case, transformers_bf16_errors
from tests.hf_parity import bf16_bounds, model_parity
from tests.support import single_rank

EAGER = {"model.compile": "none"}
# name → (config overrides, SDPA in place of flex attention)
VARIANTS = {
    "auto": ({}, False),
    "eager": (EAGER, False),
    "eager_sdpa": (EAGER, True),
    "eager_loop": ({**EAGER, "moe.expert_impl": "loop"}, False),
    "eager_grouped_mm": ({**EAGER, "moe.expert_impl": "grouped_mm"}, False),
    "eager_sdpa_loop": ({**EAGER, "moe.expert_impl": "loop"}, True),
    "float32_eager_sdpa_loop": ({**EAGER, "moe.expert_impl": "loop", "model.dtype": "float32"}, True),
}


def run_family(family: str, device: str, workdir: str) -> dict:
    """{"transformers_bf16": errors, variant: {"native": errors, ...} or the exception's repr}."""
    base, ids, truth = one_rank_case(family, workdir, device)
    hf_err = transformers_bf16_errors(family, base, base.resolve_arch(), ids, truth, device)
    bound = bf16_bounds(hf_err)
    print(f"{family}: transformers bf16 logits {hf_err['logits']:.4f}, worst {max(hf_err.values()):.4f}", flush=True)
    report: dict = {"transformers_bf16": hf_err}
    flex, tf32 = attention._flex, torch.backends.cuda.matmul.allow_tf32
    for name, (overrides, sdpa) in VARIANTS.items():
        t0 = time.time()
        attention._flex = attention._sdpa if sdpa else flex
        torch.backends.cuda.matmul.allow_tf32 = False if "model.dtype" in overrides else tf32
        try:
            cfg = base.with_overrides([f"{k}={v}" for k, v in overrides.items()])
            worker = SimpleNamespace(rank_info=single_rank(), transport=LocalTransport(), device=device)
            ours = model_parity(worker, cfg, cfg.resolve_arch(), ids, truth, with_clones=False)
            native = ours["native"]
            nearest = sorted(((v / bound[k], k, v) for k, v in native.items() if k in bound), reverse=True)[:4]
            report[name] = ours
            print(f"  {name:24s} logits {native['logits']:.4f}; of bound: "
                  + ", ".join(f"{k} {v:.4f} ({r:.2f})" for r, k, v in nearest) + f" [{time.time() - t0:.0f} s]", flush=True)
        except Exception as e:  # a variant that fails is a finding too: keep going
            report[name] = repr(e)
            print(f"  {name:24s} failed: {e!r}", flush=True)
        finally:
            attention._flex, torch.backends.cuda.matmul.allow_tf32 = flex, tf32
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("families", nargs="+", help="HF model types of tests/gpu/test_models_gpu.py's FAMILIES")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    args = p.parse_args()
    # float32 products may run on TF32 whatever allow_tf32 says, where the environment overrides it
    report: dict = {"tf32": {"allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                             **{k: v for k, v in os.environ.items() if "TF32" in k.upper()}}}
    print(f"TF32 settings: {report['tf32']}", flush=True)
    for family in args.families:
        with tempfile.TemporaryDirectory() as workdir:
            report[family] = run_family(family, args.device, workdir)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bf16_paths.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
