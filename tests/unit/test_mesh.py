"""The rank mesh: coordinates, groups, the default EP degree and the refusals (one line each)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ray_moe.config import Config, ConfigError
from ray_moe.mesh import MeshError, MeshSpec, resolve_mesh


def test_coordinates_and_groups():
    mesh = MeshSpec(6, 3, 2)
    assert [mesh.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert mesh.ep_groups() == [(0, 1, 2), (3, 4, 5)]  # consecutive ranks
    assert mesh.dp_groups() == [(0, 3), (1, 4), (2, 5)]  # an EP rank's replicas
    assert mesh.peers(4) == (3, 4, 5)
    assert mesh.to_dict() == {"world": 6, "ep": 3, "dp": 2} and str(mesh) == "EP 3 x DP 2"
    with pytest.raises(MeshError):
        MeshSpec(6, 4, 2)


@pytest.mark.parametrize("nodes,use_gpu,want", [
    ([0] * 8, True, MeshSpec(8, 8, 1)),  # one node: the whole world (the layout before the mesh)
    ([0] * 8 + [1] * 8, True, MeshSpec(16, 8, 2)),  # GPUs on two nodes: the ranks of one node
    ([0, 0, 1, 1], False, MeshSpec(4, 4, 1)),  # CPU groups: the whole world, wherever they run
])
def test_auto_is_one_node_on_gpus_else_the_world(nodes, use_gpu, want):
    assert resolve_mesh(nodes, 0, use_gpu, num_experts=16) == want


def test_whole_world_ep_stays_reachable_across_nodes():
    assert resolve_mesh([0] * 4 + [1] * 4, 8, True, num_experts=8) == MeshSpec(8, 8, 1)
    assert resolve_mesh([0] * 4 + [1] * 4, 2, True, num_experts=8) == MeshSpec(8, 2, 4)


@pytest.mark.parametrize("nodes,ep,experts,match", [
    ([0] * 6 + [1] * 6, 4, 8, r"EP group 4\.\.7 across nodes \[0, 1\]"),  # straddles a node boundary
    ([0] * 4 + [1] * 4, 3, 6, "does not divide the world of 8 ranks"),
    ([0] * 4 + [1] * 4, 4, 6, "moe.num_experts=6 is not divisible by parallel.expert_parallel=4"),
    ([0] * 4 + [1] * 2, 0, 8, "the nodes hold 4, 2 ranks"),  # auto on uneven GPU nodes
])
def test_bad_meshes_are_one_line(nodes, ep, experts, match):
    with pytest.raises(MeshError, match=match) as info:
        resolve_mesh(nodes, ep, True, num_experts=experts)
    assert "\n" not in str(info.value)


def test_config_checks_the_ep_degree():
    base = {"parallel": {"world_size": 4, "device": "cpu"}, "moe": {"num_experts": 6}, "train": {"batch_size": 12}}
    with pytest.raises(ConfigError, match="moe.num_experts=6 is not divisible by parallel.world_size=4"):
        Config.from_dict(base)  # auto checks the whole world
    cfg = Config.from_dict(base | {"parallel": base["parallel"] | {"expert_parallel": 2}})
    assert cfg.world_size_error(6) is None  # the experts split over EP 2, not over the world
    assert cfg.world_size_error(3) == ("parallel.expert_parallel=2 does not divide parallel.world_size=3; "
                                       "choose a divisor of it")
    with pytest.raises(ConfigError, match="parallel.expert_parallel=-1 must be >= 0"):
        cfg.with_overrides(["parallel.expert_parallel=-1"])
    zero_clones = cfg.with_overrides(["parallel.zero_stage=1", "balance.clone_slots=1"])  # ZeRO over DP + clones
    assert (zero_clones.parallel.zero_stage, zero_clones.balance.clone_slots) == (1, 1)


def test_cli_refuses_a_bad_mesh_with_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ray_moe.cli", "train", "--config", "jobs/tiny.yaml", "parallel.world_size=4",
         "parallel.expert_parallel=3", f"train.run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "expert_parallel" in line]
    assert len(lines) == 1 and "does not divide" in lines[0], proc.stderr


def test_rebalancer_sums_loads_over_replicas():
    from ray_moe.config import BalanceConfig
    from ray_moe.driver.rebalancer import Rebalancer
    from ray_moe.placement.placement import Placement
    from ray_moe.worker.engine import ModelReport

    mesh = MeshSpec(4, 2, 2)
    report = ModelReport(0, "cpu", "gloo", (0,), 4, Placement.native(4, 2, 1).to_dict(), 8, 0, 0, 0, 0)
    rb = Rebalancer(BalanceConfig(enabled=True, interval=1, clone_slots=1, ema=0.0), report, [0, 0, 1, 1], mesh)
    loads = np.zeros((4, 1, 4))
    loads[0, 0, 0] = 5  # EP rank 0 of group 0
    loads[2, 0, 0] = 7  # its replica
    loads[3, 0, 3] = 1
    rb.observe(loads.tolist())
    assert rb._window[0].tolist() == [[12, 0, 0, 0], [0, 0, 0, 1]]
    changes, _ = rb.plan()
    assert rb.placements[0].world_size == 2  # one plan, for an EP group


def test_memory_model_of_a_mesh(capsys):
    """EP x DP: the experts split over EP only; ZeRO over the replicas halves the experts' masters
    and moments at DP 2; the activations follow the EP group; ``python -m ray_moe.arch --ep``."""
    from ray_moe import arch

    spec = arch.ArchSpec.from_hf(arch.preset("qwen3-30b-a3b"))
    one = spec.memory_per_rank(8)
    assert spec.memory_per_rank(8, dp=1) == one
    two = spec.memory_per_rank(16, dp=2)
    assert two["params"] == one["params"]  # EP 8 at W=16: the same experts per rank
    z1, z2 = spec.memory_per_rank(8, zero_stage=1), spec.memory_per_rank(16, zero_stage=1, dp=2)
    native = spec.memory_per_rank(8)["masters"] - spec.param_counts()["replicated"] * 4
    assert z2["masters"] == pytest.approx(z1["masters"] - native / 2 - spec.param_counts()["replicated"] * 4 / 16)
    assert spec.peak_bytes_per_rank(16, 1024, "full", dp=2)["activations"] == \
        spec.peak_bytes_per_rank(8, 1024, "full")["activations"]
    with pytest.raises(arch.ArchError, match="do not divide over 3 ranks"):
        spec.memory_per_rank(6, dp=2)
    assert arch.main(["qwen3-30b-a3b", "--ep", "8", "--dp", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "| 8 (EP 8 x DP 1) |" in out and "| 16 (EP 8 x DP 2) |" in out
    assert arch.main(["qwen3-30b-a3b", "--ep", "3"]) == 2
