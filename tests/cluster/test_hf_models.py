"""The HF families on worker groups (gloo, CPU): equal to transformers at W=2 and W=4, at the
native placement and with clones; ``model.init_from`` opens only each rank's tensors; the
balancing bias is the same on every rank and resumes; ``Trainer.generate``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.hf_parity import model_parity, parity_config, reference

FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe")
TOL = 1e-5
# Activation checkpointing per family here: the replay's dispatch/combine must pair up across ranks.
CHECKPOINTING = {"qwen3_moe": "none", "mixtral": "moe", "glm4_moe": "full"}


def group_for(groups, world_size: int):
    return groups(2) if world_size == 2 else groups(4, "SPREAD")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_equal_to_transformers_on_a_group(groups, tiny_hf, family, world_size):
    """One execute per (family, W): every rank loads the HF directory (its tensors only), runs its
    sequences, and its logits and gradients (router, its experts, shared expert, dense layer,
    attention, embedding) equal transformers' within 1e-5, without and with clones (and with
    activation checkpointing for Mixtral (moe) and GLM (full))."""
    path = tiny_hf(family)
    cfg = parity_config(path, world_size=world_size, batch=4, seq_len=12, checkpointing=CHECKPOINTING[family])
    ids = torch.randint(0, 272, (4, 13), generator=torch.Generator().manual_seed(world_size))
    results = group_for(groups, world_size).execute(model_parity, cfg, cfg.resolve_arch(), ids, reference(cfg, cfg.resolve_arch(), ids), timeout=180)
    experts_seen = set()
    for rank, res in enumerate(results):
        for placement in ("native", "clones"):
            bad = {k: v for k, v in res[placement].items() if not v <= TOL}
            assert not bad, f"{family} W={world_size} rank {rank} {placement}: above {TOL}: {bad}"
        experts_seen |= {k for k in res["native"] if k.startswith("expert.")}
    assert len(experts_seen) == 2 * 8  # every expert's w13 and w2 compared on its owner
    if world_size == 2:
        assert_opened_only_owned(path, [r["opened"] for r in results])


def assert_opened_only_owned(path: str, opened: list[list[str]]) -> None:
    """Rank r opened every replicated tensor and the routed experts r*E/W .. (r+1)*E/W-1 of each
    MoE layer, each once, and nothing else."""
    index = Path(path) / "model.safetensors.index.json"
    names = (json.loads(index.read_text())["weight_map"] if index.exists() else
             _single_file_names(Path(path) / "model.safetensors"))
    W, n = len(opened), 8 // len(opened)
    expert = re.compile(r".*\.experts\.(\d+)\.")
    for rank, got in enumerate(opened):
        want = {k for k in names if not expert.match(k) or int(expert.match(k).group(1)) // n == rank}
        assert len(got) == len(set(got)), f"rank {rank} opened a tensor twice"
        assert set(got) == want, (f"rank {rank}: opened but not owned {sorted(set(got) - want)[:4]}, "
                                  f"owned but not opened {sorted(want - set(got))[:4]}")
    assert W == 2


def _single_file_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _bias(worker) -> list[list[float]]:
    return [layer.score_bias.tolist() for layer in worker.engine.model.moe_layers()]


def test_balancing_bias_same_on_every_rank_and_resumes(groups, tmp_path):
    """jobs/deepseek_tiny.yaml at W=2: after each step every rank holds the same bias, which has
    moved; 2 steps + checkpoint + resume + 2 steps gives the bias (and losses) of 4 straight steps."""
    from ray_moe.config import Config
    from ray_moe.driver.trainer import Trainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7}\n" for i in range(3000)))
    over = ["parallel.world_size=2", "parallel.cpu_per_worker=0.5", "train.steps=4", "train.eval_interval=0",
            "train.checkpoint_interval=0", "train.plots=false", "train.batch_size=4", "model.seq_len=32",
            f"data.paths=[{corpus}]", "moe.bias_update_rate=0.01", "train.warmup_steps=1"]
    group = groups(2)
    cfg = Config.from_yaml("jobs/deepseek_tiny.yaml", over + [f"train.run_dir={tmp_path / 'a'}"])
    with Trainer(cfg, group=group, progress=False) as t:
        start = group.execute(_bias)
        straight = [t.step()["loss"] for _ in range(4)]
        final = group.execute(_bias)
        text = t.generate("def ", max_new_tokens=12, temperature=0.0)
        assert text.startswith("def ") and text == t.generate("def ", max_new_tokens=12, temperature=0.0)
        ids = t.generate([100, 101], max_new_tokens=5, temperature=1.0, seed=1)
        assert len(ids) == 7 and ids[:2] == [100, 101] and all(0 <= i < 256 for i in ids)
    assert start[0] != final[0] and final[0] == final[1]
    cfg_b = cfg.with_overrides([f"train.run_dir={tmp_path / 'b'}", "train.resume=auto"])
    with Trainer(cfg_b, group=group, progress=False) as t:
        first = [t.step()["loss"] for _ in range(2)]
        t.save()
    with Trainer(cfg_b, group=group, progress=False) as t:
        assert t.step_count == 2
        rest = [t.step()["loss"] for _ in range(2)]
        resumed = group.execute(_bias)
    assert first + rest == straight
    assert resumed == final  # a fresh engine starts at bias 0: the 2-step bias came from the checkpoint
