"""zero_empty_groups: only the empty groups' blocks become zero. The Triton kernel runs under
Triton's interpreter in the background (tests/interpreter_scripts.py) and is also compiled for
sm_90 here; the torch reference is checked directly."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.support import compile_for_sm90

_SCRIPT = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from ray_moe.kernels.empty_groups import zero_empty_groups, zero_empty_groups_reference
g = torch.Generator().manual_seed(3)
# groups of 5 x 7 (per group not a multiple of the block, nor of the programs per group);
# empty groups first, in the middle, last; all empty; none empty; one group
for counts in ([0, 3, 0, 0, 2, 1, 0], [0, 0, 0], [4, 1, 2], [0], [5]):
    S = len(counts)
    offs = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((S, 5, 7), float("nan"), dtype=dtype)
        out[torch.tensor(counts) > 0] = torch.randn(int((torch.tensor(counts) > 0).sum()), 5, 7, generator=g).to(dtype)
        want = zero_empty_groups_reference(out.clone(), offs)
        got = zero_empty_groups(out.clone(), offs)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), counts
        assert not want.isnan().any()
# a group larger than a program's chunk: 8 programs, several blocks each
out = torch.ones(3, 300, 129)
offs = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
zero_empty_groups(out, offs)
assert out[1].abs().sum() == 0 and out[0].eq(1).all() and out[2].eq(1).all()
print("empty groups ok")
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _SCRIPT)
def test_zero_empty_groups_under_the_interpreter(interpreter_scripts):
    interpreter_scripts.assert_prints(_SCRIPT, "empty groups ok")


def test_zero_empty_groups_compiles_for_hopper():
    from ray_moe.kernels.empty_groups import BLOCK, _zero_empty_groups_kernel

    for dt, it in (("*bf16", "*i32"), ("*fp32", "*i64")):
        sig = {"out_ptr": dt, "offs_ptr": it, "per_group": "i64", "chunk": "i64", "BLOCK": "constexpr"}
        assert compile_for_sm90(_zero_empty_groups_kernel, sig, {"BLOCK": BLOCK}, num_warps=4)["cubin"]


def test_zero_empty_groups_on_the_cpu_and_its_argument_rules():
    from ray_moe.kernels.empty_groups import zero_empty_groups

    out = torch.ones(3, 2, 2)
    assert zero_empty_groups(out, torch.tensor([0, 2, 2, 5])) is out
    assert out[1].eq(0).all() and out[0].eq(1).all() and out[2].eq(1).all()
    with pytest.raises(ValueError, match=r"shape \[4\]"):
        zero_empty_groups(out, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="contiguous"):
        zero_empty_groups(out.transpose(1, 2), torch.tensor([0, 1, 2, 3]))
