"""Training with FP8 experts on one process (the CPU path): the loss stays finite and falls, the
experts' weights move, and each layer quantises its weights once per step (after the update), not
once per GEMM or micro-batch."""

from __future__ import annotations

from pathlib import Path

import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.worker.engine import Engine
from tests.support import single_rank, small_config


def test_fp8_experts_train_and_quantise_once_per_step(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(Path(__file__).read_bytes() * 8)
    cfg = small_config(tmp_path, world_size=1, **{"data.paths": str(corpus), "moe.expert_hidden": 128,
                                                  "moe.expert_precision": "fp8", "train.batch_size": 4})
    e = Engine(cfg, single_rank(), LocalTransport(), torch.device("cpu"), cfg.resolve_arch())
    layers = e.model.moe_layers()
    assert layers and all(layer.fp8_weights is not None for layer in layers)
    w13 = layers[0].w13.detach().clone()
    losses = [float(e.train_step()["loss"]) for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert not torch.equal(layers[0].w13, w13)
    assert all(layer.fp8_weights.quantizations == 4 for layer in layers)
