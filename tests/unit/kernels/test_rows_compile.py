"""Offline sm_90 compile of the TMA row kernel (``grouped_tma.compile_rows_sm90``, no GPU): the
register/spill table behind the fused dSwiGLU epilogue's slices (docs/KERNELS.md). Spill counts
belong to one compiler: these run with Triton 3.6 (the GPU machine's; its bundled ptxas) and skip
with another (CI has 3.9)."""

from __future__ import annotations

import pytest


def _compile(**cfg_and_epilogue):
    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith("3.6"):
        pytest.skip(f"the spill table was measured with Triton 3.6's compiler, this is Triton {triton.__version__}")
    from ray_moe.kernels.grouped_swiglu import GemmConfig
    from ray_moe.kernels.grouped_tma import compile_rows_sm90

    epilogue = cfg_and_epilogue.pop("epilogue", None)
    cfg = GemmConfig(**{"block_m": 128, "block_k": 64, "group_m": 8, "num_warps": 8, "tma": True, **cfg_and_epilogue})
    try:
        return compile_rows_sm90(cfg) if epilogue is None else compile_rows_sm90(cfg, epilogue=epilogue)
    except (OSError, RuntimeError) as exc:  # no bundled ptxas in an unpacked wheel
        pytest.skip(f"ptxas unavailable: {exc}")


def test_split_dact_gemm_compiles_without_spills():
    from ray_moe.kernels.tiles import EPI_PLAIN

    r = _compile(block_n=256, num_stages=3, epilogue=EPI_PLAIN.value)
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["n_regs"]


@pytest.mark.parametrize("block_n, stages, chunks, max_spill", [
    (256, 3, 4, 256),  # the Hopper dact_fused role: a little spill (192 bytes with Triton 3.6.0)
    (128, 4, 2, 0),    # 128 wide: none from two slices
])
def test_fused_dact_slices_bound_the_spills(block_n, stages, chunks, max_spill):
    whole = _compile(block_n=block_n, num_stages=stages, epi_chunks=1)
    sliced = _compile(block_n=block_n, num_stages=stages, epi_chunks=chunks)
    assert whole["spill_stores"] > 1000  # the whole tile's g and u beside the accumulator do not fit
    assert sliced["spill_stores"] <= max_spill, sliced
