"""The rank mesh on the CPU (gloo): W = EP x DP training equals the single process, replicas stay
identical, rows move only inside an EP group, checkpoints move between mesh shapes."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.config import ConfigError
from ray_moe.driver.trainer import Trainer
from ray_moe.mesh import MeshSpec
from ray_moe.worker.engine import Engine
from tests.support import single_rank, small_config

RECLONING = ["balance.enabled=true", "balance.interval=3", "balance.clone_slots=1", "balance.ema=0.0"]
STEPS = 8


def _state(worker):
    """The worker's whole checkpoint part (RNG left out), its mesh coordinates and its transport's peers."""
    shard = {k: v for k, v in worker.engine.shard_state().items() if not k.startswith("rng.")}
    weights = {n: p.detach().clone() for n, p in worker.engine.model.named_parameters()}
    return {"shard": shard, "weights": weights, "coords": worker.engine.mesh.coords(worker.rank_info.rank),
            "peers": worker.transport.peers}


def _single(cfg, steps: int):
    """Losses and checkpoint state of the single-process run of ``cfg`` (W=1)."""
    single_cfg = cfg.with_overrides(["parallel.world_size=1", "parallel.expert_parallel=0"])
    engine = Engine(single_cfg, single_rank(), LocalTransport(), torch.device("cpu"), single_cfg.resolve_arch())
    losses = [engine.train_step()["loss"] for _ in range(steps)]
    return losses, {k: v for k, v in engine.shard_state().items() if not k.startswith("rng.")}


def _mesh_config(tmp_path, world: int, ep: int, *extra: str):
    cfg = small_config(tmp_path, **{"parallel.world_size": world,
        "train.steps": STEPS, "train.batch_size": 12 if world % 3 == 0 else 8, "moe.num_experts": 6 if ep == 3 else 4,
        "parallel.expert_parallel": ep})
    return cfg.with_overrides(list(extra))


@pytest.mark.parametrize("world,ep", [(4, 2), (6, 3), (6, 2)], ids=["2x2", "3x2", "2x3"])
def test_mesh_training_equals_single_process(groups, tmp_path, world, ep):
    """EP x DP training with hot-expert clones re-planned every 3 steps equals the single-process
    run: every loss and every weight and moment (1e-6 relative); the DP replicas hold identical
    weights; each rank's transport moves rows among its EP group only."""
    cfg = _mesh_config(tmp_path, world, ep, *RECLONING)
    with Trainer(cfg, progress=False, group=groups(world, "PACK", ep)) as t:
        assert t.group.mesh == MeshSpec(world, ep, world // ep)
        losses = [t.step()["loss"] for _ in range(STEPS)]
        parts = t.group.execute(_state)
        plans = [m for m in t.metrics if m.get("event") == "rebalance"]
        record = [m for m in t.metrics if "imbalance_per_group" in m][-1]
    assert sum(p["bytes_moved"] for p in plans) > 0 and len(plans) == 2  # clones planned and moved mid-run
    assert len(record["imbalance_per_group"]) == world // ep
    mesh = MeshSpec(world, ep, world // ep)
    for rank, part in enumerate(parts):
        assert part["coords"] == mesh.coords(rank)
        assert part["peers"] == mesh.peers(rank)  # rows never leave the EP group
        twin = parts[mesh.dp_group(mesh.ep_rank(rank))[0]]  # the first replica of this EP rank
        for name, w in part["weights"].items():
            assert torch.equal(w, twin["weights"][name]), (rank, name)  # replicas identical, clones included
    state = {}
    for part in parts:
        state.update(part["shard"])
    single_losses, single_state = _single(cfg, STEPS)
    assert losses == pytest.approx(single_losses, rel=1e-6)
    assert set(state) == set(single_state)
    errors = {key: _rel(state[key], ref) for key, ref in single_state.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-6, (worst, errors[worst])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a - b‖ / ‖b‖ (0 for two zero tensors)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())
