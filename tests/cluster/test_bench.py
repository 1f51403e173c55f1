"""The benchmarks' multi-rank paths run end to end on a CPU cluster (tiny shapes; numbers unchecked
except that they exist and cloning fixes the measured imbalance)."""

from __future__ import annotations

import json


def test_bench_layer_ep_rows_on_cpu(ray_cluster, tmp_path):
    from ray_moe.bench import layer

    out = tmp_path / "layer.json"
    assert layer.main(["--sections", "ep", "--world-size", "2", "--T", "64", "--H", "16", "--I", "24",
                       "--E", "4", "--K", "2", "--dtype", "float32", "--device", "cpu",
                       "--ep-iters", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    derived = [r for r in rows if r.get("what") == "derived"][0]
    assert derived["scaling_eff_fwd"] > 0 and rows[0]["transport"] == "gloo"


def test_bench_balance_train_mode_on_cpu(ray_cluster, tmp_path):
    from ray_moe.bench import balance

    out = tmp_path / "balance.json"
    assert balance.main(["--mode", "train", "--world-size", "2", "--experts", "8", "--top-k", "2",
                         "--tokens-per-rank", "256", "--d-model", "16", "--expert-hidden", "24",
                         "--dtype", "float32", "--device", "cpu", "--iters", "2", "--zipf", "1.5",
                         "--json", str(out)]) == 0
    row = json.loads(out.read_text())["train"][0]
    assert row["clones"] >= 1
    assert row["imbalance_on"] < row["imbalance_off"]
