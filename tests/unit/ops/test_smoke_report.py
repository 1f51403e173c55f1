"""Smoke-test report assembly (pure) and the GPU cluster launcher config."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ray_moe.ops.smoke_report import FAIL, PASS, SKIP, SmokeReport, condense_error

REPO = Path(__file__).resolve().parents[3]


def test_report_summary_names_node_gpu_and_check():
    rep = SmokeReport()
    rep.add("import", PASS, node_id="a" * 56, ip="10.0.0.1", detail="ok")
    rep.add("device", FAIL, node_id="b" * 56, ip="10.0.0.2", gpu=3, detail="CUDA error: no device\nmore")
    rep.add("training", SKIP, detail="skipped")
    assert not rep.ok
    line = rep.summary_line()
    assert line.startswith("smoke: FAILED (1 passed, 1 failed, 1 skipped)")
    assert "device on node bbbbbbbb (10.0.0.2) GPU 3: CUDA error: no device" in line
    assert "more" not in line


def test_report_tables_and_json(tmp_path):
    rep = SmokeReport(info={"world_size": 2})
    rep.add("bootstrap", PASS, node_id="n1", ip="1.2.3.4", rank=0, detail="x" * 500)
    rep.add("bandwidth", PASS, node_id="n1", rank=0, detail="→ rank 1")
    rep.bandwidth = {"labels": ["0: n1/cpu", "1: n2/cpu"], "gbps": [[None, 1.5], [2.25, None]], "bytes": 4 << 20}
    text = rep.render()
    assert text.index("## bootstrap") < text.index("## bandwidth")
    assert "x" * 500 not in text  # long details are cut in tables, kept in JSON
    assert "1.50" in text and "2.25" in text and "4 MiB" in text
    rep.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ok"] and data["summary"] == rep.summary_line() and data["results"][0]["detail"] == "x" * 500
    assert data["bandwidth"]["gbps"][1][0] == 2.25


def test_empty_report_is_not_a_pass():
    assert not SmokeReport().ok
    assert "no check ran" in SmokeReport().summary_line()


def test_condense_error_keeps_the_root_cause():
    text = ("start: worker died: \x1b[36mray::EPWorker.__init__()\x1b[39m (pid=1)\n  File \"x.py\", line 1\n"
            "RuntimeError: failed to import\n\n  File \"/tmp/shadow/ray_moe/__init__.py\"\n"
            "ImportError: planted fault\n")
    assert condense_error(text) == "ImportError: planted fault (from: start: worker died: ray::EPWorker.__init__() (pid=1))"
    assert condense_error("plain message") == "plain message"
    assert condense_error("") == ""


def test_gpu_cluster_yaml_parses_and_keeps_multicast_off_and_auth_on():
    cfg = yaml.safe_load((REPO / "cluster" / "gpu_cluster.yaml").read_text())
    assert {"cluster_name", "provider", "available_node_types", "head_node_type"} <= set(cfg)
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    assert any(t.get("resources", {}).get("GPU", 0) >= 1 for t in types.values())
    assert any("[gpu]" in cmd for cmd in cfg["setup_commands"])
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        text = "\n".join(cfg[key])
        for var in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1",
                    "RAY_AUTH_MODE=token"):
            assert var in text, (key, var)
        assert "ray start" in text
