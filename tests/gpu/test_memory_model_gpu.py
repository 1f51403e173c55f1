"""The memory model of ``python -m ray_moe.arch`` against the GPU: ``ArchSpec.peak_bytes_per_rank``
(training state + activations with the backward working set + the loss's logits) must be within
10 % of ``torch.cuda.max_memory_allocated`` over a training step of Qwen3-30B-A3B's real shape
(vocabulary included) cut to 2 and 4 layers, one rank (all 128 experts), 8 x 1024 tokens.

Writes ``$OUT/memory_model.json`` (measured, predicted and their parts) when ``OUT`` is set."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
TOKENS, SEQ = 8192, 1024


@pytest.mark.parametrize("layers", [2, 4])
@pytest.mark.parametrize("checkpointing,moments", [("full", "float32"), ("none", "float32"), ("full", "bfloat16")])
def test_memory_model_within_ten_percent_of_the_gpu(tmp_path, layers, checkpointing, moments):
    from ray_moe.arch import ArchSpec, preset
    from ray_moe.comm.local import LocalTransport
    from ray_moe.config import Config
    from ray_moe.worker.engine import Engine
    from tests.support import single_rank

    hf = dict(preset("qwen3-30b-a3b"), num_hidden_layers=layers)
    spec = ArchSpec.from_hf(hf)
    cfg = Config.from_dict({
        "model": {"hf": hf, "seq_len": SEQ, "dtype": "bfloat16", "activation_checkpointing": checkpointing},
        "moe": {"aux_loss_coef": 0.001},
        "parallel": {"world_size": 1, "device": "cuda"},
        "data": {"max_bytes": 4_000_000},
        "train": {"batch_size": TOKENS // SEQ, "steps": 100, "loss_impl": "chunked", "optimizer_state_dtype": moments,
                  "run_dir": str(tmp_path / "run"), "plots": False},
    })
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(cfg, single_rank(), LocalTransport(), CUDA, cfg.resolve_arch())
    engine.train_step()  # the first step makes the optimizer state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine.train_step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    predicted = spec.peak_bytes_per_rank(1, TOKENS, checkpointing, moments=moments)
    row = {"layers": layers, "checkpointing": checkpointing, "moments": moments, "measured": measured,
           "predicted": predicted["peak"], "ratio": measured / predicted["peak"],
           **{k: predicted[k] for k in ("backward_bytes", "update_bytes", "activations", "loss_forward")}}
    print(json.dumps(row))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "memory_model.json"), "a") as f:
            f.write(json.dumps(row) + "\n")
    del engine
    torch.cuda.empty_cache()
    assert abs(measured / predicted["peak"] - 1) <= 0.10, row
