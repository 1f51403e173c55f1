"""``moe.two_batch_overlap`` on one process: the staggered half batches give the blocks' one-pass
results (hidden states, the auxiliary loss over both halves, every gradient, each token's load
counted once) under every checkpointing mode; the config refuses it beside chunks or early experts.
Against transformers at W=2 on gloo: tests/cluster/test_hf_models.py."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.config import ConfigError
from ray_moe.validation.errors import rel_err
from tests.support import build, small_config


def _run(cfg, ids):
    model = build(cfg, LocalTransport())
    h, aux = model.hidden_states(ids)
    (h.float().square().mean() + aux).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = torch.stack([m.expert_tokens.clone() for m in model.moe_layers()])
    pairs = torch.stack([m.received_pairs.clone() for m in model.moe_layers()])
    return h.detach(), aux.detach(), grads, counts, pairs


@pytest.mark.parametrize("batch", [2, 3])
@pytest.mark.parametrize("mode", ["none", "moe", "full"])
def test_two_halves_give_the_one_pass_results(tmp_path, mode, batch):
    ids = torch.randint(0, 256, (batch, 24), generator=torch.Generator().manual_seed(batch))
    runs = [_run(small_config(tmp_path, world_size=1, **{"moe.two_batch_overlap": tbo, "moe.aux_loss_coef": 0.01,
                                                         "model.activation_checkpointing": mode,
                                                         "model.n_layers": 3}), ids)
            for tbo in (False, True)]
    (h0, aux0, g0, c0, p0), (h1, aux1, g1, c1, p1) = runs
    assert rel_err(h1, h0) <= 1e-6
    assert aux0 > 0 and rel_err(aux1, aux0) <= 1e-6  # one loss over both halves, not a sum of two
    assert g0.keys() == g1.keys() and any(".w13" in n for n in g0)
    for name, g in g0.items():
        assert rel_err(g1[name], g) <= 1e-5, name
    assert torch.equal(c1, c0) and torch.equal(p1, p0) and c0.sum() == 3 * ids.numel() * 2


@pytest.mark.parametrize("tbo", [False, True])
def test_each_blocks_pre_hooks_run_before_its_compute(tmp_path, tbo):
    """A block's forward pre-hooks (train.overlap_update's wait for the block's parameters is one)
    run once per forward, before any of the block's submodules, on the staged two-batch path as on
    the one-pass path: the staged path does not call the block module."""
    model = build(small_config(tmp_path, world_size=1, **{"moe.two_batch_overlap": tbo, "model.n_layers": 3}),
                  LocalTransport())
    log = []
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda *_, i=i: log.append(("pre", i)))
        for child in block.children():
            child.register_forward_pre_hook(lambda *_, i=i: log.append(("compute", i)))
    model.hidden_states(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)))
    assert [e for e in log if e[0] == "pre"] == [("pre", i) for i in range(3)]
    for i in range(3):
        assert log.index(("pre", i)) < log.index(("compute", i)), log


def test_one_sequence_runs_the_blocks_in_one_pass(tmp_path):
    """With one sequence per rank there is nothing to stagger: the sequential blocks run."""
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    h0 = _run(small_config(tmp_path, world_size=1), ids)[0]
    h1 = _run(small_config(tmp_path, world_size=1, **{"moe.two_batch_overlap": True}), ids)[0]
    assert torch.equal(h0, h1)


@pytest.mark.parametrize("other", ["moe.pipeline_chunks=2", "moe.early_experts=4"])
def test_config_refuses_two_batch_beside_chunks_or_early_experts(tmp_path, other):
    with pytest.raises(ConfigError, match="moe.two_batch_overlap runs the sequential layer's exchange"):
        small_config(tmp_path, world_size=1, **{"moe.two_batch_overlap": True, other.split("=")[0]: other.split("=")[1]})
    with pytest.raises(ConfigError, match="moe.two_batch_overlap='yes' must be true or false"):
        small_config(tmp_path, world_size=1, **{"moe.two_batch_overlap": "'yes'"})


def test_the_trainer_advises_fewer_exchange_sms_for_two_batch(tmp_path):
    """One warning line where the two halves meet NVSHMEM exchanges on every SM, none elsewhere."""
    from ray_moe.comm.base import TransportSpec
    from ray_moe.driver.trainer import two_batch_advice

    on = small_config(tmp_path, world_size=1, **{"moe.two_batch_overlap": True})
    off = small_config(tmp_path, world_size=1)
    every_sm, some = TransportSpec("nvshmem"), TransportSpec("nvshmem", comm_programs=32)
    assert "parallel.comm_programs: 32" in two_batch_advice(on, every_sm)
    assert two_batch_advice(on, some) is None and two_batch_advice(off, every_sm) is None
    assert two_batch_advice(on, TransportSpec("gloo")) is None and two_batch_advice(on, None) is None
