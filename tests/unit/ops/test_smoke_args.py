"""``ray-moe smoke --set``: overrides reach the tiny model's config; a bad one is one line, exit 2,
before any cluster work."""

from __future__ import annotations

import pytest

from ray_moe.ops.smoke import parse_args, smoke_config


def test_set_overrides_reach_the_smoke_config():
    opts = parse_args(["--set", "model.compile=none", "train.lr=0.05"])
    cfg = smoke_config(2, "cpu", opts, "run")
    assert cfg.model.compile == "none"
    assert cfg.train.lr == pytest.approx(0.05)
    assert cfg.parallel.world_size == 2
    assert smoke_config(2, "cpu", parse_args([]), "run").model.compile == "auto"


@pytest.mark.parametrize("override, message", [
    ("model.compile=full", "model.compile='full' is not allowed; choose one of auto, none, blocks"),
    ("moe.nope=1", "moe.nope"),
])
def test_bad_override_is_one_line_and_exit_2(override, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--set", override])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ray-moe smoke: error: --set: ")
    assert message in err


@pytest.mark.parametrize("argv", [
    ["--transport", "nccl"],
    ["--device", "cuda", "--transport", "nvshmem"],
    ["--device", "cuda", "--transport", "nvshmem", "--set", "model.compile=none"],
    ["--transport", "nccl", "--set", "model.compile=none"],
])
def test_gpu_transports_parse_with_overrides(argv):
    """The overrides are checked against the device asked for (auto or cuda), so a GPU transport
    is never refused on this CPU-only check."""
    opts = parse_args(argv)
    assert opts.transport == argv[argv.index("--transport") + 1]
