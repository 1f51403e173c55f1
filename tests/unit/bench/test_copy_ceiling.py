"""The SM copy ceiling (bench/copy_ceiling.py): its kernel writes the source into every
destination and nothing past it, under Triton's interpreter (in the background,
tests/interpreter_scripts.py), and compiles for sm_90 here."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.support import compile_for_sm90

_SCRIPT = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from ray_moe.bench.copy_ceiling import peer_copy
from tests.references import peer_copy_reference
g = torch.Generator().manual_seed(5)
# a size that is not a multiple of the block nor of the programs' stride; one and three peers;
# a multiple of the stride; the smallest
for n, peers, block in ((4 * 1000 + 12, 3, 64), (4 * 777, 1, 128), (4 * 4 * 64, 2, 64), (4, 3, 64)):
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    got = [torch.full((n + 64,), 7, dtype=torch.uint8) for _ in range(peers)]
    want = [t.clone() for t in got]
    peer_copy(src, got, programs=4, block=block)
    peer_copy_reference(src, want)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (n, peers)
    assert all(bool((a[n:] == 7).all()) for a in got)  # nothing past n bytes
print("peer copy ok")
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _SCRIPT)
def test_peer_copy_under_the_interpreter(interpreter_scripts):
    interpreter_scripts.assert_prints(_SCRIPT, "peer copy ok")


def test_peer_copy_compiles_for_hopper():
    from ray_moe.bench.copy_ceiling import _peer_copy_kernel

    sig = {"src_ptr": "*i32", "dst_tbl": "*i64", "n_words": "i64", "PEERS": "constexpr", "BLOCK": "constexpr"}
    assert compile_for_sm90(_peer_copy_kernel, sig, {"PEERS": 3, "BLOCK": 4096}, num_warps=8)["cubin"]


def test_peer_copy_refuses_what_it_cannot_copy():
    from ray_moe.bench.copy_ceiling import peer_copy

    with pytest.raises(ValueError, match="uint8"):
        peer_copy(torch.zeros(8, dtype=torch.int32), [torch.zeros(64, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="multiple of 4"):
        peer_copy(torch.zeros(6, dtype=torch.uint8), [torch.zeros(64, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="needs 8 bytes"):
        peer_copy(torch.zeros(8, dtype=torch.uint8), [torch.zeros(4, dtype=torch.uint8)])
