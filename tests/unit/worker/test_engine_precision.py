"""The engine with bf16 compute and float32 masters on one process (W = 1, LocalTransport): a skipped
step touches nothing, parameters are the rounded masters, resume is exact, old checkpoints load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.worker.engine import Engine
from tests.support import single_rank, small_config


def _engine(tmp_path: Path, **over) -> Engine:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_bytes(Path(__file__).read_bytes() * 4)
    cfg = small_config(tmp_path, world_size=1, **{"data.paths": str(corpus), "model.dtype": "bfloat16",
                                                  "train.batch_size": 4, **over})
    return Engine(cfg, single_rank(), LocalTransport(), torch.device("cpu"), cfg.resolve_arch())


def _snapshot(e: Engine) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().clone() for n, p in e.model.named_parameters()}
    out.update({f"master.{n}": m.clone() for n, m in e.optimizer.named_masters()})
    for n, m in e.optimizer.named_masters():
        out.update({f"state.{n}.{k}": v.clone() for k, v in e.optimizer.state[m].items()})
    return out


def _rounded_masters(e: Engine) -> bool:
    return all(torch.equal(p, m.to(p.dtype)) for p, m in zip(e.model.parameters(), e.optimizer.masters, strict=True))


# onepass + bfloat16 on one rank: every bf16 gradient read as it is (the optimizer's ``alone``)
@pytest.mark.parametrize("impl,moments", [("auto", "float32"), ("onepass", "float32"), ("auto", "bfloat16"),
                                          ("onepass", "bfloat16")])
def test_skipped_step_leaves_parameters_masters_and_state_untouched(tmp_path, impl, moments):
    e = _engine(tmp_path, **{"train.optimizer_impl": impl, "train.optimizer_state_dtype": moments})
    e.train_step()
    before = _snapshot(e)
    m = e.train_step(poison=True)
    assert m["skipped"] and e.opt_steps == 1
    after = _snapshot(e)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert not e.train_step()["skipped"]
    assert not torch.equal(before["master.lm_head.weight"], e.optimizer.master(e.model.lm_head.weight))


# onepass on one rank: every bf16 gradient read as it is (the optimizer's ``alone``)
@pytest.mark.parametrize("impl,moments", [("auto", "float32"), ("onepass", "float32"), ("auto", "bfloat16"),
                                          ("onepass", "bfloat16")])
def test_bf16_parameters_are_rounded_masters_and_resume_is_exact(tmp_path, impl, moments):
    over = {"train.optimizer_impl": impl, "train.optimizer_state_dtype": moments}
    e = _engine(tmp_path, **over)
    assert e.model.lm_head.weight.dtype == torch.bfloat16
    bf16 = {id(p) for p in e.model.parameters() if p.dtype == torch.bfloat16}
    assert (e.optimizer._one_pass_ids == bf16) == (impl == "onepass")  # one rank: any moment dtype
    assert e.optimizer.master(e.model.lm_head.weight).dtype == torch.float32
    for _ in range(3):
        e.train_step()
    assert _rounded_masters(e)
    saved = e.shard_state()
    assert saved["lm_head.weight"].dtype == torch.float32  # the checkpoint holds the masters
    assert saved["optim.lm_head.weight.exp_avg"].dtype == getattr(torch, moments)  # and the moments as stored
    uninterrupted = [e.train_step()["loss"] for _ in range(2)]
    resumed = _engine(tmp_path, **over)
    resumed.load_state(saved, step=3, opt_steps=3)
    assert _rounded_masters(resumed)
    assert [resumed.train_step()["loss"] for _ in range(2)] == uninterrupted  # bit-identical
    for k, v in e.shard_state().items():
        assert torch.equal(resumed.shard_state()[k], v), k


def test_checkpoint_of_compute_dtype_weights_loads_into_masters(tmp_path):
    old = _engine(tmp_path, **{"train.master_weights": False})
    for _ in range(2):
        old.train_step()
    saved = old.shard_state()
    assert saved["lm_head.weight"].dtype == torch.bfloat16 and "optim.lm_head.weight.exp_avg" in saved
    new = _engine(tmp_path)
    new.load_state(saved, step=2, opt_steps=2)
    assert torch.equal(new.optimizer.master(new.model.lm_head.weight), saved["lm_head.weight"].float())
    assert torch.equal(new.model.lm_head.weight, saved["lm_head.weight"])
    m = new.train_step()
    assert not m["skipped"] and m["step"] == 3


@pytest.mark.parametrize("saved_as,loaded_as", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_moments_of_either_dtype_load_into_the_other(tmp_path, saved_as, loaded_as):
    """A run may switch train.optimizer_state_dtype on resume: the moments are converted."""
    old = _engine(tmp_path, **{"train.optimizer_state_dtype": saved_as})
    for _ in range(2):
        old.train_step()
    saved = old.shard_state()
    new = _engine(tmp_path, **{"train.optimizer_state_dtype": loaded_as})
    new.load_state(saved, step=2, opt_steps=2)
    m = new.optimizer.master(new.model.lm_head.weight)
    state = new.optimizer.state[m]
    assert state["exp_avg"].dtype == getattr(torch, loaded_as)
    torch.testing.assert_close(state["exp_avg"].float(), saved["optim.lm_head.weight.exp_avg"].float(),
                               rtol=2 ** -8, atol=0)
    assert torch.isfinite(torch.tensor(new.train_step()["loss"]))
    assert int(new.optimizer.state[m]["step"]) == 3
