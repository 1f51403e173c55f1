"""train.overlap_update on the CPU: the update groups by name, the config key, and the engine
running the update in place (the side stream is CUDA only; tests/gpu/test_precision_gpu.py
checks the overlapped update against the update in place)."""

from __future__ import annotations

import pytest
import torch

from ray_moe.config import Config, ConfigError
from ray_moe.worker.overlap import update_groups


def test_update_groups_follow_the_forward():
    names = ["embed_tokens.weight", "embed_positions", "layers.0.attn.qkv.weight", "layers.0.mlp.routed.w13",
             "layers.1.norm1.weight", "layers.10.mlp.routed.w2", "norm.weight", "lm_head.weight"]
    assert update_groups(names, 11) == [0, 0, 1, 1, 2, 11, 12, 12]
    assert update_groups(["w", "embed"], 0) == [1, 0]  # no blocks: everything but the embeddings last


def test_overlap_update_is_a_boolean_key():
    assert Config().with_overrides(["train.overlap_update=true"]).train.overlap_update is True
    cfg = Config()
    cfg.train.overlap_update = "yes please"
    with pytest.raises(ConfigError, match="train.overlap_update='yes please' must be true or false"):
        cfg.train.check()


def test_engine_on_the_cpu_updates_in_place(tmp_path):
    from ray_moe.comm.local import LocalTransport
    from ray_moe.worker.engine import Engine
    from tests.support import single_rank, small_config

    cfg = small_config(tmp_path, world_size=1, **{"train.overlap_update": True})
    e = Engine(cfg, single_rank(), LocalTransport(), torch.device("cpu"), cfg.resolve_arch())
    assert e.overlap is None
    assert e.train_step()["loss"] > 0
    e.close()


class _FakeCuda:
    """torch.cuda's streams and events as a log: which event each wait names, in order."""

    def __init__(self):
        self.log, self.n = [], 0

    def install(self, monkeypatch):
        fake = self

        class Event:
            def __init__(self):
                self.name = None

            def record(self, stream=None):
                fake.n += 1
                self.name = f"e{fake.n}"
                fake.log.append(("record", self.name))

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                fake.log.append(("side waits main",))

            def wait_event(self, ev):
                fake.log.append(("main waits", ev.name))

        main = Stream()
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())


def test_the_forward_waits_block_by_block(monkeypatch):
    """The wait logic with a logged stand-in for CUDA: the embeddings' group waits for the
    prelude (torch's AdamW, when none of its parameters is one-pass), each block for its own
    event, a block with clone slots and the final norm for the whole update; a second forward
    (recompute) waits for nothing; gradients are marked as used by the side stream."""
    from torch import nn

    from ray_moe.worker.overlap import UpdateOverlap

    fake = _FakeCuda()
    fake.install(monkeypatch)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(2, 2)
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            self.norm = nn.LayerNorm(2)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    model = Model()
    one_pass = [("layers.0.weight", model.layers[0].weight), ("layers.1.weight", model.layers[1].weight),
                ("layers.1.bias", model.layers[1].bias), ("layers.2.weight", model.layers[2].weight),
                ("norm.weight", model.norm.weight)]
    ov = UpdateOverlap(model, [n for n, _ in one_pass], [p for _, p in one_pass], torch.device("cpu"),
                       late_groups={3})
    marked = []

    class Grad:
        def record_stream(self, stream):
            marked.append(stream)

    def update(done):
        done(None)  # torch's AdamW and the refresh: e1
        for _, p in one_pass:
            done(p)  # layers.0 → e2, layers.1 (after its second) → e3, layers.2 late, norm final
    ov.launch(update, [Grad(), Grad()])
    assert len(marked) == 2 and ov.pending
    assert fake.log == [("side waits main",), ("record", "e1"), ("record", "e2"), ("record", "e3"),
                        ("record", "e4")]
    fake.log.clear()
    ov.wait_group(0)  # the embeddings: no one-pass parameter → the prelude
    model(torch.zeros(1, 2))
    assert fake.log == [("main waits", "e1"), ("main waits", "e2"), ("main waits", "e3"),
                        ("main waits", "e4")]  # layers.2 is late: the whole update (e4), then norm: nothing left
    assert not ov.pending
    fake.log.clear()
    model(torch.zeros(1, 2))  # a recompute: nothing pending
    assert fake.log == []
    ov.close()
    model(torch.zeros(1, 2))
    assert fake.log == []


def test_a_block_waits_for_the_collectives_that_write_its_parameters(monkeypatch):
    """ZeRO's parameters reported with their all-gathers (parallel.overlap_param_gather): a block
    waits for its event, then on the main stream for each collective writing its parameters (one
    bucket's work once, however many of its parameters); the side stream never waits for one;
    the final norm's wait_all waits for the collectives not yet waited for."""
    from torch import nn

    from ray_moe.worker.overlap import UpdateOverlap

    fake = _FakeCuda()
    fake.install(monkeypatch)

    class Work:
        def __init__(self, name):
            self.name = name

        def wait(self):
            fake.log.append(("main waits work", self.name))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(4, 2)
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.norm = nn.LayerNorm(2)

        def forward(self, x):
            x = self.embed_tokens(x)
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    model = Model()
    zero = [("embed_tokens.weight", model.embed_tokens.weight), ("layers.0.bias", model.layers[0].bias),
            ("layers.1.bias", model.layers[1].bias), ("norm.weight", model.norm.weight)]
    experts = [("layers.0.weight", model.layers[0].weight), ("layers.1.weight", model.layers[1].weight)]
    named = zero + experts
    ov = UpdateOverlap(model, [n for n, _ in named], [p for _, p in named], torch.device("cpu"))
    emb, mid, last = Work("emb"), Work("mid"), Work("last")

    def update(done):
        done(model.embed_tokens.weight, emb)  # group 0 complete → e1
        done(model.layers[0].bias, mid)
        done(model.layers[1].bias, mid)  # one bucket, two blocks
        done(model.norm.weight, last)  # the final group: no event
        done(None)  # → e2
        done(model.layers[0].weight)  # → e3 (block 0)
        done(model.layers[1].weight)  # → e4 (block 1)
    ov.launch(update, [])
    assert fake.log == [("side waits main",), ("record", "e1"), ("record", "e2"), ("record", "e3"),
                        ("record", "e4"), ("record", "e5")]  # e5: the final event
    fake.log.clear()
    ov.wait_group(0)
    model(torch.zeros(1, dtype=torch.long))
    assert fake.log == [("main waits", "e1"), ("main waits work", "emb"),
                        ("main waits", "e3"), ("main waits work", "mid"),
                        ("main waits", "e4"), ("main waits work", "mid"),
                        ("main waits", "e5"), ("main waits work", "last")]
    assert not ov.pending
    ov.close()
