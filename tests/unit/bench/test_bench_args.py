"""bench layer's and bench comm's arguments: a bad value ends in one line that names the flag
(exit code 2), before any Ray cluster or GPU is touched."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ray_moe.bench import comm
from ray_moe.bench.layer import parse_args


@pytest.mark.parametrize("argv, says", [
    (["--sections", "ep", "--world-size", "2", "--T", "63"], "--T 63 is not divisible by --world-size 2"),
    (["--sections", "ep"], "--sections ep needs --world-size >= 1"),
    (["--sections", "ep", "--world-size", "2", "--ep-programs", "x"], "--ep-programs='x' must be comma-separated"),
    (["--sections", "ep", "--world-size", "2", "--ep-programs", "-1"], "--ep-programs=-1 must be integers >= 0"),
    (["--sections", "ep", "--world-size", "2", "--ep-interleave", "2"], "--ep-interleave=2 must be a comma list"),
    (["--sections", "ep", "--world-size", "2", "--ep-profile-steps", "0"], "--ep-profile-steps must be >= 1"),
    (["--sections", "ep", "--world-size", "2", "--ep-rounds", "0"], "--ep-rounds must be >= 1"),
    (["--sections", "kernels,nope"], "--sections: unknown nope"),
    (["--sweep", "--sweep-roles", "gate_up,up"], "--sweep-roles: unknown up; known: gate_up, down, dact"),
    (["--sweep-roles", "gate_up"], "--sweep-roles needs --sweep"),
    (["--K", "9", "--E", "8"], "--K 9 is larger than --E 8"),
    (["--H", "0"], "--H must be >= 1"),
])
def test_bad_values_name_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_good_values_pass():
    args = parse_args(["--sections", "ep", "--world-size", "2", "--T", "64",
                       "--ep-interleave", "default,1", "--ep-programs", "0,32"])
    assert args.world_size == 2 and args.ep_programs == "0,32" and args.ep_interleave == "default,1"


def test_the_cli_prints_no_traceback():
    run = subprocess.run([sys.executable, "-m", "ray_moe.cli", "bench", "layer", "--sections", "ep",
                          "--world-size", "2", "--ep-profile-steps", "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "ray-moe bench layer: error: --ep-profile-steps must be >= 1, got 0 (see ray-moe bench layer --help)"]


@pytest.mark.parametrize("argv, says", [
    (["--tokens", "128,x"], "--tokens='128,x' must be a comma list of positive integers"),
    (["--programs", "16,0"], "--programs='16,0' must be a comma list of positive integers"),
    (["--variants", "r8h4096w16il,bogus"], "--variants: unknown bogus"),
    (["--top-k", "9", "--experts", "8"], "--top-k 9 is larger than --experts 8"),
    (["--iters", "0"], "--iters must be >= 1"),
])
def test_bench_comm_names_the_bad_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        comm.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_rounds_take_each_timing_median():
    """bench layer --ep-rounds: a variant's timings are their medians over the rounds, rank by
    rank; what is not a timing (profiles) comes from the first round."""
    from ray_moe.bench.ep_layer import _median_over_rounds

    rounds = [[{"forward_ms": f, "backward_ms": 2.0 * f, "steady_step_ms": s, "kernels": {"round": i}}
               for f, s in ((1.0 + i, 10.0 - i), (5.0, 7.0 * (i + 1)))] for i in range(3)]
    merged = _median_over_rounds(rounds)
    assert [m["forward_ms"] for m in merged] == [2.0, 5.0]
    assert [m["backward_ms"] for m in merged] == [4.0, 10.0]
    assert [m["steady_step_ms"] for m in merged] == [9.0, 14.0]
    assert all(m["kernels"] == {"round": 0} for m in merged)


@pytest.mark.parametrize("argv, says", [
    (["--world-size", "1"], "--world-size must be >= 2"),
    (["--tokens", "4000", "--seq-len", "4096"], "must be a multiple of --seq-len=4096"),
    (["--variants", "sequential,nope"], "must name some of sequential, param_gather"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--comm-programs", "-1"], "--comm-programs must be >= 0"),
    (["--layers", "2,x"], "--layers='2,x' must be a comma list of distinct integers >= 1"),
    (["--layers", "2,2"], "--layers='2,2' must be a comma list of distinct integers >= 1"),
    (["--set", "moe.top_k=0"], "--set: moe.top_k=0 must be between 1"),
    (["--set", "moe.nope=1"], "--set: "),
    (["--ep", "3"], "parallel.expert_parallel=3 does not divide"),  # a rank mesh at W=2
    (["--variants", "sequential+nope"],
     "must name some of sequential, param_gather, no_param_gather, bf16_reduce, rebalance"),
])
def test_bench_overlap_bad_values_name_the_flag(argv, says, capsys):
    from ray_moe.bench import overlap

    with pytest.raises(SystemExit) as exc:
        overlap.main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_bench_overlap_variants_join_their_overrides():
    from ray_moe.bench import overlap

    assert overlap.variant_overrides("sequential") == {}
    assert overlap.variant_overrides("no_param_gather+bf16_reduce") == {
        "parallel.overlap_param_gather": False, "parallel.grad_reduce_dtype": "bfloat16"}
    args = overlap._parser().parse_args(["--set", "train.steps=5"])
    args.layers, args.variants = [2], ["no_param_gather+bf16_reduce"]
    cfg = overlap.config_for(args, 2, "no_param_gather+bf16_reduce", "runs/x")
    assert not cfg.parallel.overlap_param_gather and cfg.parallel.grad_reduce_dtype == "bfloat16"
    assert cfg.train.steps == 5
    re = overlap.config_for(args, 2, "rebalance", "runs/x")
    assert re.balance.enabled and re.balance.clone_slots >= 1 and re.balance.interval <= args.warmup
    one = overlap.config_for(args, 1, "no_param_gather+bf16_reduce", "runs/x")  # the reference: no variant
    assert one.parallel.overlap_param_gather and one.parallel.grad_reduce_dtype == "float32"


@pytest.mark.parametrize("bench", ["precision", "grad_reduce"])
def test_set_overrides_are_checked_before_any_run(bench, capsys):
    """``--set`` (e.g. ``model.compile=none`` to time eager blocks where ``auto`` compiles them):
    a bad key's value ends in one line naming it, before a model or a cluster is built."""
    import importlib

    main = importlib.import_module(f"ray_moe.bench.{bench}").main
    with pytest.raises(SystemExit) as exc:
        main(["--set", "model.compile=full"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--set: model.compile='full' is not allowed; choose one of auto, none, blocks" in err


def test_set_overrides_reach_the_configs():
    import argparse

    from ray_moe.bench import grad_reduce, precision

    p_args = precision._parser().parse_args(["--set", "model.compile=none"])
    assert precision.step_config(p_args, "new").model.compile == "none"
    g_args = grad_reduce._parser().parse_args(["--set", "model.compile=none"])
    g_args.stages = [0]
    assert grad_reduce.config_for(g_args, 0, "runs/x").model.compile == "none"
    assert isinstance(p_args, argparse.Namespace) and p_args.set == ["model.compile=none"]


def test_rows_section_interleaves_gate_and_up_as_sonicmoe_holds_them():
    """The ``rows`` section hands quack w13 and h13 with gate and up columns interleaved (gate at
    even columns: SonicMoE's c_fc rows, bench/layer/sonic.py) and reads quack's dSwiGLU output
    back as ray_moe's concatenated halves."""
    import torch

    from ray_moe.bench.layer.profiling import _concatenated, _interleaved

    w13 = torch.randn(3, 5, 8)  # [S, H, 2I], I = 4
    inter = _interleaved(w13)
    assert torch.equal(inter[..., 0::2], w13[..., :4]) and torch.equal(inter[..., 1::2], w13[..., 4:])
    assert torch.equal(_concatenated(inter), w13)
