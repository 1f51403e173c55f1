"""``ray-moe bench train`` on the CPU at tiny sizes: the loss-only table (each variant against the
float32 oracle), one instrumented step of a tiny HF preset, the zero-layer extrapolation, and the
one-line refusal of bad input. Timings are unchecked except that they exist."""

from __future__ import annotations

import json

import pytest
import torch

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


def test_compiled_ray_moe_row_beside_the_eager_one(tmp_path, monkeypatch):
    """``--compile``: a ``ray_moe compiled`` row (model.compile=blocks) after a timed first step;
    the regions compile with aot_eager here (inductor's C++ build takes ~15 s on this CPU)."""
    import torch

    from ray_moe.model.decoder import BlockRegions

    compiled = BlockRegions.compiled
    monkeypatch.setattr(BlockRegions, "compiled", lambda self, backend="inductor": compiled(self, "aot_eager"))
    torch._dynamo.reset()
    out = tmp_path / "train.json"
    assert train.main(["--device", "cpu", "--preset", "qwen3_moe-tiny", "--layers", "2", "--tokens", "32",
                       "--seq-len", "16", "--dtype", "float32", "--warmup", "0", "--iters", "1", "--titan", "no",
                       "--compile", "--max-bytes", "200000", "--json", str(out)]) == 0
    torch._dynamo.reset()
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["ray_moe", "ray_moe compiled"], rows
    assert "first step s" not in rows[0] and rows[1]["first step s"] > 0  # --warmup 0: one step anyway
    assert rows[1]["step ms"] > 0 and all("note" not in r for r in rows), rows


def test_ratios_against_torchtitan_of_the_same_layers():
    rows = [{"model": "ray_moe", "layers": 2, "step ms": 30.0}, {"model": "torchtitan", "layers": 2, "step ms": 40.0},
            {"model": "torchtitan compiled", "layers": 2, "step ms": 20.0},
            {"model": "ray_moe", "layers": 4, "step ms": 50.0}, {"model": "torchtitan", "layers": 4, "note": "failed"},
            {"model": "ray_moe", "layers": "0 (from 2 and 4)", "step ms": 10.0, "per layer step ms": 10.0},
            {"model": "torchtitan compiled", "layers": "0 (from 2 and 4)", "step ms": 5.0, "per layer step ms": 8.0}]
    train.ratio_columns(rows)
    assert rows[0]["x titan compiled"] == 1.5 and rows[0]["x titan eager"] == 0.75
    assert rows[2]["x titan compiled"] == 1.0 and "x titan compiled" not in rows[3]  # no torchtitan row at 4
    assert rows[5]["x titan compiled"] == 2.0 and rows[5]["per layer x titan compiled"] == 1.25
    assert "x titan eager" not in rows[5]


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


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--layers", "two"], ["--layers", "2,"]])
def test_bad_layers_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("ray-moe bench train: error: --layers=") and "comma list of positive integers" in err


def test_titan_compile_without_titan_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(["--device", "cpu", "--titan", "no", "--titan-compile"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("ray-moe bench train: error: --titan-compile")
    assert "--titan auto or yes" in err and len(err.strip().splitlines()) == 1


def test_titan_ac_none_leaves_the_model_alone_and_the_flag_takes_torchtitans_modes():
    """``--titan-ac none`` (the default) applies nothing and needs no torchtitan; the flag takes
    torchtitan's none / selective (its default) / full, and refuses anything else."""
    from ray_moe.bench import titan

    titan.apply_ac(object(), "none", compiled=False)  # nothing imported, nothing applied
    assert train.parse_args([]).titan_ac == "none"
    assert train.parse_args(["--titan-ac", "full"]).titan_ac == "full"
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--titan-ac", "memory_budget"])
    assert exc.value.code == 2


def test_variants_parse_into_names_and_overrides():
    assert train.parse_variants("bf16=;fp8=moe.expert_precision=fp8 train.lr=1e-4") == [
        ("bf16", ()), ("fp8", ("moe.expert_precision=fp8", "train.lr=1e-4"))]
    assert train.abba([("a", ()), ("b", ()), ("c", ())]) == [("a", ()), ("b", ()), ("c", ()), ("c", ()), ("b", ()),
                                                             ("a", ())]
    for bad, why in [("bf16=", "give two or more"), ("bf16=;bf16=x.y=1", "named twice"), ("a=;fp8", "NAME="),
                     ("a=;b=moe.expert_precision", "section.key=value"), ("a=;compiled=", "NAME=")]:
        with pytest.raises(ValueError, match=why):
            train.parse_variants(bad)


@pytest.mark.parametrize("argv,msg", [
    (["--variants", "a=;b=moe.expert_precision"], "--variants: variant b: override 'moe.expert_precision'"),
    (["--variants", "a=;b=moe.expert_precision=fp9"], "variant b: moe.expert_precision='fp9' is not allowed"),
    (["--variants", "a=;b=", "--loss-only"], "--variants times ray_moe's training step"),
])
def test_bad_variants_exit_2_with_one_line(argv, msg, capsys):
    try:
        code = train.main(["--device", "cpu", "--preset", "qwen3_moe-tiny", "--titan", "no", *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and msg in err, err


def test_merge_visits_and_ratio_to_the_first_variant():
    a1 = {"model": "ray_moe bf16", "layers": 2, "forward ms": 4.0, "step ms": 10.0, "tokens": 100,
          "model TFLOP/s": 2.0, "peak_gib": 1.0}
    a2 = a1 | {"forward ms": 6.0, "step ms": 30.0, "peak_gib": 3.0}
    row = train.merge_visits([a1, a2])
    assert row["step ms"] == 20.0 and row["forward ms"] == 5.0 and row["peak_gib"] == 3.0 and row["visits"] == 2
    assert row["tokens/s"] == 100 / 0.02 and row["model TFLOP/s"] == 1.0 and row["step spread"] == 1.0
    failed = {"model": "ray_moe bf16", "layers": 2, "note": "failed: X"}
    assert train.merge_visits([a1, failed]) is failed
    rows = [row, {"model": "ray_moe fp8", "layers": 2, "step ms": 15.0},
            {"model": "ray_moe compiled bf16", "layers": 2, "step ms": 8.0},
            {"model": "ray_moe compiled fp8", "layers": 2, "step ms": 4.0},
            {"model": "ray_moe fp8", "layers": 4, "step ms": 9.0},  # no bf16 row at 4 layers
            {"model": "torchtitan", "layers": 2, "step ms": 5.0}]
    train.variant_ratio_columns(rows, [("bf16", ()), ("fp8", ("moe.expert_precision=fp8",))])
    assert [r.get("x bf16") for r in rows] == [1.0, 0.75, 1.0, 0.5, None, None]


def test_variants_time_ray_moe_per_variant_in_one_run(tmp_path, capsys):
    """``--variants``: each variant's row carries its override (here the FP8 experts, emulated on
    the CPU), from two visits (ABBA), with its step's ratio to the first variant's."""
    out = tmp_path / "train.json"
    assert train.main(["--device", "cpu", "--preset", "qwen3_moe-tiny", "--layers", "2", "--tokens", "32",
                       "--seq-len", "16", "--dtype", "float32", "--warmup", "0", "--iters", "1", "--titan", "no",
                       "--variants", "bf16=;fp8=moe.expert_precision=fp8", "--max-bytes", "200000",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["expert_precision"], r["visits"]) for r in rows] == [
        ("ray_moe bf16", "bf16", 2), ("ray_moe fp8", "fp8", 2)], rows
    assert rows[0]["x bf16"] == 1.0 and rows[1]["x bf16"] == rows[1]["step ms"] / rows[0]["step ms"] > 0
    text = capsys.readouterr().out
    progress = [line.split(",")[0] for line in text.splitlines() if line.startswith("# ray_moe")]
    assert progress == ["# ray_moe bf16", "# ray_moe fp8", "# ray_moe fp8", "# ray_moe bf16"]  # ABBA
    assert "ray_moe fp8, 2 layers: step " in text and "x bf16 " in text


def test_skip_eager_keeps_the_compiled_rows_only(capsys):
    assert train._kinds(True, True) == [True] and train._kinds(True, False) == [False, True]
    assert train._kinds(False, True) == [False] and train._kinds(False, False) == [False]
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--skip-eager"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--skip-eager" in err and "--compile or --titan-compile" in err


def test_titan_yes_for_a_family_torchtitan_lacks_exit_2(capsys):
    assert train.main(["--device", "cpu", "--preset", "mixtral-tiny", "--titan", "yes"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--titan yes: torchtitan has no model of mixtral" in err, err
    assert "qwen3_moe, deepseek_v3, gpt_oss" in err


def test_attention_timing_waits_for_the_overlapped_update(monkeypatch):
    """``--attention-share`` times the blocks' attention after the last step: the step's update
    may still run on its side stream (``train.overlap_update`` on CUDA), writing the parameters
    the blocks read, so the engine settles before the first block runs."""
    from ray_moe.bench.common import one_rank
    from ray_moe.comm.local import LocalTransport
    from ray_moe.worker.engine import Engine

    args = train.parse_args(["--device", "cpu", "--preset", "qwen3_moe-tiny", "--tokens", "32", "--seq-len", "16",
                             "--dtype", "float32", "--warmup", "0", "--iters", "1", "--max-bytes", "200000"])
    cfg = train.engine_config(args, 2, ("model.compile=none",))
    resolved = cfg.resolve_arch()
    engine = Engine(cfg, one_rank(torch.device("cpu")), LocalTransport(), torch.device("cpu"), resolved)
    events = []
    monkeypatch.setattr(engine, "settle", lambda: events.append("settle"))
    layer = engine.model.layers[0]
    half = layer.attention_half
    monkeypatch.setattr(layer, "attention_half", lambda *a: events.append("attention") or half(*a))
    assert train.attention_ms(engine, args, compiled=False) > 0
    assert events[0] == "settle" and "attention" in events, events
