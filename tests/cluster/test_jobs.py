"""The README's `ray job submit` lines, run as written, against the real `ray start --head` they
start (token auth on), from a fresh copy of the repository; then, on that one-node cluster, Ray's
metrics endpoint shows the training gauges and `ray-moe smoke` passes with its defaults.

The README's head takes Ray's default ports; the session's own cluster (tests/cluster/conftest.py)
takes free ones, so under ``pytest -n 2`` this module runs beside it (tests/lanes.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def readme_block(marker: str) -> str:
    """The shell block that follows ``<!-- marker -->`` in the README."""
    text = README.read_text()
    m = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)```", text, re.S)
    assert m, f"README has no ```bash block after <!-- {marker} -->"
    return m.group(1)


def fresh_copy(dest: Path) -> Path:
    """The files a fresh clone would have (tracked, and new files git does not ignore), with the
    test's own environment as its .venv (the README's set-up line made that one)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for name in files:
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(Path(sys.prefix))
    return dest


def session_processes(sid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[3]) == sid:
                out.append(int(entry.name))
    return out


def kill_session(sid: int) -> None:
    """SIGTERM, then SIGKILL, every process of one session (the README's head and its job)."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        for pid in session_processes(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while session_processes(sid) and time.monotonic() < deadline:
            time.sleep(0.2)


def scrape(tmp_ray: Path, name: str, timeout: float) -> str | None:
    """The first Prometheus sample line of ``name`` on the cluster's metrics endpoint (the targets
    come from Ray's service-discovery file), or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sd = tmp_ray / "ray" / "prom_metrics_service_discovery.json"  # Ray's temp dir is RAY_TMPDIR/ray
        try:
            targets = [t for entry in json.loads(sd.read_text()) for t in entry["targets"]]
        except (OSError, ValueError, KeyError):
            targets = []
        for target in targets:
            try:
                body = urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read().decode()
            except OSError:
                continue
            for line in body.splitlines():
                if line.startswith(name) and not line.startswith("#"):
                    return line
        time.sleep(1)
    return None


@pytest.fixture(scope="module")
def readme_job(tmp_path_factory):
    """Runs the README's job-submit lines in a fresh copy with a private HOME (where the auth
    token goes) and Ray temp dir; yields (copy, env, completed process, metrics sample)."""
    root = tmp_path_factory.mktemp("readme-job")
    repo = fresh_copy(root / "ray_moe")
    tmp_ray = Path(tempfile.mkdtemp(prefix="rmj-", dir="/tmp"))  # AF_UNIX paths are <= 107 bytes
    home = root / "home"
    home.mkdir()
    # A fresh shell: no venv on PATH, no Ray variables; HOME and Ray's temp dir private to the test.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    env.update(HOME=str(home), RAY_TMPDIR=str(tmp_ray), RAY_metrics_report_interval_ms="1000",
               RAY_agent_register_timeout_ms="120000")
    script = "set -e\n" + readme_block("job-submit")
    proc = subprocess.Popen(["bash", "-c", script], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        sample = scrape(tmp_ray, "ray_moe_train_loss", timeout=240)
        out, _ = proc.communicate(timeout=400)
        yield repo, env, proc.returncode, out, sample
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_session(proc.pid)
        shutil.rmtree(tmp_ray, ignore_errors=True)


def test_readme_job_submit_succeeds_and_outputs_land_where_configured(readme_job):
    repo, env, rc, out, _ = readme_job
    assert rc == 0, out[-4000:]
    assert "succeeded" in out.lower() and "# summary" in out, out[-3000:]
    run = repo / "runs" / "tiny-job"  # train.storage_path="$PWD" + train.run_dir=runs/tiny-job
    assert f"# run_dir {run}" in out and f"# results in {run}" in out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == list(range(1, 51))
    assert (run / "checkpoints" / "step_00000050" / "meta.json").is_file()
    assert "\r" not in out  # a job's log gets progress lines, not a bar


def test_ray_metrics_endpoint_shows_the_training_gauges(readme_job):
    *_, sample = readme_job
    assert sample is not None, "no ray_moe_train_loss on the cluster's Prometheus endpoint"
    assert 'run="tiny-job"' in sample and float(sample.rsplit(" ", 1)[1]) > 0


def test_smoke_passes_with_its_defaults_on_the_one_node_cluster(readme_job):
    repo, env, rc, *_ = readme_job
    assert rc == 0
    run_env = dict(env, RAY_AUTH_MODE="token", PYTHONPATH="")
    report_path = repo.parent / "smoke.json"
    r = subprocess.run([f"{repo}/.venv/bin/ray-moe", "smoke", "--address", "127.0.0.1:6379",
                        "--json", str(report_path)],
                       cwd=repo.parent, env=run_env, capture_output=True, text=True, timeout=300)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and last.startswith("smoke: PASSED"), r.stdout[-4000:] + r.stderr[-2000:]
    results = json.loads(report_path.read_text())["results"]
    by_check = {}
    for res in results:
        by_check.setdefault(res["check"], []).append(res)
    assert {res["status"] for res in by_check["layer_parity"]} == {"pass"}
    assert "not run at EP 1: empty_rank" in by_check["layer_parity"][0]["detail"]  # named, not failed
    assert [res["status"] for res in by_check["bandwidth"]] == ["skip"]
    assert "one rank" in by_check["bandwidth"][0]["detail"]
    assert {res["status"] for res in by_check["training"]} == {"pass"}
