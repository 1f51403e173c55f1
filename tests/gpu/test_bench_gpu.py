"""The benchmarks' own instruments on a GPU: what they report must be able to show a problem."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_the_steady_loop_counter_sees_a_host_synchronisation():
    """The positive control of `bench layer`'s `host_syncs_per_step`: a `.item()` inside the
    counted region is one line naming where it came from; device work alone is none."""
    from ray_moe.bench.ep_layer import _host_syncs

    dev = torch.device("cuda")
    x = torch.ones(1024, device=dev)
    with _host_syncs(dev) as none:
        (x * 2).sum()
    with _host_syncs(dev) as one:
        (x * 2).sum().item()
    assert none == [] and len(one) == 1 and "test_bench_gpu.py" in one[0], (none, one)
    assert torch.cuda.get_sync_debug_mode() == 0  # restored


def test_the_chunking_section_reports_every_split_against_the_unchunked_layer(tmp_path):
    """`bench layer --sections chunking` on a small shape: the experts' forward in chunks and the
    pipelined layer's step, each split named, its chunks summing to the whole, ratios > 0."""
    import json

    from ray_moe.bench import layer

    out = tmp_path / "chunking.json"
    assert layer.main(["--sections", "chunking", "--T", "512", "--H", "256", "--I", "128", "--E", "8", "--K", "2",
                       "--warmup-ms", "5", "--rep-ms", "20", "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["section"] == "chunking T=512 E=8"]
    names = [r["what"] for r in rows]
    assert names[0] == "experts' forward, all tokens" and "experts' forward in chunks 1-6-1" in names
    assert "layer step (fwd+bwd), sequential" in names and "layer step (fwd+bwd), pipelined, chunks 1-6-1" in names
    for r in rows:
        assert r["ms"] > 0 and r["ratio"] > 0, r
        if "chunks_ms" in r:
            assert abs(sum(r["chunks_ms"]) - r["ms"]) < 1e-2 * len(r["chunks_ms"])
