"""Cluster smoke test against real multi-node clusters started by cluster/local_cluster.py.

The session cluster of conftest.py lives in this pytest process, so the smoke test runs as a
subprocess (``python -m ray_moe.cli smoke``) that connects to the cluster started here. It runs
from a neutral directory: Ray puts the driver's working directory on the workers' sys.path, which
would otherwise hide a node's broken installation behind this checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from ray_moe.ops.smoke_report import FAIL, PASS, SKIP

REPO = Path(__file__).resolve().parents[2]
LOCAL_CLUSTER = REPO / "cluster" / "local_cluster.py"
# Time limits scale with the machine: 90 s (smoke --timeout: one probe, start-up or collective)
# and 120 s (stopping a cluster) held on 8 cores, and were missed on a loaded 2-core machine.
SLOW = max(1.0, 8 / (os.cpu_count() or 1))
SMOKE_TIMEOUT_S = int(90 * SLOW)


def cluster_env() -> dict[str, str]:
    """This process's environment minus what conftest set for its own throwaway cluster."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ""  # the nodes and the smoke driver import the installed package
    return env


class LocalClusters:
    """Clusters started with cluster/local_cluster.py; whatever is still running is stopped at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: list[Path] = []

    def start(self, nodes: int = 2, env_node: tuple[str, ...] = ()) -> dict:
        """→ the state dict of a running cluster (address, client_env, nodes with their node ids)."""
        state = self.root / f"cluster{len(self.running)}-{len(list(self.root.iterdir()))}.json"
        cmd = [sys.executable, str(LOCAL_CLUSTER), "start", "--nodes", str(nodes), "--cpus-per-node", "2",
               "--state", str(state)]
        for item in env_node:
            cmd += ["--env-node", item]
        self.running.append(state)
        r = subprocess.run(cmd, env=cluster_env(), capture_output=True, text=True, timeout=240 * SLOW)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"python {os.path.relpath(LOCAL_CLUSTER)} env --state {state}" in r.stdout  # runnable as printed
        info = json.loads(state.read_text())
        assert r.stdout.strip().splitlines()[-1] == info["address"]
        return info | {"state_file": str(state)}

    def stop(self, info: dict) -> None:
        state = Path(info["state_file"])
        r = subprocess.run([sys.executable, str(LOCAL_CLUSTER), "stop", "--state", str(state)],
                           env=cluster_env(), capture_output=True, text=True, timeout=120 * SLOW)
        self.running.remove(state)
        assert r.returncode == 0, r.stderr
        # a killed node leaves /proc once its new parent reaps it, which a loaded host may delay
        deadline = time.monotonic() + 30
        while any(_running(n["pid"]) for n in info["nodes"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_running(n["pid"]) for n in info["nodes"])


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


@pytest.fixture
def local_clusters(tmp_path_factory) -> Iterator[LocalClusters]:
    clusters = LocalClusters(tmp_path_factory.mktemp("clusters"))
    yield clusters
    for state in list(clusters.running):
        if state.exists():
            clusters.stop(json.loads(state.read_text()) | {"state_file": str(state)})


def run_smoke(state: dict, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "smoke.json"
    env = cluster_env() | state["client_env"]
    cmd = [sys.executable, "-m", "ray_moe.cli", "smoke", "--address", state["address"],
           "--json", str(out), "--timeout", str(SMOKE_TIMEOUT_S), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=4 * SMOKE_TIMEOUT_S, cwd=tmp_path)
    return r, (json.loads(out.read_text()) if out.exists() else {})


def test_smoke_passes_on_two_nodes(ray_cluster, tmp_path):
    """The session's two-node cluster (other tests' groups alive on it) passes every check."""
    import ray

    session = {"address": ray_cluster, "client_env": {"RAY_AUTH_MODE": "disabled"}}
    r, report = run_smoke(session, tmp_path, "--steps", "4")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert report["ok"], report["summary"]
    statuses = {}
    for res in report["results"]:
        statuses.setdefault(res["check"], set()).add(res["status"])
    for check in ("import", "device", "bootstrap", "layer_parity", "transport", "bandwidth", "training"):
        assert statuses.get(check) == {PASS}, (check, statuses)
    node_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(node_ids) == 2
    assert {res["node_id"] for res in report["results"] if res["check"] == "bootstrap"} == node_ids
    gbps = report["bandwidth"]["gbps"]
    assert gbps[0][1] > 0 and gbps[1][0] > 0
    losses = next(res for res in report["results"] if res["check"] == "training")["data"]["losses"]
    assert losses[-1] < losses[0]
    assert "bandwidth matrix" in r.stdout and r.stdout.strip().splitlines()[-1].startswith("smoke: PASSED")


def test_smoke_names_a_broken_node(local_clusters, tmp_path):
    """A local_cluster.py cluster (token auth on) whose node 1 cannot import ray_moe: non-zero exit
    naming that node and the check; stop kills exactly its nodes."""
    shadow = tmp_path / "shadow"
    (shadow / "ray_moe").mkdir(parents=True)
    (shadow / "ray_moe" / "__init__.py").write_text('raise ImportError("planted fault: no ray_moe here")\n')
    bad = local_clusters.start(2, env_node=(f"1:PYTHONPATH={shadow}",))
    assert bad["client_env"]["RAY_AUTH_MODE"] == "token"  # token auth on by default
    assert oct(Path(bad["client_env"]["RAY_AUTH_TOKEN_PATH"]).stat().st_mode & 0o777) == "0o600"
    broken_node = bad["nodes"][1]["node_id"]
    r, report = run_smoke(bad, tmp_path, "--steps", "2")
    summary = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-3000:]
    assert summary.startswith("smoke: FAILED"), summary
    assert f"import on node {broken_node[:8]}" in summary and "planted fault" in summary, summary
    failed = [res for res in report["results"] if res["status"] == FAIL]
    assert [res["node_id"] for res in failed if res["check"] == "import"] == [broken_node]
    assert any(res["check"] == "bootstrap" for res in failed)
    assert {res["check"] for res in report["results"] if res["status"] == SKIP} >= {"layer_parity", "training"}


def test_local_cluster_rejects_a_bad_env_node(tmp_path):
    r = subprocess.run([sys.executable, str(LOCAL_CLUSTER), "start", "--nodes", "2", "--env-node", "5:X=1",
                        "--state", str(tmp_path / "s.json")], capture_output=True, text=True)
    assert r.returncode != 0 and "node 5 does not exist" in r.stderr



