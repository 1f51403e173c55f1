"""``model.dense_precision: fp8`` on a GPU with FP8 tensor cores (torchao's float8 training of the
blocks' dense linears): short bf16 training runs of a GLM-4.5-style model (a dense first layer,
shared experts) from one seed with the dense linears in bf16 and in FP8, eager and with compiled
blocks, and with the routed experts in FP8 as well; the losses stay within FP8's error of bf16's
and fall. Run on the GPU machine with torchao on the path (``. .aobundle/setup.sh``)."""

from __future__ import annotations

import math

import pytest
import torch

from ray_moe.config import Config
from tests.support import engine

pytestmark = pytest.mark.gpu

STEPS = 20


def _needs_fp8_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (sm_89+)")
    pytest.importorskip("torchao.float8")


def _losses(*over: str) -> tuple[list[float], object]:
    cfg = Config().with_overrides([
        "model.hf_config=glm4_moe-tiny", 'model.hf={"moe_intermediate_size": 128, "hidden_size": 256, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512}',
        "model.seq_len=128", "model.dtype=bfloat16", "parallel.world_size=1", "parallel.device=cuda",
        "train.batch_size=8", "train.lr=2e-3", "train.warmup_steps=2", f"train.steps={STEPS}",
        "data.max_bytes=2000000", *over])
    e = engine(cfg, "cuda")
    losses = [float(e.train_step()["loss"]) for _ in range(STEPS)]
    model = e.model
    e.close()
    return losses, model


@pytest.mark.parametrize("compile_mode", ["none", "blocks"])
def test_dense_fp8_trains_beside_bf16(compile_mode):
    _needs_fp8_gpu()
    from torchao.float8.float8_linear import Float8Linear

    bf16, _ = _losses(f"model.compile={compile_mode}")
    fp8, model = _losses(f"model.compile={compile_mode}", "model.dense_precision=fp8")
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == list(model.fp8_dense) and "layers.0.mlp.gate_proj" in converted \
        and "layers.1.mlp.shared_experts.down_proj" in converted and "layers.1.self_attn.o_proj" in converted
    assert all(math.isfinite(v) for v in bf16 + fp8)
    assert fp8[0] != bf16[0] and abs(fp8[0] / bf16[0] - 1) < 0.01, (fp8[0], bf16[0])
    tail = lambda xs: sum(xs[-5:]) / 5  # noqa: E731
    assert tail(fp8) < fp8[0] - 0.5 and abs(tail(fp8) / tail(bf16) - 1) < 0.03, (fp8, bf16)


def test_dense_and_expert_fp8_together():
    _needs_fp8_gpu()
    bf16, _ = _losses("model.compile=blocks")
    both, model = _losses("model.compile=blocks", "model.dense_precision=fp8", "moe.expert_precision=fp8")
    assert model.fp8_dense and all(math.isfinite(v) for v in both)
    tail = lambda xs: sum(xs[-5:]) / 5  # noqa: E731
    assert tail(both) < both[0] - 0.5 and abs(tail(both) / tail(bf16) - 1) < 0.03, (both, bf16)


def _backward_peak(linear: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> int:
    """Bytes allocated at the peak of ``linear``'s backward above what is live when it starts."""
    y = linear(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y.backward(grad)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_memory_model_bounds_the_fp8_linear_backward():
    """Qwen3-30B-A3B's q_proj (2048 → 4096) at 16,384 tokens, eager: torchao's backward holds
    more than bf16's and no more than the memory model's FP8 dense copies
    (``ArchSpec.fp8_dense_backward_bytes_per_token``) beyond it."""
    _needs_fp8_gpu()
    from torchao.float8 import convert_to_float8_training

    from ray_moe.arch import ArchSpec, load_hf_config

    spec = ArchSpec.from_hf(load_hf_config("qwen3-30b-a3b"))
    T, (K, N) = 16384, spec.dense_linear_shapes()[0]
    torch.manual_seed(0)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    bf16 = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = convert_to_float8_training(torch.nn.Sequential(
        torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)))
    peaks = {}
    for name, linear in (("bf16", bf16), ("fp8", fp8)):
        _backward_peak(linear, x, grad)  # first call: workspaces and scale buffers
        x.grad = None
        for p in linear.parameters():
            p.grad = None
        peaks[name] = _backward_peak(linear, x, grad)
        x.grad = None
        for p in linear.parameters():
            p.grad = None
    extra = peaks["fp8"] - peaks["bf16"]
    assert 0 < extra <= T * spec.fp8_dense_backward_bytes_per_token(), (peaks, T * (K + N))
    print(f"FP8 linear backward {K}->{N}, {T} tokens: {extra / T:.0f} B/token above bf16's; "
          f"the memory model counts {spec.fp8_dense_backward_bytes_per_token():.0f}")
