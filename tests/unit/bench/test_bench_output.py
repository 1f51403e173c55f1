"""What the benches print says what they measure, once: ``ray-moe bench --help`` names each bench
and where it runs; ``bench train`` prints its table once; ``bench overlap``'s per-layer slope is
never a negative time."""

from __future__ import annotations

import pytest

from ray_moe.cli import BENCHES, build_parser


def test_bench_help_says_what_each_bench_does_and_where_it_runs(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for name in BENCHES:
        assert f"\n  {name} " in text, name
    assert text.count("runs on: ") == len(BENCHES) and "runs on: CPU\n" in text  # bench prepare


def test_bench_train_prints_its_table_once(tmp_path, capsys):
    from ray_moe.bench import train

    assert train.main(["--device", "cpu", "--preset", "qwen3_moe-tiny", "--layers", "1,2", "--tokens", "32",
                       "--seq-len", "16", "--dtype", "float32", "--warmup", "0", "--iters", "1", "--titan", "no",
                       "--max-bytes", "200000"]) == 0
    out = capsys.readouterr().out
    header = [line for line in out.splitlines() if line.startswith("model ") and "layers" in line]
    assert len(header) == 1, out  # one table, after one progress line per row
    assert out.count("# ray_moe, 1 layers: ") == 1 and out.count("# ray_moe, 2 layers: ") == 1


def test_bench_overlap_per_layer_slope_is_never_negative():
    from ray_moe.bench.overlap import TIME_KEYS, per_layer

    first = {f"{k}_ms": 10.0 for k in TIME_KEYS}
    last = {f"{k}_ms": 14.0 for k in TIME_KEYS} | {"update_ms": 9.0, "grad_sync_ms": 10.0}
    slope = per_layer(first, last, 2)
    assert slope["step_ms"] == 2.0 and slope["update_ms"] is None and slope["grad_sync_ms"] is None
