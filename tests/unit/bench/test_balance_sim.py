"""``ray-moe bench balance --mode sim`` end to end on the CPU (no Ray)."""

from __future__ import annotations

import json

import pytest

from ray_moe.bench.balance import main as bench_main


def test_bench_sim_cli(tmp_path):
    out = tmp_path / "bal.json"
    rc = bench_main(["--world-size", "4", "--nodes", "2", "--experts", "16", "--top-k", "2",
                     "--tokens-per-rank", "256", "--seeds", "1", "--fresh-batches", "1",
                     "--zipf", "0", "1.2", "--shift-steps", "40", "--shift-every", "20",
                     "--shift-tokens-per-rank", "128", "--interval", "5", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["zipf_s"] for r in data["static"]] == [0.0, 1.2]
    assert [r["zipf_s"] for r in data["shifting"]] == [1.2]
    assert data["static"][1]["plan_loads"] < data["static"][1]["no_clone"]
    with pytest.raises(SystemExit):  # only sim and train exist (train: tests/cluster/test_bench.py)
        bench_main(["--mode", "gpu"])
