"""`ray job submit` with the real CLI against a real job server started by this test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """A real Ray head (`ray start --head --block`) with the job server; token auth left on."""
    import tempfile

    temp_dir = tempfile.mkdtemp(prefix="rmj-", dir="/tmp")  # short: AF_UNIX paths are <= 107 bytes
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(tmp_path / "home")  # the auth token lands here, not in the user's home
    env["RAY_agent_register_timeout_ms"] = "120000"  # agents start slowly on a loaded 2-core host
    gcs, dash = free_port(), free_port()
    proc = subprocess.Popen(
        [str(bin_dir / "ray"), "start", "--head", "--block", f"--port={gcs}",
         f"--dashboard-port={dash}", "--include-dashboard=true", "--num-cpus=2",
         # Ray's per-node service ports are fixed by default: other clusters on this host
         # (the session's test cluster) hold them, and the job agent would not come up.
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         f"--ray-client-server-port={free_port()}",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = subprocess.run([str(bin_dir / "ray"), "job", "list", "--address", url], env=env,
                           capture_output=True, text=True)
        if r.returncode == 0:
            break
        if proc.poll() is not None:
            pytest.fail(f"ray start exited early: {proc.stdout.read().decode()[-2000:]}")
        time.sleep(2)
    else:
        pytest.fail(f"job server at {url} did not come up: {r.stdout[-1000:]} {r.stderr[-1000:]}")
    try:
        yield url, env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:  # `ray start --block` stops its services slowly
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_tiny(ray_head, tmp_path):
    url, env = ray_head
    ray = str(Path(sys.executable).parent / "ray")
    run_dir = tmp_path / "job-run"
    cmd = [ray, "job", "submit", "--address", url, "--submission-id", "tiny-test",
           "--working-dir", str(REPO), "--runtime-env", str(REPO / "jobs" / "runtime_env.yaml"), "--",
           "ray-moe", "train", "--config", "jobs/tiny.yaml", "--no-progress",
           "train.steps=4", "train.eval_batches=1", "train.eval_interval=0",
           "train.checkpoint_interval=0", "parallel.cpu_per_worker=0.5", "data.max_bytes=200000",
           f"train.run_dir={run_dir}"]
    deadline = time.monotonic() + 240
    while True:  # the job agent starts a little after the job server answers
        submit = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
        if "No available agent" not in submit.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    status = subprocess.run([ray, "job", "status", "--address", url, "tiny-test"], env=env,
                            capture_output=True, text=True)
    logs = subprocess.run([ray, "job", "logs", "--address", url, "tiny-test"], env=env,
                          capture_output=True, text=True).stdout
    assert "succeeded" in (status.stdout + status.stderr).lower(), (submit.stdout[-3000:], submit.stderr[-3000:])
    assert "# summary" in logs and "last_loss" in logs, logs[-3000:]
    assert (run_dir / "metrics.jsonl").exists()
    assert list((run_dir / "checkpoints").glob("step_00000004"))
