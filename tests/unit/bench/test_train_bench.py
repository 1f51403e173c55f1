"""``ray-moe bench train`` on the CPU at tiny sizes: the loss-only table (each variant against the
float32 oracle), one instrumented step of a tiny HF preset, the zero-layer extrapolation, and the
one-line refusal of bad input. Timings are unchecked except that they exist."""

from __future__ import annotations

import json

import pytest

from ray_moe.bench import train


def test_loss_only_rows_on_cpu(tmp_path):
    out = tmp_path / "loss.json"
    assert train.main(["--loss-only", "--device", "cpu", "--dtype", "float32", "--tokens", "37", "--hidden", "16",
                       "--vocab", "301", "--iters", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    by = {r["impl"]: r for r in rows}
    assert {"chunked", "full"} <= set(by) and "auto → chunked" in by
    for impl in ("chunked", "full"):
        r = by[impl]
        assert r["ms"] > 0 and r["loss err"] < 1e-5 and r["rel err dH"] < 1e-5 and r["rel err dW"] < 1e-5, r
    assert by["chunked"]["x chunked"] == 1.0  # no fused on the CPU without the interpreter: chunked is the base


def test_one_step_of_a_tiny_preset_on_cpu(tmp_path):
    out = tmp_path / "train.json"
    assert train.main(["--device", "cpu", "--preset", "qwen3_moe-tiny", "--layers", "2", "--tokens", "32",
                       "--seq-len", "16", "--dtype", "float32", "--warmup", "0", "--iters", "1", "--titan", "no",
                       "--max-bytes", "200000", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "ray_moe" and row["layers"] == 2 and row["tokens"] == 32, row
    assert all(row[f"{p} ms"] > 0 for p in train.PHASES) and row["step ms"] > 0
    assert row["params_expert"] > 0 and row["params_replicated"] > 0 and row["model TFLOP/s"] > 0


def test_outside_layers_extrapolates_to_zero_layers():
    rows = [{"model": "m", "layers": 2, "step ms": 30.0, "forward ms": 12.0},
            {"model": "m", "layers": 4, "step ms": 50.0, "forward ms": 22.0},
            {"model": "other", "layers": 2, "step ms": 9.0}]
    (row,) = train.outside_layer_rows(rows)
    assert row["model"] == "m" and row["step ms"] == pytest.approx(10.0) and row["forward ms"] == pytest.approx(2.0)
    assert row["per layer step ms"] == pytest.approx(10.0)


def test_model_flops_formula():
    from ray_moe.arch import resolve

    spec, _ = resolve("qwen3-30b-a3b", {"num_hidden_layers": 4})
    flops = train.model_flops(spec, tokens=16384, seq_len=4096)
    assert flops == pytest.approx(6 * spec.active_params_per_token() * 16384 + 6 * 4 * 32 * 128 * 4096 * 16384)


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--layers", "two"]])
def test_bad_layers_exit_2(argv, capsys):
    assert train.main(argv) == 2
    assert "--layers" in capsys.readouterr().err
