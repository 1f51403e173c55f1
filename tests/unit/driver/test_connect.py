"""Connecting to a cluster: an address that is no GCS (refused, silent, an HTTP server), a missing
or refused token, auto without a cluster: each one line naming the address and the fix, within seconds."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ray_moe.connect import ConnectError, auth_refusal, check_gcs, connect, token_problem
from ray_moe.driver.errors import GroupError


def test_no_token_names_the_mode_and_where_the_token_goes(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    line = auth_refusal("10.0.0.1:6379")
    assert "requires token authentication and this driver sends no token: export RAY_AUTH_MODE=token" in line
    assert "RAY_AUTH_TOKEN_PATH" in line and "ray get-auth-token" in line


@pytest.mark.parametrize("env, source", [
    ({"RAY_AUTH_TOKEN": "x"}, "RAY_AUTH_TOKEN"),
    ({"RAY_AUTH_TOKEN_PATH": "/tmp/tok"}, "RAY_AUTH_TOKEN_PATH=/tmp/tok"),
    ({}, "~/.ray/auth_token"),
])
def test_a_wrong_token_names_where_it_came_from(monkeypatch, env, source):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    line = auth_refusal("10.0.0.1:6379")
    assert f"refused this driver's auth token (from {source}): it is not the cluster's token" in line
    assert "ray get-auth-token" in line


def test_a_refused_token_fails_at_once_naming_where_the_token_came_from(monkeypatch):
    import subprocess

    class Refused:
        stdout = "error AuthenticationError RPC error: InvalidAuthToken\n"

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Refused())
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(ConnectError, match="requires token authentication"):
        check_gcs("127.0.0.1:1", probe_s=5.0)


@contextlib.contextmanager
def _server(reply: bytes | None):
    """A TCP server on 127.0.0.1 that answers each connection with ``reply`` (None: says nothing)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    stop = threading.Event()

    def serve():
        sock.settimeout(0.2)
        held = []
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            held.append(conn)
            if reply is not None:
                with contextlib.suppress(OSError):
                    conn.recv(1024)
                    conn.sendall(reply)
        for conn in held:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        sock.close()


def test_an_http_server_is_no_gcs_and_is_named_at_once(fresh_driver):
    with _server(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n") as address:
        t0 = time.monotonic()
        with pytest.raises(ConnectError, match=f"--address '{address}' is an HTTP server .*dashboard.*6379"):
            connect(address, timeout_s=5)
        assert time.monotonic() - t0 < 5


def test_a_port_that_accepts_but_never_answers_as_a_gcs_is_named_within_the_probe_time(fresh_driver):
    with _server(None) as address:
        t0 = time.monotonic()
        with pytest.raises(ConnectError, match="accepts connections but no Ray GCS answered there within 3s"):
            check_gcs(address, probe_s=3.0)
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("content", [None, ""])
def test_a_token_file_that_is_missing_or_empty_is_named_before_ray_is_touched(fresh_driver, monkeypatch, tmp_path,
                                                                             content):
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert str(token) in token_problem()
    with pytest.raises(ConnectError, match=f"RAY_AUTH_TOKEN_PATH={token} (cannot be read|is empty)"):
        connect("127.0.0.1:1", timeout_s=5)
    token.write_text("abc\n")
    assert token_problem() is None


def test_auto_without_a_cluster_here_is_one_line(fresh_driver, monkeypatch):
    import ray._private.services as services

    def none_here(addr, temp_dir=None):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(services, "canonicalize_bootstrap_address", none_here)
    with pytest.raises(ConnectError, match="--address auto: no Ray cluster runs on this machine"):
        connect("auto")


def test_the_driver_raises_connection_failures_as_group_errors(fresh_driver):
    from ray_moe.driver.group import connect as driver_connect

    with pytest.raises(GroupError, match="nothing listens at --address '127.0.0.1:1'"):
        driver_connect("127.0.0.1:1", timeout_s=5)


def test_a_group_that_does_not_fit_names_every_shortfall_gpus_first(monkeypatch):
    """A GPU job on a CPU machine (qwen3_30b_a3b.yaml: 8 workers of 8 CPUs and a GPU each) is
    told about its GPUs, not only about the CPUs that ran out first."""
    import ray

    from ray_moe.driver.group import WorkerGroup

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    group = object.__new__(WorkerGroup)
    group.world_size = 8
    with pytest.raises(GroupError) as info:
        group._check_fits({"CPU": 8.0, "GPU": 1.0})
    assert str(info.value) == ("parallel.world_size=8 needs 8 GPU (1 per worker) but the Ray cluster has 0 GPU in "
                               "total; and 64 CPU (8 per worker) but the Ray cluster has 2 CPU in total; lower "
                               "parallel.world_size or parallel.cpu_per_worker, or add nodes")
    group._check_fits({"CPU": 0.25})  # fits


REPO = Path(__file__).resolve().parents[3]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.run([sys.executable, "-m", "ray_moe.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**clean, "PYTHONPATH": str(REPO), **env})


def test_cli_train_with_a_missing_token_file_is_one_line_and_leaves_no_run_dir(tmp_path):
    r = _cli("train", "--config", "jobs/tiny.yaml", "--address", "127.0.0.1:1", f"train.run_dir={tmp_path / 'run'}",
             RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"ray-moe train: error: RAY_AUTH_TOKEN_PATH={tmp_path / 'nowhere'} cannot be read (No such file or directory); "
        "point it at the cluster's token file (`ray get-auth-token` on the head prints the token) or unset it"]
    assert not (tmp_path / "run").exists()  # no .run.lock, no empty metrics.jsonl


def test_cli_prepare_and_smoke_name_an_address_that_is_no_gcs(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello\n")
    from ray_moe.data.tokenizer import train_bpe

    tok = tmp_path / "tok"
    train_bpe(iter(["hello world, hello ray"] * 20), 300, tok)
    with _server(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n") as address:
        t0 = time.monotonic()
        r = _cli("prepare", "--input", str(text), "--tokenizer", str(tok), "--out", str(tmp_path / "ds"),
                 "--address", address)
        assert r.returncode == 2 and f"--address '{address}' is an HTTP server" in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "ds").exists()
        r = _cli("smoke", "--address", address)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert f"connect on cluster: --address '{address}' is an HTTP server" in r.stdout.strip().splitlines()[-1]
        assert time.monotonic() - t0 < 60


def test_cli_bench_with_a_refused_address_is_one_line():
    r = _cli("bench", "comm", "--address", "127.0.0.1:1")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "ray-moe bench: error: nothing listens at --address '127.0.0.1:1': is the Ray head running there "
        "(`ray start --head`), and is this the head's GCS port (6379 by default; `ray status` on the head prints "
        "the address)?"]


def test_auto_with_a_refused_token_names_the_token_source(fresh_driver, monkeypatch, tmp_path):
    import ray._private.services as services

    class Refused:
        stdout = "error AuthenticationError RPC error: InvalidAuthToken\n"

    token = tmp_path / "token"
    token.write_text("not the cluster's\n")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    with _server(None) as address:  # the cluster found here answers TCP; its GCS refuses the token
        monkeypatch.setattr(services, "canonicalize_bootstrap_address", lambda addr, temp_dir=None: address)
        monkeypatch.setattr(subprocess, "run", lambda *a, **k: Refused())
        with pytest.raises(ConnectError, match=f"refused this driver's auth token \\(from RAY_AUTH_TOKEN_PATH={token}\\)"):
            connect("auto", timeout_s=5)
