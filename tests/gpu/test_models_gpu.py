"""The HF families on a GPU (run on the GPU machine; skipped without CUDA).

- bf16 equality with transformers: ray_moe's model in bf16 (Triton experts where the GPU has
  them) is as close to transformers' fp32 model as transformers' own bf16 model is, for logits
  and gradients, at the native placement and with clones (one rank: LocalTransport).
- incremental decoding on the GPU (bf16, the GPU's expert kernels at T=1): one position at a time
  over the KV cache is as close to the fp32 model's hidden states as the bf16 whole-sequence
  forward is; in fp32, greedy ``Engine.generate`` gives transformers' greedy ``generate``.
- a short training run of each family's tiny job with the Trainer on the GPUs (loss falls).
- the attention kernels of DeepSeek-V3 and gpt-oss (flex attention with sinks and windows, SDPA
  with MLA's padded values) against the SDPA/log-sum-exp path the CPU runs, forward and backward.
- activation memory per token of a Qwen3-30B-A3B-shaped layer for none / moe / full activation
  checkpointing, against :meth:`ray_moe.arch.ArchSpec.activation_bytes_per_token` (printed, and
  written to $OUT/activation_memory.json when OUT is set).
"""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from tests.support import gpu_ranks

pytestmark = pytest.mark.gpu

FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss", "olmoe", "minimax_m2")
# A size where bf16 rounding is realistic but the run takes seconds.
GPU_SIZE = dict(vocab_size=1024, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                max_position_embeddings=512)
PER_FAMILY = {
    "qwen3_moe": dict(head_dim=32, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
                      num_experts_per_tok=4, num_hidden_layers=3),
    "mixtral": dict(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=3),
    "glm4_moe": dict(head_dim=32, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
                     num_experts_per_tok=4, n_group=4, topk_group=2, num_hidden_layers=3),
    # MLA (q/k heads 48 = 32 + 16 rope, values 32: SDPA with v padded), YaRN
    "deepseek_v3": dict(num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                        qk_rope_head_dim=16, v_head_dim=32, intermediate_size=512, moe_intermediate_size=128,
                        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, num_hidden_layers=3),
    # sinks and a 32-position window on layers 0 and 2 (flex attention), biased clamped experts (grouped_mm);
    # layer_types names every layer (transformers refuses a list shorter than num_hidden_layers).
    # The clamp at 3 holds for a few % of the pre-activations. At the tiny model's 1.0 it holds for
    # a third of them, and a float32 rounding that moves one value across the bound flips its
    # derivative: two exact float32 implementations then differ by 2.5e-3 in gradients (CPU,
    # 2026-12-07), and a bf16 comparison says nothing.
    "gpt_oss": dict(head_dim=32, intermediate_size=128, num_local_experts=16, num_experts_per_tok=4,
                    num_hidden_layers=3, sliding_window=32, swiglu_limit=3.0,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "olmoe": dict(intermediate_size=128, num_experts=16, num_experts_per_tok=4, num_hidden_layers=3),
    "minimax_m2": dict(head_dim=32, intermediate_size=128, num_local_experts=16, num_experts_per_tok=4,
                       num_hidden_layers=3, eos_token_id=None, bos_token_id=None),
}
# transformers' gpt-oss has no SDPA path: its bf16 reference is the eager one
HF_BF16_ATTENTION = {"gpt_oss": "eager"}


def gpu_size(family: str) -> dict:
    """The GPU test model's HF keys for ``family``."""
    return {**GPU_SIZE, **PER_FAMILY[family]}


def one_rank_case(family: str, workdir, device: str, dtype: str = "bfloat16"):
    """The one-rank comparison at the GPU test's size: ``family``'s tiny model saved in ``workdir``,
    its ray_moe config (``dtype`` on ``device``), ids int64 [8, 129] and transformers' float32
    reference on ``device`` (:func:`tests.hf_parity.reference`)."""
    from tests.hf_parity import parity_config, reference, save_tiny_model

    save_tiny_model(family, workdir, seed=2, **gpu_size(family))
    B, L = 8, 128
    ids = torch.randint(0, GPU_SIZE["vocab_size"], (B, L + 1), generator=torch.Generator().manual_seed(0))
    cfg = parity_config(workdir, world_size=1, batch=B, seq_len=L, dtype=dtype, device=device)
    truth = reference(cfg, cfg.resolve_arch(), ids, dtype=torch.float32, device=device, attn_implementation="eager")
    return cfg, ids, truth


def transformers_bf16_errors(family: str, cfg, arch, ids: torch.Tensor, truth: dict, device: str) -> dict[str, float]:
    """Relative errors of transformers' own bf16 model against its float32 ``truth`` (same keys)."""
    from ray_moe.validation.errors import rel_err
    from tests.hf_parity import reference

    theirs = reference(cfg, arch, ids, dtype=torch.bfloat16, device=device,
                       attn_implementation=HF_BF16_ATTENTION.get(family, "sdpa"))
    return {k: rel_err(theirs[k], v) for k, v in truth.items()}


def _out(name: str) -> str | None:
    out = os.environ.get("OUT")
    return os.path.join(out, name) if out else None


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_equal_to_transformers_on_gpu(tmp_path, family):
    pytest.importorskip("transformers")
    from ray_moe.comm.local import LocalTransport
    from tests.hf_parity import bf16_bounds, model_parity
    from tests.support import single_rank

    cfg, ids, truth = one_rank_case(family, tmp_path, "cuda")
    hf_err = transformers_bf16_errors(family, cfg, cfg.resolve_arch(), ids, truth, "cuda")
    worker = SimpleNamespace(rank_info=single_rank(), transport=LocalTransport(), device="cuda")
    ours = model_parity(worker, cfg, cfg.resolve_arch(), ids, truth)
    report = {"transformers_bf16": hf_err, **{p: ours[p] for p in ("native", "clones")}}
    print(json.dumps({family: {k: max(v.values()) for k, v in report.items()}}))
    if _out("bf16_families.jsonl"):  # one line per family, one file for all
        with open(_out("bf16_families.jsonl"), "a") as f:
            f.write(json.dumps({"family": family, **report}) + "\n")
    bound = bf16_bounds(hf_err)
    for placement in ("native", "clones"):
        bad = {k: (v, bound[k]) for k, v in ours[placement].items() if not v <= bound[k]}
        assert not bad, f"{family} {placement}: (ours, bound) relative to fp32: {bad}"


@pytest.mark.parametrize("recompute", ["none", "family"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_equal_to_transformers_on_an_nvshmem_group(tmp_path, family, recompute):
    """W ranks over NVSHMEM (two GPUs, or RAY_MOE_PES_PER_GPU ranks on one): each rank's share of the
    batch, bf16, native placement and clones, as close to transformers' float32 model as
    transformers' own bf16 model is (or 2e-2). ``recompute``: no activation checkpointing, or each
    family's mode (none, moe, full)."""
    pytest.importorskip("transformers")
    pytest.importorskip("nvshmem.core")
    from ray_moe.driver.group import WorkerGroup
    from tests.hf_parity import bf16_bounds, model_parity, parity_config, reference, save_tiny_model

    W, per_gpu = gpu_ranks()
    if W < 2:
        pytest.skip("needs two ranks (two GPUs, or RAY_MOE_PES_PER_GPU=2)")
    save_tiny_model(family, tmp_path, seed=2, **gpu_size(family))
    B, L = 4 * W, 64
    ids = torch.randint(0, GPU_SIZE["vocab_size"], (B, L + 1), generator=torch.Generator().manual_seed(1))
    checkpointing = {"qwen3_moe": "none", "mixtral": "moe", "glm4_moe": "full", "deepseek_v3": "full",
                     "gpt_oss": "moe", "olmoe": "none", "minimax_m2": "full"}[family] if recompute == "family" \
        else "none"
    cfg = parity_config(tmp_path, world_size=W, batch=B, seq_len=L, dtype="bfloat16", device="cuda",
                        checkpointing=checkpointing)
    cfg = cfg.with_overrides(["parallel.transport=nvshmem", f"parallel.workers_per_gpu={per_gpu}"])
    arch = cfg.resolve_arch()
    truth = reference(cfg, arch, ids, dtype=torch.float32, device="cuda", attn_implementation="eager")
    hf_err = transformers_bf16_errors(family, cfg, arch, ids, truth, "cuda")
    with WorkerGroup(cfg) as g:
        results = g.execute(model_parity, cfg, arch, ids, truth, timeout=300)
    bound = bf16_bounds(hf_err)
    for rank, ours in enumerate(results):
        for placement in ("native", "clones"):
            bad = {k: (v, bound.get(k, 2e-2)) for k, v in ours[placement].items() if not v <= bound.get(k, 2e-2)}
            assert not bad, f"{family} W={W} rank {rank} {placement}: (ours, bound): {bad}"


@pytest.mark.parametrize("attention", ["kernels", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_equal_to_transformers_on_gpu(tmp_path, monkeypatch, family, attention):
    """float32 on the GPU, blocks uncompiled, TF32 off: ray_moe's model equals transformers'
    float32 model on the same GPU (logits and every gradient within 5e-3, TF32's rounding in
    flex attention's dots; the bf16 test's bounds are ~2e-2). ``attention``: the GPU's kernels
    (flex attention for sinks and windows), or the SDPA form the CPU runs, so that a failure of
    the bf16 test is placed: in the kernels, or in the float32 model on the GPU."""
    pytest.importorskip("transformers")
    import ray_moe.model.attention as attention_module
    from ray_moe.comm.local import LocalTransport
    from tests.hf_parity import model_parity
    from tests.support import single_rank

    if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0").lower() not in ("", "0", "false", "off", "no"):
        pytest.fail("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE is set: cuBLAS runs every float32 matmul in TF32, "
                    "transformers' reference model's too, whatever allow_tf32 says; unset it before Python starts")
    if attention == "sdpa":
        monkeypatch.setattr(attention_module, "_flex", attention_module._sdpa)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cfg, ids, truth = one_rank_case(family, tmp_path, "cuda", dtype="float32")
    cfg = cfg.with_overrides(["model.compile=none"])
    worker = SimpleNamespace(rank_info=single_rank(), transport=LocalTransport(), device="cuda")
    ours = model_parity(worker, cfg, cfg.resolve_arch(), ids, truth)
    print(json.dumps({f"{family}-{attention}": {p: max(ours[p].values()) for p in ("native", "clones")}}))
    for placement in ("native", "clones"):
        bad = {k: v for k, v in ours[placement].items() if not v <= 5e-3}
        assert not bad, f"{family} {placement} ({attention}): relative to transformers' float32: {bad}"


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decoding_on_gpu(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    from ray_moe.comm.local import LocalTransport
    from ray_moe.config import Config
    from ray_moe.validation.errors import rel_err
    from tests.hf_parity import save_tiny_model
    from ray_moe.worker.engine import Engine
    from tests.support import single_rank

    save_tiny_model(family, tmp_path / "hf", seed=3, **gpu_size(family))
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x\n" * 200)

    def engine(dtype: str) -> Engine:
        cfg = Config.from_dict({
            # decoding with a cache always runs the blocks eagerly, so the whole-sequence forward
            # it is held to is the eager one too (the compiled one's error: test_compile_gpu.py)
            "model": {"init_from": str(tmp_path / "hf"), "seq_len": 64, "dtype": dtype, "compile": "none"},
            "parallel": {"world_size": 1, "device": "cuda"}, "data": {"paths": [str(tmp_path / "corpus.txt")]},
            "train": {"batch_size": 2, "steps": 1, "run_dir": str(tmp_path / f"run-{dtype}")}})
        return Engine(cfg, single_rank(), LocalTransport(), torch.device("cuda"), cfg.resolve_arch())

    ids = torch.randint(0, GPU_SIZE["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    truth = engine("float32")
    truth.model.eval()
    e = engine("bfloat16")
    e.model.eval()
    with torch.no_grad():
        exact = truth.model.hidden_states(ids)[0]
        whole, _ = e.model.hidden_states(ids)
        cache = e.model.new_cache(64)
        parts = [e.model.hidden_states(ids[:, :16], cache)[0]]
        parts += [e.model.hidden_states(ids[:, t:t + 1], cache)[0] for t in range(16, 64)]
    err_whole = rel_err(whole.float(), exact)
    err_cached = rel_err(torch.cat(parts, dim=1).float(), exact)
    print(json.dumps({family: {"bf16_whole_vs_fp32": err_whole, "bf16_cached_vs_fp32": err_cached}}))
    assert err_cached <= max(2 * err_whole, 2e-2), (err_cached, err_whole)

    prompt = [5, 17, 42, 7, 99]
    ours = truth.generate(prompt, 24, temperature=0.0, seed=0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]).cuda(), max_new_tokens=24, do_sample=False, num_beams=1,
                           pad_token_id=0, eos_token_id=None)
    assert ours == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family,job,checkpointing", [
    ("qwen3_moe", "jobs/qwen3_moe_tiny.yaml", "none"),
    ("mixtral", "jobs/mixtral_tiny.yaml", "moe"),
    ("glm4_moe", "jobs/glm4_moe_tiny.yaml", "full"),
    ("deepseek_v3", "jobs/deepseek_v3_tiny.yaml", "full"),
    ("gpt_oss", "jobs/gpt_oss_tiny.yaml", "moe"),
])
def test_short_training_run(tmp_path, family, job, checkpointing):
    from ray_moe.config import Config
    from ray_moe.driver.trainer import Trainer

    W, per_gpu = gpu_ranks()
    cfg = Config.from_yaml(job, [
        "parallel.device=cuda", f"parallel.world_size={W}", f"parallel.workers_per_gpu={per_gpu}",
        "model.dtype=bfloat16", "model.seq_len=256",
        f"model.activation_checkpointing={checkpointing}", "train.steps=40", "train.batch_size=16",
        "train.eval_interval=0", "train.checkpoint_interval=0", "train.plots=false", f"train.run_dir={tmp_path}",
        "data.max_bytes=2000000",
    ])
    with Trainer(cfg, progress=False) as t:
        first = t.evaluate()
        t.train()
        last = t.evaluate()
        sample = t.generate("def ", max_new_tokens=24, temperature=0.0)
    print(json.dumps({"family": family, "val_first": first, "val_last": last, "sample": sample}))
    assert all(math.isfinite(m["loss"]) for m in t.metrics if "loss" in m)
    assert last < first - 0.5, (first, last)


def test_activation_memory_per_token():
    """Peak activation memory of fwd+bwd per token and layer, Qwen3-30B-A3B's layer shape (2 MoE
    layers, 128 experts top-8, hidden 2048, GQA 32/4 x 128) at one rank, bf16, 8 x 1024 tokens.
    The model is built once; the modes switch each block's ``checkpointing``."""
    from ray_moe.arch import ArchSpec, preset
    from ray_moe.comm.local import LocalTransport
    from ray_moe.config import Config
    from ray_moe.model.build import build_model

    hf = dict(preset("qwen3-30b-a3b"), num_hidden_layers=2, vocab_size=1024)
    spec = ArchSpec.from_hf(hf)
    B, L = 8, 1024
    ids = torch.randint(0, 1024, (B, L), device="cuda")
    # eager blocks: the activation column of docs/ARCHITECTURE.md's real-size table estimates what eager blocks save
    cfg = Config.from_dict({"model": {"hf": hf, "seq_len": L, "dtype": "bfloat16", "compile": "none"},
                            "parallel": {"world_size": 1, "device": "cuda"}, "train": {"batch_size": B}})
    model = build_model(cfg, cfg.resolve_arch(), LocalTransport(), torch.device("cuda"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    rows = {}
    for mode in ("none", "moe", "full"):
        for layer in model.layers:
            layer.checkpointing = mode
        for _ in range(2):  # the second pass: kernels chosen, allocator warm
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            h, _ = model.hidden_states(ids)
            h.float().square().mean().backward()
            del h
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        rows[mode] = {"measured_bytes_per_token": peak / (B * L),
                      "estimate_bytes_per_token": spec.activation_bytes_per_token(mode, 1)}
    print(json.dumps(rows))
    if _out("activation_memory.json"):
        with open(_out("activation_memory.json"), "w") as f:
            json.dump(rows, f, indent=1)
    assert rows["full"]["measured_bytes_per_token"] < rows["moe"]["measured_bytes_per_token"] \
        < rows["none"]["measured_bytes_per_token"]


def test_byte_model_norm_is_torch_rmsnorm_on_gpu(tmp_path):
    """The byte model (the one decoder with the byte spec) normalises as the old byte model's
    ``torch.nn.RMSNorm`` (default eps) did, in bf16 on the GPU: its norms' outputs are torch's."""
    from ray_moe.comm.local import LocalTransport
    from tests.support import build, small_config

    cfg = small_config(tmp_path, world_size=1, **{"model.dtype": "bfloat16", "parallel.device": "auto"})
    model = build(cfg, LocalTransport(), "cuda")
    x = (torch.randn(64, cfg.model.d_model, device="cuda") * 0.05).bfloat16()
    for norm in (model.norm, model.layers[0].input_layernorm):
        got = norm(x)
        want = torch.nn.RMSNorm(cfg.model.d_model, device="cuda", dtype=torch.bfloat16)(x)
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


@pytest.mark.parametrize("case", ["sinks_window", "sinks_full", "window_only", "mla_dims"])
def test_attention_kernels_on_gpu(case):
    """:func:`ray_moe.model.attention.attend` on CUDA (flex attention, compiled, for sinks and
    windows; SDPA with v zero-padded for MLA's unequal head dims) equals the CPU path (SDPA with a
    boolean mask and the log-sum-exp computed beside it) run in float64, forward and gradients,
    within bf16 rounding; gpt-oss-20b's heads (64/8 of 64 dims, window 128) and DeepSeek-V3's
    (q/k 192, v 128) over 1024 positions."""
    from ray_moe.model.attention import attend
    from ray_moe.validation.errors import rel_err

    g = torch.Generator().manual_seed(0)
    B, L = 2, 1024
    if case == "mla_dims":
        shapes, window, sinks = ((B, 16, L, 192), (B, 16, L, 192), (B, 16, L, 128)), 0, None
    else:
        shapes = ((B, 64, L, 64), (B, 8, L, 64), (B, 8, L, 64))
        window = 0 if case == "sinks_full" else 128
        sinks = None if case == "window_only" else torch.randn(64, generator=g)
    q, k, v = (torch.randn(s, generator=g) for s in shapes)
    grad = torch.randn(shapes[0][:3] + shapes[2][3:], generator=g)
    scale = shapes[0][-1] ** -0.5

    def run(device, dtype):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        s = sinks.to(device, dtype).requires_grad_() if sinks is not None else None
        y = attend(*leaves, scale, window, s)
        y.backward(grad.to(device, dtype))
        return [y] + [t.grad for t in leaves] + ([s.grad] if s is not None else [])

    exact = run("cpu", torch.float64)
    ours = run("cuda", torch.bfloat16)
    errs = [rel_err(a.double().cpu(), b) for a, b in zip(ours, exact)]
    print(json.dumps({case: errs}))
    assert max(errs) < 2e-2, errs
