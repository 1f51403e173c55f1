"""The transport is resolved once, on the driver, into the frozen spec every rank builds from:
``parallel.transport: auto`` picks by the group's devices, an explicit choice that cannot move the
group's tensors is refused by the config's one rule, and the NVSHMEM knobs are config keys that
travel in the spec (no environment variables)."""

from __future__ import annotations

import dataclasses

import pytest

from ray_moe.comm import TransportSpec
from ray_moe.driver.group import GroupError, resolve_transport
from tests.support import small_config


def test_the_spec_carries_the_parallel_keys(tmp_path):
    cfg = small_config(tmp_path, **{"parallel.force_remote_path": True, "parallel.comm_programs": 32,
                                    "parallel.nvshmem_spin_limit": 1000, "parallel.fast_launch": False})
    spec, why = resolve_transport(cfg, use_gpu=False)
    assert spec == TransportSpec("gloo", force_remote_path=True, comm_programs=32, spin_limit=1000,
                                 fast_launch=False)
    assert "no GPUs" in why
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "nccl"


def test_auto_resolves_by_the_groups_devices_and_explicit_choices_must_fit(tmp_path):
    cfg = small_config(tmp_path, **{"parallel.transport": "auto", "parallel.device": "auto"})
    assert resolve_transport(cfg, use_gpu=True)[0].name in ("nccl", "nvshmem")
    gloo = small_config(tmp_path, **{"parallel.transport": "gloo", "parallel.device": "auto"})
    with pytest.raises(GroupError, match="parallel.transport=gloo cannot move CUDA tensors but "
                                         "parallel.device=auto and the cluster has GPUs"):
        resolve_transport(gloo, use_gpu=True)
    nccl = small_config(tmp_path, **{"parallel.transport": "nccl", "parallel.device": "auto"})
    with pytest.raises(GroupError, match="needs GPUs but parallel.device=auto and the cluster has no GPUs"):
        resolve_transport(nccl, use_gpu=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "mpi"}, "unknown transport 'mpi'"),
    ({"name": "nvshmem", "comm_programs": -1}, "comm_programs must be >= 0"),
    ({"name": "nvshmem", "spin_limit": 0}, "spin_limit must be >= 1"),
])
def test_a_bad_spec_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransportSpec(**kwargs)


def test_first_buffers_are_sized_by_the_resolved_architecture():
    """An HF architecture's hidden size and top-k (not the unused byte keys model.d_model /
    moe.top_k) size the transport's first buffers, so building the engine does not replace an
    NVSHMEM buffer sized for the wrong model."""
    from ray_moe.config import Config
    from ray_moe.driver.group import transport_buffers

    cfg = Config.from_dict({"model": {"hf_config": "qwen3_moe-tiny", "seq_len": 16},
                            "train": {"batch_size": 4}, "parallel": {"world_size": 2}})
    resolved = cfg.resolve_arch()
    assert (resolved.spec.hidden_size, resolved.spec.top_k) != (cfg.model.d_model, cfg.moe.top_k)
    buffers = transport_buffers(cfg, 2, resolved)
    assert (buffers.hidden, buffers.max_top_k, buffers.max_tokens) == (resolved.spec.hidden_size,
                                                                     resolved.spec.top_k, 2 * 16)
