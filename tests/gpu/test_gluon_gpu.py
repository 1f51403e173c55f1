"""GPU checks of the Gluon warp-specialised grouped GEMM (ray_moe/kernels/gluon_grouped.py):
bf16 against the float32 reference on fresh random inputs (empty groups, one group holding every
row, uneven counts, P not a multiple of the row tile, H not a multiple of the column tile, S=1,
rows past offsets[S] left unwritten), every sweep configuration, many tiles per CTA, and a
CUDA-graph capture whose replay with new offsets equals eager. Needs an sm_90 GPU and Triton's
Gluon (3.6 API); skipped otherwise. Run on the GPU machine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_moe.validation import rel_err

pytestmark = pytest.mark.gpu

TOL = 1e-2  # relative Frobenius error, as tests/gpu/test_kernels_gpu.py


def _needs_gluon_sm90():
    from ray_moe.kernels import gluon_grouped as gg

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the Gluon kernel is for sm_90 (Hopper), this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    reason = gg.gluon_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return gg


@pytest.fixture(autouse=True)
def _poison_allocator():
    """Fill the caching allocator's free memory with NaN so that a read of an unwritten row shows
    up as NaN instead of stale finite data."""
    if torch.cuda.is_available():
        junk = torch.full((1 << 27,), float("nan"), device="cuda")
        del junk
    yield


def _offsets(P: int, S: int, pattern: str, g: torch.Generator) -> torch.Tensor:
    """int32 [S+1] group offsets on the GPU for P rows (the last group ends at P unless ``tail``)."""
    if pattern == "random":
        counts = torch.bincount(torch.randint(0, S, (P,), generator=g), minlength=S)
    elif pattern == "uneven":  # geometric-ish sizes, a few empty
        w = torch.rand(S, generator=g) ** 4
        w[torch.randperm(S, generator=g)[: S // 4]] = 0
        w[0] = w[0] + 1e-3
        counts = torch.floor(w / w.sum() * P).long()
        counts[int(torch.argmax(w))] += P - int(counts.sum())
    elif pattern == "one":  # every row in one (middle) group
        counts = torch.zeros(S, dtype=torch.long)
        counts[S // 2] = P
    elif pattern == "empties":  # first and last groups empty, half of the others too
        counts = torch.bincount(torch.randint(0, S, (P,), generator=g), minlength=S)
        empty = [0, S - 1] + list(range(1, S - 1, 2))
        moved = int(counts[empty].sum())
        counts[empty] = 0
        counts[S // 2 if S // 2 not in empty else S // 2 + 1] += moved
    elif pattern == "tail":  # offsets[S] < P: the last rows belong to no group
        counts = torch.bincount(torch.randint(0, S, (P - 37,), generator=g), minlength=S)
    elif pattern == "sparse":  # 0..3 rows per group
        counts = torch.randint(0, 4, (S,), generator=g)
    else:
        raise ValueError(pattern)
    offs = torch.zeros(S + 1, dtype=torch.int32)
    offs[1:] = counts.cumsum(0).to(torch.int32)
    return offs.cuda()


def _case(P, I, H, S, pattern, seed):
    g = torch.Generator().manual_seed(seed)
    offsets = _offsets(P, S, pattern, g)
    gd = torch.Generator(device="cuda").manual_seed(seed)
    act = torch.randn(P, I, device="cuda", dtype=torch.bfloat16, generator=gd)
    w2 = (torch.randn(S, I, H, device="cuda", generator=gd) / I ** 0.5).to(torch.bfloat16)
    return act, w2, offsets


def _check(gg, out, act, w2, offsets):
    """bf16 result vs the float32 reference over the valid rows (relative error, and elementwise
    so that one wrong tile cannot hide in the norm); rows past offsets[S] still NaN."""
    ref = gg.reference_grouped_rows(act, w2, offsets)
    nv = int(offsets[-1])
    err = rel_err(out[:nv].float(), ref[:nv])
    assert err < TOL, err
    if nv:
        scale = ref[:nv].abs().max().item()
        torch.testing.assert_close(out[:nv].float(), ref[:nv], rtol=2e-2, atol=2e-2 * scale + 1e-6)
    assert out[nv:].isnan().all(), "rows past offsets[S] were written"
    return err


CASES = [
    # P, I, H, S, pattern
    (4096, 512, 1024, 8, "random"),
    (1000, 256, 384, 4, "random"),  # P not a multiple of 128, H not a multiple of 256
    (777, 128, 512, 1, "random"),  # S = 1
    (2000, 192, 256, 16, "empties"),  # first / last / every other group empty
    (1500, 256, 512, 6, "one"),  # all rows in one group
    (3000, 320, 768, 12, "uneven"),
    (600, 64, 256, 5, "tail"),  # rows past offsets[S] unwritten
    (200, 128, 256, 64, "sparse"),  # groups of 0..3 rows (at most 192 rows)
]


@pytest.mark.parametrize("P,I,H,S,pattern", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gluon_down_matches_reference(P, I, H, S, pattern, seed):
    gg = _needs_gluon_sm90()
    act, w2, offsets = _case(P, I, H, S, pattern, seed)
    assert gg.down_gluon_ok(act, w2, offsets)
    out = torch.full((P, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    gg.launch_down_gluon(act, w2, offsets, out)
    _check(gg, out, act, w2, offsets)


def test_every_sweep_config_matches_reference():
    """Each tile / ring / epilogue variant of the bench sweep, on an uneven problem with partial
    row and column tiles, and a few CTAs walking many tiles each (ring phases across tiles)."""
    gg = _needs_gluon_sm90()
    act, w2, offsets = _case(5000, 384, 640, 9, "uneven", 3)
    for s in gg.SWEEP_CONFIGS:
        for progs in (0, 3):
            cfg = dataclasses.replace(gg.GluonDownConfig.parse(s), num_progs=progs)
            out = torch.full((act.shape[0], w2.shape[2]), float("nan"), device="cuda", dtype=torch.bfloat16)
            gg.launch_down_gluon(act, w2, offsets, out, cfg=cfg)
            try:
                _check(gg, out, act, w2, offsets)
            except AssertionError as e:
                raise AssertionError(f"config {s} num_progs={progs}: {e}") from e


def test_large_problem_many_tiles_per_cta():
    """The bench's shape family, smaller: 128 experts with balanced random routing."""
    gg = _needs_gluon_sm90()
    act, w2, offsets = _case(32768, 1536, 2048, 32, "random", 7)
    out = torch.full((act.shape[0], w2.shape[2]), float("nan"), device="cuda", dtype=torch.bfloat16)
    gg.launch_down_gluon(act, w2, offsets, out)
    _check(gg, out, act, w2, offsets)


def test_cuda_graph_replay_with_new_offsets_equals_eager():
    """Captured once; new act and offsets (another tile count) copied in; the replay equals an
    eager launch bit for bit (each output element is one CTA's fixed-order sum) and the reference."""
    from ray_moe.device import capture_graph

    gg = _needs_gluon_sm90()
    P, I, H, S = 3000, 256, 512, 8
    act, w2, offsets = _case(P, I, H, S, "random", 11)
    out = torch.full((P, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    graph, _ = capture_graph(lambda: gg.launch_down_gluon(act, w2, offsets, out))
    for seed, pattern in ((12, "uneven"), (13, "empties"), (14, "one")):
        act2, _, offs2 = _case(P, I, H, S, pattern, seed)
        act.copy_(act2)
        offsets.copy_(offs2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.full_like(out, float("nan"))
        gg.launch_down_gluon(act, w2, offsets, eager)
        nv = int(offsets[-1])
        assert torch.equal(out[:nv], eager[:nv]), pattern
        _check(gg, out, act, w2, offsets)


def test_ok_check_refuses_what_the_kernel_cannot_run():
    gg = _needs_gluon_sm90()
    act, w2, offsets = _case(256, 128, 256, 4, "random", 0)
    assert gg.down_gluon_ok(act, w2, offsets)
    act_odd = torch.randn(256, 96, device="cuda", dtype=torch.bfloat16)  # I % 64 != 0
    w2_odd = torch.randn(4, 96, 256, device="cuda", dtype=torch.bfloat16)
    assert not gg.down_gluon_ok(act_odd, w2_odd, offsets)
    assert not gg.down_gluon_ok(act.float(), w2.float(), offsets)
    assert not gg.down_gluon_ok(act, w2, offsets.long())
    assert not gg.down_gluon_ok(act, w2.transpose(1, 2).contiguous().transpose(1, 2), offsets)  # not contiguous
    with pytest.raises(ValueError):
        gg.launch_down_gluon(act_odd, w2_odd, offsets)
