"""The benchmarks' multi-rank paths run end to end on a CPU cluster (tiny shapes; numbers unchecked
except that they exist and cloning fixes the measured imbalance)."""

from __future__ import annotations

import gzip
import json


def test_bench_layer_ep_rows_on_cpu(group_for_new, tmp_path):
    """`bench layer --sections ep` on a CPU group: two exchange settings side by side (NVSHMEM's
    interleave, carried to the transport and unused by gloo), the single-rank layer at T/W and at T, and per variant the exposed communication and the
    scaling efficiency (tiny shapes; only their presence is checked), and with --ep-profile the
    operators of every variant against a rank's own compute and each rank's trace kept, written as
    JSON."""
    from ray_moe.bench import layer

    group_for_new(2)
    out = tmp_path / "layer.json"
    assert layer.main(["--sections", "ep", "--world-size", "2", "--T", "64", "--H", "16", "--I", "24",
                       "--E", "8", "--K", "2", "--dtype", "float32", "--device", "cpu",
                       "--ep-iters", "2", "--ep-rounds", "2", "--ep-interleave", "default,1", "--ep-profile",
                       "--ep-profile-steps", "2", "--force-remote-path",  # NVSHMEM settings: unused by gloo
                       "--ep-trace-dir", str(tmp_path / "traces"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    ep = [r for r in rows if r["what"].startswith("EP")]
    # every variant by its exchange setting
    assert [(r["interleave"], r["comm_programs"]) for r in ep] == [(None, 0), (True, 0)]
    assert all(r["transport"] == "gloo" for r in ep)
    assert all(1.0 <= r["imbalance"] < 2.0 for r in ep)  # random routing over 2 ranks: near 1
    assert ep[0]["what"] == "EP per rank (max over ranks)" and ep[1]["what"].endswith(", interleaved")
    assert {r["what"] for r in rows} >= {"one GPU, T/W tokens", "one GPU, all T tokens",
                                         "one GPU, T/W tokens on E/W experts (a rank's compute)"}
    derived = [r for r in rows if r["what"] == "derived"]
    assert [d["interleave"] for d in derived] == [None, True]
    for d in derived:
        assert d["scaling_eff_fwd"] > 0 and d["scaling_eff_fwd+bwd"] > 0
        assert {"exposed_comm_frac_fwd", "exposed_comm_frac_fwd+bwd", "exposed_comm_fwd_ms"} <= d.keys()
        assert d["scaling_if_hidden_fwd"] > 0 and d["scaling_if_hidden_fwd+bwd"] > 0
        assert d["scaling_eff_steady"] > 0 and "exposed_comm_frac_steady" in d
        assert -1 < d["reference_drift"] < 10  # the references timed before and after the variants
    timed = [r for r in rows if r["section"] == "ep" and r["what"] != "derived"]
    assert all(r["steady_step_ms"] > 0 and 0 < r["steady_issue_ms"] <= r["steady_step_ms"] * 1.01
               and r["steady_device_ms"] > 0 for r in timed)
    assert all(len(r["steady_ms_per_rank"]) == 2 and max(r["steady_ms_per_rank"]) == round(r["steady_step_ms"], 3)
               for r in ep)
    # --ep-rounds 2: every variant ran twice (the second round in reverse order), each round's
    # steady step kept beside the medians
    assert all(len(r["steady_ms_per_round"]) == 2 and min(r["steady_ms_per_round"]) > 0 for r in ep)
    # which expert implementation ran: on the CPU nothing is measured, and auto is the loop
    assert all(r["expert_impl"] == "loop" for r in timed), [r["expert_impl"] for r in timed]
    # the steady loop's synchronising calls are counted on CUDA only (torch's sync debug mode)
    assert all(r["host_syncs_per_step"] == 0 for r in rows if r["section"] == "ep" and r["what"] != "derived")
    # --ep-profile: every variant's operators (on the CPU) against a rank's own compute, the
    # exchange's collectives among what EP spends more on
    variants = ["default", "interleaved"]
    prof = [r for r in rows if r["section"].startswith("ep profile")]
    assert sorted({r["section"] for r in prof}) == sorted(
        f"ep profile: EP vs a rank's compute (rank 0), {v}" for v in variants)
    for v in variants:
        mine = [r for r in prof if r["section"].endswith(v)]
        assert mine[-1]["what"].startswith("all ") and mine[-1]["ep_ms"] > 0 and mine[-1]["ref_ms"] > 0
        assert any(r["ep_ms"] > 0 and r["ref_ms"] == 0 for r in mine[:-1]), [r["what"] for r in mine]
    # and each profiled step's device timeline (no kernels on the CPU: an empty one, still reported)
    timeline = [r["what"] for r in rows if r["section"] == "ep timeline"]
    assert timeline == [f"{who}: {what}" for who in ("a rank's compute", *(f"rank 0's EP step, {v}" for v in variants))
                        for what in ("wall / busy / idle ms per step of 2, gaps",
                                     "kernels beside other kernels, ms per step of 2")]
    # and each rank's exchange kernels (none on the CPU: gloo's collectives are not those kernels)
    per_rank = [r for r in rows if r["section"] == "ep exchange per rank"]
    assert [r["what"] for r in per_rank] == [f"rank {i}, {v}: exchange kernels, ms per step"
                                             for v in variants for i in (0, 1)]
    # every rank's trace of every variant, kept (readable by the timeline's listing)
    kept = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert kept == sorted(f"ep_p0_il{il}_rank{r}.json.gz" for il in ("None", "True") for r in (0, 1))
    from ray_moe.bench.timeline import load_trace
    assert load_trace(str(tmp_path / "traces" / kept[0]))  # CPU operators: events, no kernels


def test_bench_balance_train_mode_on_cpu(group_for_new, tmp_path):
    from ray_moe.bench import balance

    group_for_new(2, "STRICT_SPREAD")  # the benchmark asks for SPREAD: ranks on both nodes
    out = tmp_path / "balance.json"
    assert balance.main(["--mode", "train", "--world-size", "2", "--experts", "8", "--top-k", "2",
                         "--tokens-per-rank", "256", "--d-model", "16", "--expert-hidden", "24",
                         "--dtype", "float32", "--device", "cpu", "--iters", "2", "--zipf", "1.5",
                         "--json", str(out)]) == 0
    row = json.loads(out.read_text())["train"][0]
    assert row["clones"] >= 1
    assert row["imbalance_on"] < row["imbalance_off"]


def test_bench_overlap_rows_on_cpu(group_for_new, tmp_path):
    """`bench overlap` on CPU groups: per depth the default step and one with bf16 gradient reduction at W=2 in ABBA
    rounds and one rank's, each with its phases, per-round steps and scaling against one rank; and
    per variant the per-layer slope between the two depths."""
    from ray_moe.bench import overlap

    group_for_new(2)
    group_for_new(1)
    out = tmp_path / "overlap.json"
    assert overlap.main(["--hf-config", "qwen3_moe-tiny", "--layers", "2,3", "--tokens", "64", "--seq-len", "32",
                         "--device", "cpu", "--dtype", "float32", "--rounds", "2", "--warmup", "1", "--iters", "2",
                         "--max-bytes", "200000", "--variants", "sequential,bf16_reduce", "--trace-dir", str(tmp_path / "traces"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    names = ["one rank", "sequential", "bf16_reduce"]
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())  # one profiled step per run of round 0
    assert traces == sorted([f"{v}_l{d}_w2_rank{r}.json.gz" for v in ("sequential", "bf16_reduce") for d in (2, 3)
                             for r in (0, 1)] + [f"one_rank_l{d}_rank0.json.gz" for d in (2, 3)]), traces
    for name in traces:  # a whole step's operators in each (a profiler started off the step's thread saw ~none)
        with gzip.open(tmp_path / "traces" / name) as f:
            ops = [e for e in json.load(f)["traceEvents"] if str(e.get("name", "")).startswith("aten::")]
        assert len(ops) > 100, (name, len(ops))
    assert [(r["layers"], r["variant"]) for r in rows] == [(d, n) for d in (2, 3, "per layer") for n in names]
    assert [r["world_size"] for r in rows[:3]] == [1, 2, 2]
    for r in rows[:6]:
        assert len(r["steps_ms_per_round"]) == 2 and r["step_ms"] > 0 and r["scaling"] > 0
        assert 0 < r["forward_ms"] < r["step_ms"] and r["backward_ms"] > 0
        assert r["imbalance"] >= 1.0 and (r["world_size"] > 1 or r["imbalance"] == 1.0)
    # the one rank's slope against itself is 1 (None where timing noise made the deeper run faster)
    assert rows[0]["scaling"] == 1.0 and rows[6]["scaling"] in (1.0, None)
    for per, two, three in zip(rows[6:], rows[:3], rows[3:6]):
        diff = three["step_ms"] - two["step_ms"]  # a two-point slope, never a negative time
        assert (per["step_ms"] is None and diff <= 0) or abs(per["step_ms"] - diff) < 1e-9
