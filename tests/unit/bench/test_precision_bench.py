"""``ray-moe bench precision`` end to end on the CPU at tiny shapes (numbers unchecked except that
they exist, add up, and the chunked loss agrees with the full logits)."""

from __future__ import annotations

import json
from pathlib import Path

from ray_moe.bench import precision


def test_bench_precision_rows_on_cpu(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(Path(precision.__file__).read_bytes() * 2)
    out = tmp_path / "precision.json"
    assert precision.main([
        "--device", "cpu", "--variants", "old,new,new_overlap", "--layers", "1", "--d-model", "16", "--heads", "2",
        "--experts", "4", "--top-k", "2", "--expert-hidden", "8", "--tokens", "32", "--seq-len", "16",
        "--data-paths", str(corpus), "--warmup", "0", "--iters", "1", "--loss-tokens", "19", "--vocab", "37",
        "--loss-iters", "1", "--json", str(out),
    ]) == 0
    rows = json.loads(out.read_text())
    old, new, overlap = rows["step"]
    assert (old["master_weights"], old["optimizer_impl"]) == (False, "for_loop")
    assert (new["master_weights"], new["optimizer_impl"]) == (True, "foreach")  # fused is CUDA-only in auto
    for r in (old, new):
        assert 0 < r["optimizer_ms"] < r["step_ms"] and 0 < r["optimizer_pct"] < 100
        assert r["optimizer_exposed_pct"] == r["optimizer_pct"]  # in place: all of it exposed
    # an overlapped variant (in place on the CPU) against its base's step without the optimizer
    assert overlap["optimizer_exposed_ms"] == overlap["step_ms"] - (new["step_ms"] - new["optimizer_ms"])
    full, chunked = rows["loss"]
    assert (full["impl"], chunked["impl"]) == ("full_logits", "chunked")
    assert chunked["loss_abs_diff"] < 1e-2 and chunked["rel_err_dh"] < 1e-2 and chunked["rel_err_dw"] < 1e-2


def test_bench_precision_curve_compares_the_moment_dtypes(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(Path(precision.__file__).read_bytes() * 2)
    out = tmp_path / "curve.json"
    assert precision.main([
        "--sections", "curve", "--device", "cpu", "--layers", "1", "--d-model", "16", "--heads", "2",
        "--experts", "4", "--top-k", "2", "--expert-hidden", "8", "--tokens", "32", "--seq-len", "16",
        "--data-paths", str(corpus), "--curve-steps", "6", "--curve-window", "3", "--json", str(out),
    ]) == 0
    fp32, bf16 = json.loads(out.read_text())["curve"]
    assert (fp32["moments"], bf16["moments"]) == ("float32", "bfloat16")
    assert len(fp32["losses"]) == len(bf16["losses"]) == 6
    assert fp32["losses"][0] == bf16["losses"][0]  # same model, same data: the first loss precedes any update
    assert fp32["losses"] != bf16["losses"] and 0 < fp32["max_running_mean_gap"] < 0.5
