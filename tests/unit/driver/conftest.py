"""Fixtures of the driver's unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def fresh_driver(monkeypatch):
    """This process as a fresh driver: Ray not initialised (under ``pytest -n 2`` the process that
    ran the session cluster's tests, still connected to it, may run these next), ``ray.init`` a
    failure (the address checks must refuse first), no token path or address in the environment."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init reached with an unusable address"))
    for key in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
