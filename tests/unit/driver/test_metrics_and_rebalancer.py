"""Driver pieces without Ray: step aggregation, the run summary, the Rebalancer's checkpointed
state, and the typed-call guard."""

from __future__ import annotations

import numpy as np
import pytest

from ray_moe.config import BalanceConfig
from ray_moe.driver.group import _worker_method
from ray_moe.driver.metrics import MetricsLog, aggregate_step
from ray_moe.driver.rebalancer import Rebalancer
from ray_moe.placement.placement import Placement
from ray_moe.worker.actor import EPWorker
from ray_moe.worker.engine import ModelReport


def _result(rank, loss, tokens_per_expert, pairs):
    return {"rank": rank, "step": 3, "loss": loss, "aux_loss": 0.0, "tokens": 10, "grad_norm": 1.0,
            "lr": 0.1, "skipped": False, "nonfinite": False,
            "load": {"expert_tokens": [tokens_per_expert], "received_pairs": [pairs]},
            "time": {"step": 0.5, "comm": 0.1}}


def test_aggregate_step_sums_loads_and_averages_losses():
    m = aggregate_step([_result(0, 2.0, [3, 1], 6.0), _result(1, 4.0, [1, 3], 2.0)], wall=2.0)
    assert m["loss"] == 3.0 and m["tokens"] == 20 and m["tokens_per_s"] == 10.0
    assert m["expert_tokens"] == [[4, 4]] and m["rank_pairs"] == [[6.0, 2.0]]
    assert m["imbalance"] == pytest.approx(1.5)  # max 6 over mean 4
    assert m["time_per_rank"]["comm"] == [0.1, 0.1]


def test_aggregate_step_balance_per_ep_group():
    """On a rank mesh (EP 2 x DP 2) balance is each EP group's: rows never leave it."""
    results = [_result(r, 1.0, [1, 1], pairs) for r, pairs in enumerate([6.0, 2.0, 3.0, 3.0])]
    results[2]["time"]["replica_reduce"] = 0.25
    m = aggregate_step(results, wall=1.0, ep=2)
    assert m["imbalance_per_group"] == [[1.5], [1.0]]  # group 0: max 6 / mean 4; group 1 even
    assert m["imbalance"] == pytest.approx(1.25) and m["replica_reduce_max"] == 0.25
    assert aggregate_step(results, wall=1.0)["imbalance"] == pytest.approx(6 / 3.5)  # the world as one group


def test_metrics_log_appends_and_summarises(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.start_fresh()
    log.record(aggregate_step([_result(0, 2.0, [1, 1], 2.0)], 1.0))
    log.event("eval", step=3, val_loss=1.5)
    s = log.summary()
    assert s["first_loss"] == s["last_loss"] == 2.0 and s["val_loss"] == 1.5 and s["rebalances"] == 0
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


def _report(W=2, E=4):
    return ModelReport(rank=0, device="cpu", transport="gloo", moe_layers=(1, 2), num_experts=E,
                       native_placement=Placement.native(E, W, 1).to_dict(), expert_bytes=100,
                       replicated_params=0, expert_params_local=0, corpus_train_bytes=0, corpus_files=0)


def test_rebalancer_state_round_trip_plans_identically():
    cfg = BalanceConfig(enabled=True, interval=2, clone_slots=1, ema=0.5)
    a = Rebalancer(cfg, _report(), node_of_rank=[0, 1])
    g = np.random.default_rng(0)
    for _ in range(3):
        a.observe(g.integers(0, 50, size=(2, 2, 4)).tolist())
    a.plan()
    a.observe([[[90, 1, 1, 1], [5, 5, 5, 5]], [[80, 1, 1, 1], [5, 5, 5, 5]]])
    b = Rebalancer(cfg, _report(), node_of_rank=[0, 1])
    b.load_state_dict(a.state_dict())
    ca, ra = a.plan()
    cb, rb = b.plan()
    assert ca == cb and ra == rb
    with pytest.raises(ValueError, match="W=2; the group has 4"):
        Rebalancer(cfg, _report(), node_of_rank=[0, 1, 2, 3]).load_state_dict(a.state_dict())


def test_rebalancer_takes_its_facts_from_the_workers_report():
    r = Rebalancer(BalanceConfig(enabled=True, clone_slots=1), _report(), node_of_rank=[0, 0])
    assert r.num_layers == 2 and r.num_experts == 4 and r.bytes_per_expert == 100
    with pytest.raises(ValueError, match="placement for W=2"):
        Rebalancer(BalanceConfig(), _report(), node_of_rank=[0, 0, 1, 1])


def test_group_calls_take_worker_methods_only():
    assert _worker_method(EPWorker.step) == "step"
    for bad in ("step", len, lambda w: w):
        with pytest.raises(TypeError, match="not a method of EPWorker"):
            _worker_method(bad)
