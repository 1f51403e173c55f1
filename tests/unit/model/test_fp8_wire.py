"""FP8 rows on the wire (``moe.expert_precision: fp8``, ``fp8_wire``) at one rank, the CPU path
emulating the numerics: the layer equals the FP8 layer without the wire within float32 round-off
(dW13 on the wire's values, see :mod:`tests.fp8_wire`), the dispatch's bytes fall to
(H + 4·H/128) / (2·H) of bf16's, the packed rows are the quantisation's bytes, and the dispatch's
backward returns x's dtype. W=2 and W=3 over gloo: tests/cluster/test_fp8_parity.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ray_moe.comm.base import dispatch_payload
from ray_moe.comm.local import LocalTransport
from ray_moe.kernels import fp8_quant as Q
from ray_moe.model.moe import MoELayerSpec
from ray_moe.validation import Case
from tests.fp8_wire import dispatch_bytes, fp8_wire_parity

ROUND_OFF = 1e-5


def _worker():
    return SimpleNamespace(transport=LocalTransport(), device=torch.device("cpu"))


@pytest.mark.parametrize("routing,dtype", [("random", "float32"), ("empty_expert", "float32"), ("random", "bfloat16")])
def test_wire_layer_equals_the_fp8_layer_at_one_rank(routing, dtype):
    case = Case(seed=3, routing=routing, top_k=2, hidden=128, expert_hidden=128, num_experts=4,
                tokens_per_rank=(21,), expert_precision="fp8", dtype=dtype)
    errs = fp8_wire_parity(_worker(), case)
    assert errs and all(v <= ROUND_OFF for v in errs.values()), errs


def test_dispatch_bytes_fall_to_the_fp8_rows_share():
    H = 256
    case = Case(seed=1, hidden=H, expert_hidden=128, num_experts=4, top_k=2, tokens_per_rank=(10,),
                expert_precision="fp8")
    sizes = dispatch_bytes(_worker(), case)
    assert sizes["bf16"] == 10 * 2 * H
    assert sizes["fp8"] * (2 * H) == sizes["bf16"] * (H + 4 * H // 128)  # 0.516 of bf16's


def test_packed_rows_are_the_quantisation_and_the_backward_is_bf16():
    torch.manual_seed(0)
    x = torch.randn(7, 256, dtype=torch.bfloat16, requires_grad=True)
    packed = Q.pack_rows(x.detach(), Q.quantize_rows_reference)
    assert packed.dtype == torch.uint8 and packed.shape == (7, Q.wire_row_bytes(256)) == (7, 264)
    q, s = Q.packed_views(packed, 256)
    q_ref, s_ref = Q.quantize_rows_reference(x.detach())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert q.data_ptr() == packed.data_ptr()  # a view, no copy
    weight = torch.full((7, 2), 0.5)
    slot = torch.tensor([[0, 1]] * 7, dtype=torch.int32)
    stand_in, recv_p, recv_slot, recv_w, _ = dispatch_payload(LocalTransport(), x, packed, weight,
                                                              torch.zeros_like(slot), slot)
    assert stand_in.shape == x.shape and stand_in.dtype == torch.bfloat16 and torch.equal(recv_p, packed)
    g = torch.randn(7, 256, dtype=torch.bfloat16)
    (stand_in.float() * g.float()).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, g)


def test_wire_needs_a_hidden_size_the_scales_align_to():
    with pytest.raises(ValueError, match="hidden % 4"):
        MoELayerSpec(130, 4, 2, 128, expert_precision="fp8")
    MoELayerSpec(130, 4, 2, 128, expert_precision="fp8", fp8_wire=False)
