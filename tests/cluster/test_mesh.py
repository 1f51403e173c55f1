"""The rank mesh on the CPU (gloo): W = EP x DP training equals the single process, replicas stay
identical, rows move only inside an EP group, checkpoints move between mesh shapes."""

from __future__ import annotations

import pytest
import torch

from ray_moe.comm.local import LocalTransport
from ray_moe.driver.trainer import Trainer
from ray_moe.mesh import MeshSpec
from ray_moe.worker.engine import Engine
from tests.support import single_rank, small_config

def _own_group(world: int):
    from ray_moe.config import Config
    from ray_moe.driver.group import WorkerGroup

    return WorkerGroup(Config.from_dict({
        "parallel": {"world_size": world, "device": "cpu", "cpu_per_worker": 0.5, "startup_timeout_s": 240,
                     "placement_strategy": "STRICT_PACK"},
        "moe": {"num_experts": 24}, "train": {"batch_size": 12}}))


@pytest.fixture(scope="module")
def mesh_groups(ray_cluster):
    """mesh_groups(W) → this module's CPU group of W ranks (4 or 6), all on one simulated node
    (STRICT_PACK: every EP degree lies inside it, whatever the suite's other groups hold), closed
    after the module so that the suite's cached groups are not pushed out. A Trainer switches it
    to the mesh its config asks for."""
    made: dict[int, object] = {}

    def get(world: int):
        if world not in made:
            made[world] = _own_group(world)
        return made[world]

    yield get
    for group in made.values():
        group.close()


RECLONING = ["balance.enabled=true", "balance.interval=3", "balance.clone_slots=1", "balance.ema=0.0"]
STEPS = 20


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


@pytest.mark.parametrize("world,ep,zero", [(4, 2, 0), (6, 3, 0), (6, 2, 0), (4, 2, 1), (6, 2, 1), (4, 2, 2), (6, 2, 2)],
                         ids=["2x2", "3x2", "2x3", "2x2-zero1", "2x3-zero1", "2x2-zero2", "2x3-zero2"])
def test_mesh_training_equals_single_process(mesh_groups, tmp_path, world, ep, zero):
    """EP x DP training with hot-expert clones re-planned every 3 steps equals the single-process
    run: every loss and every weight and moment (1e-6 relative); the DP replicas hold identical
    weights; each rank's transport moves rows among its EP group only. With ZeRO (stage 1, 2) the
    expert state is sharded over the replicas: the clones' gradients reach their owners before
    the reduce-scatter, their weights are pushed after the all-gather."""
    cfg = _mesh_config(tmp_path, world, ep, *RECLONING, f"parallel.zero_stage={zero}")
    with Trainer(cfg, progress=False, group=mesh_groups(world)) as t:
        assert t.group.mesh == MeshSpec(world, ep, world // ep)
        losses = [t.step()["loss"] for _ in range(STEPS)]
        parts = t.group.execute(_state)
        plans = [m for m in t.metrics if m.get("event") == "rebalance"]
        record = [m for m in t.metrics if "imbalance_per_group" in m][-1]
    assert sum(p["bytes_moved"] for p in plans) > 0 and len(plans) == STEPS // 3  # re-planned every 3 steps
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
    # float32 gradients summed over 4-6 ranks in another order than one rank's; after 20 AdamW
    # steps the largest errors seen were 1.4e-7 (losses), 5.2e-7 (parameters) and 9.6e-7
    # (AdamW's moments), 2026-12-07
    bad = {k: e for k, e in errors.items() if e > 1e-6}
    assert not bad, bad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a - b‖ / ‖b‖ (0 for two zero tensors)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def test_checkpoint_moves_between_mesh_shapes(mesh_groups, groups, tmp_path):
    """A checkpoint written at 2x2 with the expert state sharded over the replicas (ZeRO 1, a
    clone slot per rank: its state stays out of the checkpoint) resumes exactly at W=1, at
    whole-world EP (4x1) and at 2x3 (unsharded, no clone slots): the next two steps' losses match
    the uninterrupted run's; and the 4x1 run's checkpoint of the same step resumes at 2x2 under
    ZeRO 2 with a clone slot, as exactly."""
    def config(world: int, ep: int, name: str, *extra: str):
        return small_config(tmp_path, **{"parallel.world_size": world, "parallel.expert_parallel": ep,
                                         "train.batch_size": 12, "train.steps": STEPS,
                                         "train.run_dir": str(tmp_path / name)}).with_overrides(list(extra))

    with Trainer(config(4, 2, "2x2", "parallel.zero_stage=1", "balance.clone_slots=1"), progress=False,
                 group=mesh_groups(4)) as t:
        assert t.group.mesh == MeshSpec(4, 2, 2)
        for _ in range(3):
            t.step()
        saved = t.save()
        uninterrupted = [t.step()["loss"] for _ in range(2)]
    resaved = None
    for world, ep, group in ((1, 0, groups(1)), (4, 0, groups(4, "SPREAD")), (6, 2, mesh_groups(6))):
        with Trainer(config(world, ep, f"w{world}ep{ep}"), progress=False, group=group) as t2:
            assert t2.restore(saved) == 3
            if world == 4:
                assert t2.group.mesh == MeshSpec(4, 4, 1)  # auto on the CPU: the whole world
                resaved = t2.save()
            assert [t2.step()["loss"] for _ in range(2)] == pytest.approx(uninterrupted, rel=1e-6), (world, ep)
    with Trainer(config(4, 2, "again", "parallel.zero_stage=2", "balance.clone_slots=1"), progress=False,
                 group=mesh_groups(4)) as t3:
        assert t3.restore(resaved) == 3
        assert [t3.step()["loss"] for _ in range(2)] == pytest.approx(uninterrupted, rel=1e-6)


@pytest.mark.parametrize("family,world,ep", [("qwen3_moe", 4, 2), ("deepseek_v3", 4, 2), ("gpt_oss", 4, 2),
                                              ("glm4_moe", 6, 2), ("gpt_oss", 6, 3)])
def test_hf_family_equal_to_transformers_on_a_mesh(mesh_groups, tiny_hf, tmp_path, family, world, ep):
    """A tiny HF model at EP ``ep`` x DP ``world / ep`` (2 x 2; GLM-4.5 at 2 x 3; gpt-oss with 6
    experts at 3 x 2): every rank's logits and gradients (router, its experts summed over the
    replicas, attention, embedding) equal transformers' within 1e-5, at the native placement and
    with clones."""
    from ray_moe.bench.train import EXPERT_KEYS
    from tests.hf_parity import model_parity, parity_config, reference, save_tiny_model

    path = tiny_hf(family)
    if ep == 3:  # the tiny models' 8 experts do not split over 3 ranks
        path = str(tmp_path / "six")
        save_tiny_model(family, path, seed=3, **{EXPERT_KEYS[family]: 6})
    cfg = parity_config(path, world_size=world, batch=world, seq_len=12, expert_parallel=ep)
    arch = cfg.resolve_arch()
    group = mesh_groups(world)
    assert group.use_mesh(cfg, arch) == MeshSpec(world, ep, world // ep)
    ids = torch.randint(0, 272, (world, 13), generator=torch.Generator().manual_seed(4))
    results = group.execute(model_parity, cfg, arch, ids, reference(cfg, arch, ids), timeout=180)
    for rank, res in enumerate(results):
        for placement in ("native", "clones"):
            bad = {k: v for k, v in res[placement].items() if not v <= 1e-5}
            assert not bad, f"{family} rank {rank} {placement}: {bad}"
    experts = [{k for k in r["native"] if k.startswith("expert.")} for r in results]
    assert all(e == experts[0] for e in experts[::ep])  # replicas (rank, rank + ep, ...): the same experts
    parts = {k.rsplit(".", 1)[1] for k in experts[0]}  # w13, w2 (and b13, b2 with biases)
    assert len(set().union(*experts)) == len(parts) * arch.spec.num_experts  # every expert in each group


def test_transport_and_layer_parity_inside_each_ep_group(mesh_groups, tmp_path):
    """At 2x2 every EP group runs the transport validators and the layer against the oracle on
    its own (two exchanges at once, one per group, over the groups' process groups)."""
    from ray_moe.validation import Case
    from ray_moe.validation.layer import layer_parity
    from tests.support import run_all

    group = mesh_groups(4)
    cfg = small_config(tmp_path, **{
        "parallel.world_size": 4, "parallel.expert_parallel": 2, "train.batch_size": 8})
    assert group.use_mesh(cfg, cfg.resolve_arch()) == MeshSpec(4, 2, 2)
    assert not run_all(group, Case(hidden=16))
    for rank, errs in enumerate(group.execute(layer_parity, Case(hidden=16, num_experts=4), timeout=120)):
        assert all(v <= 1e-5 for v in errs.values()), (rank, errs)


def test_bench_grad_reduce_times_the_replicas_reduction(mesh_groups, tmp_path):
    """``ray-moe bench grad_reduce --ep 2`` at W=4 (EP 2 x DP 2, gloo): a row per stage with the
    replicas' expert reduction timed (> 0 and inside the step)."""
    import json

    from ray_moe.bench import grad_reduce

    out = tmp_path / "rows.json"
    assert grad_reduce.main(["--world-size", "4", "--ep", "2", "--stages", "0,1", "--device", "cpu",
                             "--transport", "gloo", "--hf-config", "", "--layers", "1", "--d-model", "32",
                             "--experts", "4", "--expert-hidden", "32", "--tokens", "64", "--seq-len", "32",
                             "--max-bytes", "200000", "--warmup", "1", "--iters", "2", "--json", str(out)],
                            group=mesh_groups(4)) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["stage"] for r in rows] == [0, 1] and {r["mesh"] for r in rows} == {"EP 2 x DP 2"}
    for r in rows:
        assert 0 < r["replica_reduce_ms"] < r["step_ms"], r


def test_a_killed_worker_of_one_replica_recovers_the_mesh_exactly(ray_cluster, tmp_path):
    """Rank 3 (EP rank 1 of the second replica) is killed after the step-2 checkpoint: the next
    step fails, the Trainer starts a new 2 x 2 group, restores step 2 and goes on; every step's
    loss equals the single-process run's."""
    import os
    import signal

    cfg = _mesh_config(tmp_path, 4, 2, "train.checkpoint_interval=2", "train.max_failures=1",
                       "parallel.placement_strategy=STRICT_PACK")  # both EP groups on one node, as recovered
    with Trainer(cfg, progress=False) as t:  # its own group: this one gets killed
        for _ in range(3):
            t.step()
        os.kill(t.group.ranks[3].pid, signal.SIGKILL)
        while t.step_count < 5:
            t.step()
        assert t.group.mesh == MeshSpec(4, 2, 2)
        events = [m["event"] for m in t.metrics if "event" in m]
        losses = [m["loss"] for m in t.metrics if "loss" in m and "event" not in m]
    assert "failure" in events and "recovered" in events, events
    single, _ = _single(cfg, 5)
    assert losses == pytest.approx(single, rel=1e-6)


def test_biased_experts_stay_identical_over_the_replicas(mesh_groups, tiny_hf, tmp_path):
    """gpt-oss's experts carry biases (b13, b2): at EP 2 x DP 2 (ZeRO stage 0) their gradients are
    summed over the replicas like w13's and w2's, so after a few steps the replicas hold identical
    weights and biases and the losses equal the single-process run's."""
    from tests.hf_parity import parity_config

    cfg = parity_config(tiny_hf("gpt_oss"), world_size=4, batch=8, seq_len=12, clone_slots=0).with_overrides(
        ["parallel.expert_parallel=2", f"train.run_dir={tmp_path / 'run'}", "train.steps=3", "train.lr=1e-2",
         "data.max_bytes=200000"])
    steps = 3
    with Trainer(cfg, progress=False, group=mesh_groups(4)) as t:
        losses = [t.step()["loss"] for _ in range(steps)]
        parts = t.group.execute(_state)
    mesh = MeshSpec(4, 2, 2)
    biases = [n for n in parts[0]["weights"] if n.endswith(("b13", "b2"))]
    assert biases, "the tiny gpt-oss has no expert biases"
    for rank, part in enumerate(parts):
        twin = parts[mesh.dp_group(mesh.ep_rank(rank))[0]]
        for name, w in part["weights"].items():
            assert torch.equal(w, twin["weights"][name]), (rank, name)
    single_losses, _ = _single(cfg, steps)
    assert losses == pytest.approx(single_losses, rel=1e-5)
