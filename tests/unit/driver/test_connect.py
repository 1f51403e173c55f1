"""Connecting to a cluster with token authentication: a refused token (or none) is one line naming
the fix, after one request instead of ray.init's 20 tries and 20 warnings."""

from __future__ import annotations

import time

import pytest

import ray._raylet
from ray_moe.driver.group import GroupError, _check_auth, auth_refusal


class AuthenticationError(Exception):  # Ray's, matched by name
    pass


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


def test_a_refused_token_fails_at_once_and_anything_else_is_left_to_ray_init(monkeypatch):
    class Refusing:
        def __init__(self, address, cluster_id):
            raise AuthenticationError("RPC error: InvalidAuthToken")

    class Slow:
        def __init__(self, address, cluster_id):
            time.sleep(5)

    monkeypatch.setattr(ray._raylet, "GcsClient", Refusing)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(GroupError, match="requires token authentication"):
        _check_auth("10.0.0.1:6379", 5.0)
    monkeypatch.setattr(ray._raylet, "GcsClient", Slow)
    t0 = time.monotonic()
    _check_auth("10.0.0.1:6379", 0.2)  # no answer in time: ray.init says what it says
    assert time.monotonic() - t0 < 2


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
