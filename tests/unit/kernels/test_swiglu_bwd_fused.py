"""The SwiGLU backward fused into the dact GEMM's epilogue (``swiglu_backward_rows(fused=True)``):
the Hopper descriptor kernel (grid, persistent, persistent + flattened; 1, 2, 4 or 8 epilogue column
slices) and the pointer kernel, under ``TRITON_INTERPRET=1`` (float32, tiny tiles) against
``swiglu_backward_rows_reference``: fresh random inputs, empty experts, every pair to one expert,
uneven counts, odd sizes (the descriptor's K tail; H not a 16-byte row: the pointer fallback),
K = 1, and the zero tail past the last group that keeps the TMA weight gradients on.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

# R, K, S, H, I, pattern
CASES = {
    "random": (9, 3, 5, 32, 32, "random"),  # slot 1 empty, ~20 % of pairs dropped
    "uneven_odd": (11, 2, 3, 36, 19, "random"),  # H not a multiple of block_k, I of block_n
    "all_one_expert": (9, 2, 4, 32, 16, "all_one_expert"),
    "k1_sparse": (6, 1, 8, 32, 16, "sparse"),  # experts with 0 or 1 pair, K = 1
    "pointer_fallback": (11, 2, 3, 37, 19, "random"),  # 37 float32 columns: no descriptor
}


def _configs():
    from ray_moe.kernels.grouped_swiglu import GemmConfig as C

    return {
        **{f"tma chunks{c}": C(16, 128, 16, 2, 4, 2, tma=True, epi_chunks=c) for c in (1, 2, 4, 8)},
        "tma persistent chunks2": C(16, 32, 16, 2, 4, 2, tma=True, persistent=True, epi_chunks=2),
        "tma persistent flatten chunks2": C(16, 32, 16, 2, 4, 2, tma=True, persistent=True, flatten=True, epi_chunks=2),
        "pointer chunks2": C(16, 32, 16, 2, 4, 2, epi_chunks=2),
    }


class _NanEmpty:
    """torch.empty → NaN-filled while active, so that a row the kernels leave unset is not a
    lucky zero of fresh CPU memory."""

    def __enter__(self):
        self.empty = torch.empty
        def nan_empty(*a, **k):
            t = self.empty(*a, **k)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        torch.empty = nan_empty

    def __exit__(self, *exc):
        torch.empty = self.empty


def run_interpreter_checks() -> dict:
    """Runs inside the interpreter subprocess: {case/config: errors} (see the tests below)."""
    import dataclasses

    from ray_moe.kernels import grouped_swiglu as gs
    from ray_moe.kernels import grouped_tma
    from ray_moe.kernels.routing import pair_layout
    from ray_moe.validation.kernels import check_expert_ffn, random_case, rel_err

    launched = []
    real = grouped_tma.launch_rows_tma
    grouped_tma.launch_rows_tma = lambda *a, **k: (launched.append(k["epilogue"]), real(*a, **k))[1]
    out: dict = {}
    try:
        for name, args in CASES.items():
            case = random_case(*args, torch.float32, "cpu", seed=17)
            R, K, S, H, I, _ = args
            lay = pair_layout(case["slot"], S)
            _, h13 = gs.gate_up_swiglu(case["x"], lay, K, case["w13"])
            go = torch.randn(R, H, generator=torch.Generator().manual_seed(5))
            ref = gs.swiglu_backward_rows_reference(go, lay, K, case["weight"], case["w2"], h13)
            nv = int(lay.offsets[-1])
            for cname, cfg in _configs().items():
                launched.clear()
                with _NanEmpty():
                    dh13, aw, dw = gs.swiglu_backward_rows(go, lay, K, case["weight"], case["w2"], h13, cfg=cfg,
                                                           fused=True)
                out[f"{name}/{cname}"] = {
                    "dh13": rel_err(dh13[:nv], ref[0][:nv]), "aw": rel_err(aw[:nv], ref[1][:nv]),
                    "dw": rel_err(dw[:nv], ref[2][:nv]),
                    # the rows past the last group: dh13 / aw zeroed (all fit in ZERO_TAIL here), dw 0
                    "past": float(torch.cat([dh13[nv:].flatten(), aw[nv:].flatten(), dw[nv:]]).abs().max())
                    if nv < R * K else 0.0,
                    "tma": float(gs.EPI_SWIGLU_BWD.value in launched),
                }
        out["zero_tail"] = _zero_tail_check(gs, pair_layout, rel_err)
        # the layer with the fused TMA dact and the TMA weight gradients (which read the zero tail)
        base = gs.default_plan(torch.float32, torch.device("cpu"))
        tma = {r: dict(tma=True) for r in ("wgrad13", "wgrad2")}
        plan = gs.KernelPlan(**{**{r: getattr(base, r) for r in gs.GEMM_ROLES},
                                **{r: dataclasses.replace(getattr(base, r), **kw) for r, kw in tma.items()},
                                "dact": gs.GemmConfig(16, 32, 16, 2, 4, 2, tma=True, epi_chunks=2)},
                             fused_dact=True, dual_wgrad13=True)
        for name in ("random", "uneven_odd"):
            with _NanEmpty():
                out[f"expert_ffn/{name}"] = check_expert_ffn(random_case(*CASES[name], torch.float32, "cpu", seed=3),
                                                             plan=plan)
    finally:
        grouped_tma.launch_rows_tma = real
    return out


def _zero_tail_check(gs, pair_layout, rel_err) -> dict:
    """An EP rank's many empty positions (more than ZERO_TAIL past offsets[S]): every fused form
    zeroes exactly ZERO_TAIL rows of dh13 / aw past the last group and leaves the rest unset."""
    g = torch.Generator().manual_seed(3)
    R, K, S, H, I = 160, 8, 4, 16, 8
    slot = torch.randint(0, S, (R, K), generator=g)
    slot[torch.rand(R, K, generator=g) < 0.9] = -1
    go = torch.randn(R, H, generator=g)
    w13, w2 = torch.randn(S, H, 2 * I, generator=g), torch.randn(S, I, H, generator=g)
    weight = torch.rand(R, K, generator=g) * (slot >= 0)
    lay = pair_layout(slot, S)
    nv, tail = int(lay.offsets[-1]), gs.ZERO_TAIL
    _, h13 = gs.gate_up_swiglu(torch.randn(R, H, generator=g), lay, K, w13)
    ref = gs.swiglu_backward_rows_reference(go, lay, K, weight, w2, h13)
    out = {"tail_fits": float(R * K > nv + tail)}
    for cname, cfg in _configs().items():
        if "chunks1" in cname or "flatten" in cname:
            continue
        with _NanEmpty():
            dh13, aw, dw = gs.swiglu_backward_rows(go, lay, K, weight, w2, h13, cfg=cfg, fused=True)
        out[cname] = {
            "valid": max(rel_err(dh13[:nv], ref[0][:nv]), rel_err(aw[:nv], ref[1][:nv]), rel_err(dw[:nv], ref[2][:nv])),
            "tail": float(torch.cat([dh13[nv:nv + tail].flatten(), aw[nv:nv + tail].flatten(), dw[nv:]]).abs().max()),
            "beyond_unset": float(dh13[nv + tail:].isnan().all() and aw[nv + tail:].isnan().all()),
        }
    return out


INTERPRETER_CHECKS = (sys.executable, os.path.abspath(__file__))


@pytest.fixture(scope="module")
def results(interpreter_scripts) -> dict:
    return interpreter_scripts.json_or_skip(*INTERPRETER_CHECKS)


@pytest.mark.interpreter_script(*INTERPRETER_CHECKS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_swiglu_backward_matches_reference(results, name):
    """Every fused form equals the reference on the valid positions and zeroes the rows past them;
    the descriptor configs ran through the TMA kernel except where the rows forbid descriptors."""
    for cname in _configs():
        r = results[f"{name}/{cname}"]
        assert max(r["dh13"], r["aw"], r["dw"]) < 1e-5 and r["past"] == 0.0, (cname, r)
        assert r["tma"] == float(cname.startswith("tma") and name != "pointer_fallback"), (cname, r)


@pytest.mark.interpreter_script(*INTERPRETER_CHECKS)
def test_fused_swiglu_backward_zeroes_the_tail(results):
    r = dict(results["zero_tail"])
    assert r.pop("tail_fits") == 1.0, r
    assert len(r) == 5, r
    for cname, v in r.items():
        assert v["valid"] < 1e-5 and v["tail"] == 0.0 and v["beyond_unset"] == 1.0, (cname, v)


@pytest.mark.interpreter_script(*INTERPRETER_CHECKS)
@pytest.mark.parametrize("name", ["random", "uneven_odd"])
def test_expert_ffn_fused_tma_dact_with_tma_weight_grads(results, name):
    errs = results[f"expert_ffn/{name}"]
    for key in ("out", "dx", "dweight", "dw13", "dw2"):
        assert errs[key] < 1e-5, (key, errs)


def test_epi_chunks_must_divide_the_tile():
    from ray_moe.kernels.grouped_swiglu import GemmConfig

    GemmConfig(128, 256, 64, epi_chunks=4)
    for bad in (dict(epi_chunks=3), dict(epi_chunks=16), dict(block_n=32, epi_chunks=4)):
        with pytest.raises(ValueError):
            GemmConfig(**{"block_m": 128, "block_n": 128, **bad})


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run through pytest (sets TRITON_INTERPRET=1 for this subprocess)")
    print(json.dumps(run_interpreter_checks()))
