"""torchtitan's models beside ray_moe's in ``bench train``, on the CPU at tiny sizes: for each
family torchtitan has (qwen3_moe, deepseek_v3, gpt_oss), its model built from the same HF config
has ray_moe's parameter count (tiny presets and the real layer shapes the GPU runs time, counted on
the meta device), and one step of each side runs; the CPU stand-ins of torchtitan's CUDA-only
parts compute what they stand in for and are put back. Skipped where torchtitan does not import
(it is not a dependency: ``scripts/make-titan-bundle.sh``)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torchtitan.models.deepseek_v3")

from ray_moe.arch import preset, resolve  # noqa: E402
from ray_moe.bench import titan, train  # noqa: E402


def _tiny(family: str) -> dict:
    """The family's tiny preset, every Qwen3 layer an MoE layer (as torchtitan's Qwen3 has them);
    gpt-oss's YaRN with a 4096-token original context (torchtitan asserts its correction range
    starts above 0, which 128 tokens at head dim 24 do not give)."""
    hf = preset(f"{family}-tiny")
    if family == "qwen3_moe":
        hf["mlp_only_layers"] = []
    if family == "gpt_oss":
        hf["rope_scaling"]["original_max_position_embeddings"] = 4096
    return hf


@pytest.mark.parametrize("family", titan.FAMILIES)
def test_torchtitan_model_of_each_family_imports(family):
    assert titan.import_error(family) is None


@pytest.mark.parametrize("source,layers,experts", [
    ("qwen3_moe", 2, 0), ("deepseek_v3", 2, 0), ("deepseek_v3", 4, 0), ("gpt_oss", 2, 0), ("gpt_oss", 4, 0),
    ("qwen3-30b-a3b", 4, 0), ("deepseek-v3", 4, 16), ("moonlight-16b-a3b", 4, 0), ("gpt-oss-20b", 4, 0),
])
def test_parameter_counts_match_ray_moe(source, layers, experts):
    """torchtitan's model (on the meta device) has exactly ray_moe's parameters: the same layer
    shapes, layers, dense layers, shared and routed experts, biases and sinks."""
    if source in titan.FAMILIES:
        hf = _tiny(source)
        hf.pop("layer_types", None)  # the default: sliding windows on the even layers
        hf["num_hidden_layers"] = layers
        spec, hf = resolve("", hf)
    else:
        spec, hf = resolve(source, {"num_hidden_layers": layers, **train.expert_cut(source, experts)})
    tt = titan.build(hf, 4096, "cpu", torch.bfloat16, init=False)
    assert tt.exact_count and not tt.notes, tt.notes
    assert tt.params() == spec.param_counts()["total"]


def test_mapping_names_what_it_does_not_follow():
    hf = _tiny("gpt_oss")
    hf["swiglu_alpha"] = 1.5
    hf["layer_types"] = ["full_attention", "sliding_attention"]
    notes = titan.model_args(hf, 64).notes
    assert any("alpha 1.702" in n for n in notes) and any("even layers" in n for n in notes), notes
    dsv3 = _tiny("deepseek_v3") | {"rope_interleave": False}
    assert any("(even, odd) pairs" in n for n in titan.model_args(dsv3, 64).notes)
    qwen = preset("qwen3_moe-tiny")  # mlp_only_layers [0]: a dense first layer torchtitan lacks
    assert not titan.model_args(qwen, 64).exact_count
    with pytest.raises(ValueError, match="torchtitan has no model of mixtral"):
        titan.model_args(preset("mixtral-tiny"), 64)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_dense_flex_equals_flex_attention():
    """The CPU stand-in for torchtitan's compiled flex attention: flex_attention's output and
    log-sum-exp (forward, which the CPU has) for a sliding-window causal mask with GQA."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 48, 16, generator=g) for h in (4, 2, 2))
    mask = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j <= 7), 2, None, 48, 48, device="cpu")
    want, aux = flex_attention(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True, return_aux=AuxRequest(lse=True))
    got, lse = titan.dense_flex(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, aux.lse, rtol=1e-5, atol=1e-5)


def test_cpu_fallbacks_count_experts_and_are_put_back():
    from torchtitan.models.attention import FlexAttentionWrapper

    histc, flex = torch.histc, FlexAttentionWrapper._compiled_flex_attn
    ids = torch.tensor([3, 0, 3, 1, 3, 7])
    with titan.cpu_fallbacks():
        counts = torch.histc(ids, bins=8, min=0, max=8)
        assert FlexAttentionWrapper._compiled_flex_attn is titan.dense_flex
    assert counts.dtype == torch.int64 and counts.tolist() == torch.bincount(ids, minlength=8).tolist()
    assert torch.histc is histc and FlexAttentionWrapper._compiled_flex_attn is flex


@pytest.mark.parametrize("family", titan.FAMILIES)
def test_one_step_each_beside_torchtitan(family, tmp_path):
    """``bench train --titan yes --attention-share`` on a tiny config of the family: a ray_moe row
    and a torchtitan row, each timed, with equal parameter counts and their attention's share."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_tiny(family)))
    out = tmp_path / "train.json"
    assert train.main(["--device", "cpu", "--preset", str(config), "--layers", "2", "--tokens", "64",
                       "--seq-len", "64", "--dtype", "float32", "--warmup", "0", "--iters", "1", "--titan", "yes",
                       "--attention-share", "--max-bytes", "200000", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    ours, theirs = rows
    assert (ours["model"], theirs["model"]) == ("ray_moe", "torchtitan"), rows
    assert "failed" not in str(ours.get("note", "")) + str(theirs.get("note", "")), rows
    assert ours["params"] == theirs["params"] > 0
    for row in rows:
        assert row["step ms"] > 0 and all(row[f"{p} ms"] > 0 for p in train.PHASES), row
        assert row["attention ms"] > 0 and row["attention share"] == row["attention ms"] / row["step ms"]
    assert ours["x titan eager"] == ours["step ms"] / theirs["step ms"]
