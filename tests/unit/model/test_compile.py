"""``model.compile=blocks``: each decoder block's dense parts through ``torch.compile`` give the
uncompiled model's logits and every parameter's gradient (fp32, CPU, W=1), for the byte model
and the HF families (a dense block, shared experts), without and with activation checkpointing;
every block shares one graph per region; a KV-cache forward runs them eagerly and decodes as the
whole forward; the MoE layers never enter a graph.

The backend is ``aot_eager`` (dynamo's graphs and AOTAutograd's forward/backward split, no code
generation); all but the small cases run in
a background process (``interpreter_script``) beside the suite. The GPU test
(``tests/gpu/test_compile_gpu.py``) runs inductor in bf16."""

from __future__ import annotations

import sys

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.config import Config
from ray_moe.model.decoder import BlockRegions, DecoderLayer
from tests.support import build, small_config

TOL = 1e-5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from an empty dynamo cache (the regions' caches are per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Counting:
    """A backend that keeps every graph dynamo hands it, then runs it through ``aot_eager``."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs: list) -> object:
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, aux = model(ids)
    (logits.square().mean() + aux).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_same(cfg: Config, ids: torch.Tensor, backend: object, steps: int = 1) -> None:
    """Uncompiled and compiled models of ``cfg``: the same logits and gradients, ``steps`` times."""
    eager, compiled = build(cfg, LocalTransport()), build(cfg, LocalTransport())
    compiled.compile_blocks(backend)
    for _ in range(steps):
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
        (le, ge), (lc, gc) = _step(eager, ids), _step(compiled, ids)
        assert _rel(lc, le) <= TOL
        assert ge.keys() == gc.keys() and any(".self_attn.q_proj" in n for n in ge)
        bad = {n: _rel(gc[n], g) for n, g in ge.items() if not _rel(gc[n], g) <= TOL}
        assert not bad, f"relative gradient errors above {TOL}: {bad}"
    counts = [torch.stack([l.expert_tokens for l in m.moe_layers()]) for m in (eager, compiled)]
    assert torch.equal(*counts)  # the MoE layers (eager) saw the same tokens, each once


def _byte_config(tmp_path, mode: str) -> Config:
    return small_config(tmp_path, world_size=1, **{"model.n_layers": 4, "model.dense_first_layer": True,
                                                  "model.activation_checkpointing": mode, "moe.aux_loss_coef": 0.01})


def _hf_config(family: str, mode: str, compile_: str = "none") -> Config:
    """The tiny ``family`` model (:data:`tests.hf_parity.TINY`, weights from its own
    generator: no transformers needed)."""
    import json

    from tests.hf_parity import TINY

    return Config().with_overrides([f"model.hf={json.dumps(dict(TINY[family]))}", "model.seq_len=12",
                                    f"model.activation_checkpointing={mode}", f"model.compile={compile_}",
                                    "parallel.world_size=1"])


def test_byte_model_compiled_equals_eager(tmp_path):
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    backend = Counting()
    _assert_same(_byte_config(tmp_path, "none"), ids, backend, steps=2)
    # one graph per region (attention half, FFN input norm, dense MLP) for all four blocks and both steps
    assert len(backend.graphs) == 3
    ops = {str(n.target) for g in backend.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert not any("route" in o or "dispatch" in o or "combine" in o for o in ops), ops


_CHECKS_SCRIPT = """
import pathlib
import tempfile
import torch
from ray_moe.comm.local import LocalTransport
from tests.support import build
from tests.unit.model.test_compile import Counting, _assert_same, _byte_config, _hf_config, _rel, _step

# aot_eager: full checkpointing replays the compiled regions (byte: learned positions, its own
# init); glm4_moe with MoE checkpointing: partial RoPE, biases, shared experts (a second MLP shape:
# one more graph). qwen3_moe (full RoPE, q/k norm) is checked with inductor on the GPU (tests/gpu/test_compile_gpu.py).
cases = [("byte", "full", _byte_config(pathlib.Path(tempfile.mkdtemp()), "full"), 3)]
cases += [(f, m, _hf_config(f, m), 4 if f == "glm4_moe" else 3) for f, m in (("glm4_moe", "moe"),)]
for family, mode, cfg, graphs in cases:
    torch._dynamo.reset()
    backend = Counting()
    ids = torch.randint(0, cfg.resolve_arch().spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    _assert_same(cfg, ids, backend, steps=2)
    assert len(backend.graphs) == graphs, (family, mode, len(backend.graphs))
    print("aot_eager ok", family, mode)
"""


@pytest.mark.interpreter_script(sys.executable, "-c", _CHECKS_SCRIPT)
def test_compiled_equals_eager_with_checkpointing_and_hf_families(interpreter_scripts):
    """In a background process: the byte model with full checkpointing, glm4_moe with MoE
    checkpointing (aot_eager, the graph counts per model). Inductor's code
    is checked on the GPU (tests/gpu/test_compile_gpu.py): its C++ build here cost the unit suite
    ~12 s of its 2 cores."""
    r = interpreter_scripts.result(sys.executable, "-c", _CHECKS_SCRIPT)
    assert r.stdout.count("aot_eager ok") == 2, r.stdout + r.stderr[-3000:]


def test_kv_cache_decoding_bypasses_the_compiled_regions(tmp_path):
    cfg = small_config(tmp_path, world_size=1, **{"model.seq_len": 16, "model.compile": "blocks"})
    model = build(cfg, LocalTransport())
    assert model.layers[0].regions.attention is not DecoderLayer.attention_half  # model.compile built them
    backend = Counting()
    model.compile_blocks(backend)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        whole, _ = model.hidden_states(ids)
        graphs = len(backend.graphs)
        cache = model.new_cache(16)
        parts = [model.hidden_states(ids[:, :4], cache)[0]]
        parts += [model.hidden_states(ids[:, t:t + 1], cache)[0] for t in range(4, 16)]
    assert graphs == 2 and len(backend.graphs) == graphs  # the cached forwards compiled nothing
    assert torch.allclose(torch.cat(parts, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_a_compiled_caller_leaves_the_moe_layer_eager(tmp_path):
    """A whole block compiled (as torchtitan does) breaks the graph at the MoE layer, which runs eagerly."""
    model = build(small_config(tmp_path, world_size=1), LocalTransport())
    block, backend = model.layers[0].mlp, Counting()
    x = torch.randn(6, 32)
    got = torch.compile(lambda h: block(h)[0] * 2, backend=backend)(x)
    assert torch.allclose(got, block(x)[0] * 2, rtol=1e-6, atol=1e-6)
    assert backend.graphs and not any(n.op == "call_module" for g in backend.graphs for n in g.graph.nodes)
    ops = {str(n.target) for g in backend.graphs for n in g.graph.nodes}
    assert not any("topk" in o or "index" in o for o in ops), ops


def test_the_uncompiled_model_runs_the_eager_regions_and_names_do_not_change(tmp_path):
    cfg = small_config(tmp_path, world_size=1)
    model = build(cfg, LocalTransport())
    assert all(layer.regions == BlockRegions.eager() for layer in model.layers)
    compiled = build(cfg.with_overrides(["model.compile=blocks"]), LocalTransport())
    assert all(layer.regions != BlockRegions.eager() for layer in compiled.layers)
    assert list(compiled.state_dict()) == list(model.state_dict())  # checkpoints and HF export unchanged


def test_auto_compiles_the_blocks_only_on_cuda(tmp_path, monkeypatch):
    """``model.compile: auto`` (the default) leaves a CPU model's regions eager; the model asks
    ``ModelConfig.compile_on`` with its device's type, so the same config compiles on CUDA
    (``compile_on("cuda") == "blocks"`` is checked in tests/unit/test_config.py)."""
    from ray_moe.config import ModelConfig

    cfg = small_config(tmp_path, world_size=1, **{"model.seq_len": 16})
    assert cfg.model.compile == "auto"
    model = build(cfg, LocalTransport())
    assert model.layers[0].regions.attention is DecoderLayer.attention_half
    asked = []
    monkeypatch.setattr(ModelConfig, "compile_on", lambda self, device_type: asked.append(device_type) or "blocks")
    model = build(cfg, LocalTransport())
    assert asked == ["cpu"] and model.layers[0].regions.attention is not DecoderLayer.attention_half
