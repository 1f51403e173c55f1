"""``ray-moe bench curve`` on the CPU: a tiny Qwen3-MoE in float32 trained with bf16 and FP8
experts (the CPU path emulates FP8's numerics) from one seed on a prepared dataset, end to end
through the CLI: the CSV holds both curves step by step, both start from the same weights and the
same first batch (equal first losses within FP8's error, different after), the summary's
difference is the CSV's tail, and bad input is one line with exit code 2."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from ray_moe.bench import curve
from ray_moe.cli import main as cli_main
from tests.unit.data.shard_helpers import write_dataset

VOCAB = 300


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A prepared dataset (the writer ``ray-moe prepare`` uses) of token ids with structure to learn:
    documents counting up from a random start, modulo the vocabulary."""
    rng = np.random.default_rng(0)
    files = [[(rng.integers(1, VOCAB) + np.arange(int(rng.integers(20, 200)))) % (VOCAB - 1) + 1
              for _ in range(8)] for _ in range(12)]
    out = tmp_path_factory.mktemp("curve") / "data"
    write_dataset(out, [[d.astype(np.uint32) for d in docs] for docs in files], vocab_size=VOCAB,
                  shard_tokens=4096, val_fraction=0.2)
    return out


def test_bf16_and_fp8_curves_from_one_seed(dataset, tmp_path, capsys):
    out = tmp_path / "curve"
    steps = 6
    assert cli_main(["bench", "curve", "--device", "cpu", "--dtype", "float32", "--preset", "qwen3_moe-tiny",
                     "--layers", "2", "--steps", str(steps), "--tokens", "64", "--seq-len", "16", "--lr", "3e-3",
                     "--warmup-steps", "2", "--dataset", str(dataset), "--out", str(out), "--tail", "3",
                     "--log-every", "2", "--eval-batches", "1", "--smooth", "2",
                     "--variants", "bf16=;fp8=moe.expert_precision=fp8", "--set", "model.compile=none"]) == 0
    text = capsys.readouterr().out
    assert "fp8: final loss (mean of the last 3 steps)" in text and "same initial weights: True" in text, text
    printed = float(text.split("fp8: final loss")[1].split("% vs bf16")[0].rsplit(",", 1)[1])  # the relative difference
    with open(out / "curve.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "bf16", "fp8"] and [int(r[0]) for r in rows[1:]] == list(range(1, steps + 1))
    bf16, fp8 = ([float(r[i]) for r in rows[1:]] for i in (1, 2))
    assert all(math.isfinite(v) for v in bf16 + fp8)
    assert bf16[-1] < bf16[0] and fp8[-1] < fp8[0]  # both learn
    # one seed and one batch: the first losses differ only by FP8's rounding of the experts
    assert bf16[0] != fp8[0] and abs(fp8[0] / bf16[0] - 1) < 0.01
    result = json.loads((out / "curve.json").read_text())
    assert result["reference"] == "bf16" and result["same_init"] and result["stopped_at"] is None
    v = result["variants"]
    assert v["bf16"]["final_loss"] == pytest.approx(sum(bf16[-3:]) / 3, rel=1e-5)
    assert v["fp8"]["final_loss_rel_diff_pct"] == pytest.approx(100 * (sum(fp8[-3:]) / sum(bf16[-3:]) - 1), rel=1e-4)
    assert printed == pytest.approx(v["fp8"]["final_loss_rel_diff_pct"], abs=1e-3)
    assert v["bf16"]["final_loss_rel_diff_pct"] == 0.0 and math.isfinite(v["fp8"]["val_loss"])
    assert v["fp8"]["steps"] == steps and v["fp8"]["skipped_steps"] == 0 and v["fp8"]["nonfinite_steps"] == 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result["plot"].startswith("no plot")
    else:
        assert (out / "curve.png").stat().st_size > 0 and result["plot"] == "curve.png"


def test_time_limit_stops_every_variant_at_one_step(dataset, tmp_path):
    out = tmp_path / "curve"
    assert curve.main(["--device", "cpu", "--dtype", "float32", "--preset", "qwen3_moe-tiny", "--layers", "2",
                       "--steps", "50", "--tokens", "32", "--seq-len", "16", "--dataset", str(dataset),
                       "--out", str(out), "--eval-batches", "0", "--time-limit-s", "1e-9",
                       "--variants", "a=;b=train.lr=1e-3", "--set", "model.compile=none"]) == 0
    result = json.loads((out / "curve.json").read_text())
    assert result["stopped_at"] == 1 and all(r["steps"] == 1 for r in result["variants"].values())


def test_variants_parse_and_bad_input_is_one_line(dataset, tmp_path, capsys):
    assert curve.parse_variants("bf16=; fp8=moe.expert_precision=fp8,model.dtype=float32") == [
        ("bf16", []), ("fp8", ["moe.expert_precision=fp8", "model.dtype=float32"])]
    for bad, why in (("a=;a=", "given twice"), ("=x=1", "NAME=KEY=VALUE"), ("a=moe", "section.key=value")):
        with pytest.raises(ValueError, match=why):
            curve.parse_variants(bad)
    common = ["bench", "curve", "--device", "cpu", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exc:
        cli_main([*common, "--dataset", str(tmp_path / "nowhere")])
    assert exc.value.code == 2 and "meta.json is missing" in capsys.readouterr().err
    assert cli_main([*common, "--dataset", str(dataset), "--variants", "x=moe.expert_precision=fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe.expert_precision='fp16'" in err[0] and "variant 'x'" in err[0], err


def test_moving_average_and_tail():
    assert curve.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert curve.tail_mean([9.0, float("nan"), 2.0, 4.0], 3) == 3.0
    assert math.isnan(curve.tail_mean([], 3))
