"""Fixtures for every test: environment, the GPU marker, functions shipped to Ray workers by value.

``tests/unit`` needs no Ray; ``tests/cluster`` shares one local Ray cluster and its worker groups
(``tests/cluster/conftest.py``); ``tests/gpu`` runs on the GPU machine (skipped without CUDA).
"""

from __future__ import annotations

import os

import pytest

from tests import lanes
from tests.interpreter_scripts import InterpreterScripts

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # throwaway clusters owned by this test session
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports (Ray Data queries Prometheus for them)
# Ray starts idle Python workers for the first driver of a cluster; the suite starts several
# clusters and each idle worker costs ~1.7 s of CPU (Python + Ray imports) on the 2-core CI machine.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Ray runs its workers at niceness 15 so that its own daemons stay responsive. Here the suite's
# other lane (unit tests, interpreter scripts) runs at niceness 0 on the same two cores, and the
# kernel then gives a worker about 1/28 of a busy core: a rank that starts in 3 s alone took over
# 60 s, past a group's start-up timeout. Workers at 0 share the cores evenly.
os.environ.setdefault("RAY_worker_niceness", "0")


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped without CUDA; tests that read a background interpreter script run
    last, so their scripts have the rest of the session to finish."""
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    waits = [item for item in items if item.get_closest_marker("interpreter_script")]
    items[:] = [item for item in items if not item.get_closest_marker("interpreter_script")] + waits


def pytest_runtest_setup(item):
    lanes.check_lane(item)


def pytest_runtest_logreport(report):
    """``RAY_MOE_INSTAFAIL=1``: print a failure as it happens (a device command killed at its time
    limit never reaches pytest's summary)."""
    if report.failed and os.environ.get("RAY_MOE_INSTAFAIL"):
        import sys

        sys.__stderr__.write(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-4000:]}\n")
        sys.__stderr__.flush()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n 2``: the session cluster's tests in one lane, the rest in the other (tests/lanes.py);
    an explicit ``--dist`` other than xdist's default ``load`` is left to xdist."""
    return lanes.make_scheduler(config, log) if config.getvalue("dist") == "load" else None


INTERPRETER_SCRIPTS = pytest.StashKey[InterpreterScripts]()


def pytest_configure(config):
    config.stash[INTERPRETER_SCRIPTS] = InterpreterScripts()


def pytest_unconfigure(config):
    if INTERPRETER_SCRIPTS in config.stash:
        config.stash[INTERPRETER_SCRIPTS].close()


def pytest_collection_finish(session):
    """Functions defined in test modules travel to workers by value (workers can't import tests);
    the selected tests' Triton-interpreter scripts start running in the background (in an xdist
    worker, which does not know yet which tests it will get, each starts when a test first asks)."""
    import ray.cloudpickle as cloudpickle

    for module in {getattr(item, "module", None) for item in session.items} - {None}:
        cloudpickle.register_pickle_by_value(module)
    scripts = [tuple(m.args) for item in session.items for m in item.iter_markers("interpreter_script")]
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        session.config.stash[INTERPRETER_SCRIPTS].start(scripts)


@pytest.fixture(scope="session")
def interpreter_scripts(request) -> InterpreterScripts:
    """The session's :class:`tests.interpreter_scripts.InterpreterScripts`: ``.result(*argv)`` waits for a script."""
    return request.config.stash[INTERPRETER_SCRIPTS]


@pytest.fixture(scope="session")
def multi_pe_run():
    """tests/nvshmem_pes.py at the suite's settings (several NVSHMEM PEs on the CPU), started in the
    background at the first request in this test process: {world size: run} for two ranks and for
    three; ``.result(timeout_s)`` waits for a run. tests/unit/comm/test_nvshmem_kernels.py requests
    it early, so the runs go on beside that module's tests; under ``-n 2`` both modules are one
    scope (tests/lanes.py), or each test process would start runs of its own."""
    from tests.nvshmem_pes import SUITE_ARGS, SUITE_ARGS_W3, BackgroundRun

    runs = {2: BackgroundRun(SUITE_ARGS), 3: BackgroundRun(SUITE_ARGS_W3)}
    yield runs
    for run in runs.values():
        run.close()


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """tiny_hf(family) → the directory of a tiny random transformers model of that family
    (qwen3_moe | mixtral | glm4_moe), saved once per test session (transformers, no download)."""
    pytest.importorskip("transformers")
    from tests.hf_parity import save_tiny_model

    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            path = tmp_path_factory.mktemp(f"hf_{family}")
            save_tiny_model(family, path, seed=1)
            made[family] = str(path)
        return made[family]

    return get
