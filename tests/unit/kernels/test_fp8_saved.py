"""What the FP8 experts keep for backward, and the memory model's count of it (CPU path, which
emulates the FP8 numerics): x is kept as the FP8 rows and scales the up-projection read, not in
x's dtype; the gradients then equal those of rows received already quantised (the wire's); the
memory model's FP8 weight cache and saved rows are the bytes the kernels really hold."""

from __future__ import annotations

import pytest
import torch

from ray_moe.arch import ArchError, ArchSpec, fp8_row_bytes
from ray_moe.kernels import fp8_quant as Q
from ray_moe.kernels.fp8_expert_ffn import REFERENCE_OPS, expert_ffn_fp8, quantize_expert_weights


def _problem(R=20, K=2, S=3, H=392, I=128, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    slot = torch.randint(0, S, (R, K), generator=g)
    x = torch.randn(R, H, generator=g).to(dtype)
    w13 = (torch.randn(S, H, 2 * I, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(S, I, H, generator=g) / I ** 0.5).to(dtype)
    weight = torch.rand(R, K, generator=g)
    return x, slot, weight, w13, w2, torch.randn(R, H, generator=g).to(dtype)


def _saved_by(fn):
    """(fn's result, the tensors autograd saved while it ran)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x_is_kept_as_its_fp8_rows_not_in_its_dtype(dtype):
    x, slot, weight, w13, w2, _ = _problem(dtype=dtype)
    R, H = x.shape
    leaves = [t.clone().requires_grad_() for t in (x, weight, w13, w2)]
    _, saved = _saved_by(lambda: expert_ffn_fp8(leaves[0], slot, *leaves[1:]))
    assert not any(t.shape == (R, H) and t.dtype == dtype for t in saved), [(t.dtype, t.shape) for t in saved]
    rows = [t for t in saved if t.dtype == Q.FP8_DTYPE and t.shape == (R, H)]
    scales = [t for t in saved if t.dtype == torch.float32 and t.shape == (R, -(-H // 128))]
    assert len(rows) == 1 and len(scales) == 1
    assert rows[0].nbytes + scales[0].nbytes == R * fp8_row_bytes(H)  # the memory model's count
    assert torch.equal(rows[0].view(torch.uint8), Q.quantize_rows_reference(x)[0].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_rows_received_in_fp8(dtype):
    """Quantised here or on the wire (``x_fp8``), the experts see and keep the same FP8 rows: the
    output and every gradient agree exactly."""
    x, slot, weight, w13, w2, go = _problem(seed=1, dtype=dtype)
    results = []
    for wire in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, weight, w13, w2)]
        x_fp8 = Q.quantize_rows_reference(x) if wire else None
        out = expert_ffn_fp8(leaves[0], slot, *leaves[1:], x_fp8=x_fp8)
        results.append([out, *torch.autograd.grad(out, leaves, go)])
    for name, a, b in zip(("out", "x", "weight", "w13", "w2"), *results):
        assert torch.equal(a, b), name


def _spec(H=200, I=128, E=4, layers=2, K=2) -> ArchSpec:
    return ArchSpec.byte(vocab_size=256, d_model=H, n_heads=4, n_layers=layers, seq_len=16, num_experts=E,
                         top_k=K, expert_hidden=I)


def test_memory_model_counts_the_fp8_weight_cache_the_layer_holds():
    spec = _spec()
    H, I, E = spec.hidden_size, spec.expert_hidden, spec.num_experts
    w13, w2 = torch.randn(E, H, 2 * I), torch.randn(E, I, H)
    cache = sum(t.nbytes for t in quantize_expert_weights(w13, w2, REFERENCE_OPS))
    assert spec.fp8_expert_cache_bytes() * E == cache
    bf16, fp8 = spec.memory_per_rank(2), spec.memory_per_rank(2, expert_precision="fp8", clone_slots=0)
    assert bf16["fp8_weights"] == 0 and fp8["fp8_weights"] == 2 * (E // 2) * spec.fp8_expert_cache_bytes()
    assert fp8["backward_bytes"] - bf16["backward_bytes"] == fp8["fp8_weights"]
    cloned = spec.memory_per_rank(2, 1, expert_precision="fp8")  # a clone slot is quantised too
    assert cloned["fp8_weights"] == 2 * (E // 2 + 1) * spec.fp8_expert_cache_bytes()


@pytest.mark.parametrize("world_size", [1, 4])
def test_memory_model_counts_the_saved_rows_in_fp8(world_size):
    spec = _spec()
    H, K = spec.hidden_size, spec.top_k
    ranks = min(K, world_size) if world_size > 1 else 1
    per_layer = (2 * H - fp8_row_bytes(H)) * ranks  # bf16 row → E4M3 + float32 scales, per receiving rank
    for mode, layers in (("none", 2), ("moe", 1), ("full", 1)):
        bf16 = spec.activation_bytes_per_token(mode, world_size)
        fp8 = spec.activation_bytes_per_token(mode, world_size, expert_precision="fp8")
        assert bf16 - fp8 == pytest.approx(layers * per_layer), mode
    peak_bf16 = spec.peak_bytes_per_rank(world_size, 1024, "none")
    peak_fp8 = spec.peak_bytes_per_rank(world_size, 1024, "none", expert_precision="fp8")
    assert peak_fp8["fp8_weights"] > 0 and peak_fp8["peak"] != peak_bf16["peak"]
    with pytest.raises(ArchError, match="expert_precision='fp16' is not allowed"):
        spec.activation_bytes_per_token("none", 1, expert_precision="fp16")
