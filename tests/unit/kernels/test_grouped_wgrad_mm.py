"""The grouped_mm weight-gradient path (``grouped_wgrad_mm``) against its reference, on CPU."""

from __future__ import annotations

import pytest
import torch

from ray_moe.validation import rel_err
from tests.kernel_cases import random_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["random", "all_one_expert", "sparse"])
def test_grouped_wgrad_mm_matches_reference(dtype, pattern):
    """dW through torch._grouped_mm equals the reference, empty slots exactly zero, both sides."""
    from ray_moe.kernels.grouped_swiglu import grouped_wgrad_mm, grouped_wgrad_reference
    from ray_moe.kernels.routing import pair_layout_reference

    R, K, S = (3, 2, 8) if pattern == "sparse" else (13, 3, 5)
    c = random_case(R, K, S, 40, 24, pattern, dtype, "cpu", seed=7)
    lay = pair_layout_reference(c["slot"], S)
    b = torch.randn(R * K, 48).to(dtype)
    a = torch.randn(R * K, 24).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for args in ((c["x"], b, lay, K, True, False), (a, c["x"], lay, K, False, True)):
        got, ref = grouped_wgrad_mm(*args), grouped_wgrad_reference(*args)
        assert rel_err(got, ref) < tol
        empty = lay.offsets[1:] == lay.offsets[:-1]
        assert got[empty].abs().max().item() == 0 if empty.any() else True


def test_grouped_wgrad_mm_names_the_row_rule():
    from ray_moe.kernels.grouped_swiglu import grouped_wgrad_mm
    from ray_moe.kernels.routing import pair_layout_reference

    c = random_case(5, 2, 3, 37, 19, "random", torch.float32, "cpu", seed=1)
    lay = pair_layout_reference(c["slot"], 3)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        grouped_wgrad_mm(c["x"], torch.randn(10, 38), lay, 2, True, False)


def _fake_quack(monkeypatch):
    """quack's varlen-K gemm as the library documents it (pure torch): out[s] = A[:, A_idx[k]] @ B[k]
    over k in [cu_seqlens_k[s], cu_seqlens_k[s+1]), written into ``out`` (any strides)."""
    import sys
    import types

    def gemm(A, B, out=None, cu_seqlens_k=None, A_idx=None, **kw):
        assert not kw and A.stride(0) == 1 and A_idx.dtype == torch.int32  # m-major A, as quack asserts
        off = cu_seqlens_k.tolist()
        for s in range(len(off) - 1):
            idx = A_idx[off[s]:off[s + 1]].long()
            out[s].copy_((A[:, idx].float() @ B[off[s]:off[s + 1]].float()).to(out.dtype))
        return out

    gi = types.ModuleType("quack.gemm_interface")
    gi.gemm = gemm
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", gi)


@pytest.mark.parametrize("pattern", ["random", "sparse"])
def test_grouped_wgrad_quack_maps_both_weight_gradients(monkeypatch, pattern):
    """The quack backend's operand mapping (gathered side as A, dW2 through the transposed view)
    against the reference, through a pure-torch stand-in of quack's documented gemm; the
    library itself runs in tests/gpu."""
    from ray_moe.kernels.grouped_swiglu import grouped_wgrad_reference
    from ray_moe.kernels.quack_wgrad import grouped_wgrad_quack
    from ray_moe.kernels.routing import pair_layout_reference

    _fake_quack(monkeypatch)
    R, K, S = (3, 2, 8) if pattern == "sparse" else (13, 3, 5)
    c = random_case(R, K, S, 40, 24, pattern, torch.bfloat16, "cpu", seed=7)
    lay = pair_layout_reference(c["slot"], S)
    b = torch.randn(R * K, 48).to(torch.bfloat16)
    a = torch.randn(R * K, 24).to(torch.bfloat16)
    for args in ((c["x"], b, lay, K, True, False), (a, c["x"], lay, K, False, True)):
        got, ref = grouped_wgrad_quack(*args), grouped_wgrad_reference(*args)
        assert got.shape == ref.shape and got.is_contiguous()
        assert rel_err(got, ref) < 1e-2
    with pytest.raises(ValueError, match="exactly one gathered operand"):
        grouped_wgrad_quack(a, a, lay, K, False, False)
