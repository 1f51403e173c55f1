

def test_tma_needs_a_row(monkeypatch):
    """A TMA descriptor's dimensions must be positive: a tensor of zero rows (an empty pipeline
    chunk's rows, seen on the H100) takes the pointer kernel instead."""
    import torch

    from ray_moe.kernels import grouped_tma

    monkeypatch.setattr(grouped_tma, "tma_available", lambda: True)
    assert grouped_tma.tma_ok(torch.zeros(4, 256, dtype=torch.bfloat16))
    assert not grouped_tma.tma_ok(torch.zeros(0, 256, dtype=torch.bfloat16))
