"""StepClock: a training step's phase times from marks read after the step's last wait (CUDA
events on a GPU, so no host synchronisation between phases: tests/gpu/test_training_gpu.py; host
wall time on the CPU, here)."""

from __future__ import annotations

import time

import pytest
import torch

from ray_moe.worker.step_clock import StepClock


def test_host_clock_measures_between_marks():
    clock = StepClock(torch.device("cpu"))
    clock.mark("start")
    time.sleep(0.02)
    clock.mark("forward")
    clock.mark("backward")
    assert 0.015 < clock.seconds("start", "forward") < 1.0
    assert 0.0 <= clock.seconds("forward", "backward") < 0.01
    assert clock.seconds("start", "backward") >= clock.seconds("start", "forward")
    with pytest.raises(KeyError):
        clock.seconds("start", "never marked")

