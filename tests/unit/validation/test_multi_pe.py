"""The NVSHMEM transport's real kernels between several ranks on the CPU (tests/nvshmem_pes.py)."""

from __future__ import annotations

import pytest


def test_exchange_kernels_across_two_pes_under_the_interpreter(multi_pe_run):
    """A process per rank under Triton's interpreter, symmetric memory as shared file mappings,
    peer stores and flag atomics across processes: every transport edge case (dispatch, combine
    and both backwards, two calls through one buffer) with the default launch tuning, the ones
    that vary rows per source most with the dispatch's copy-out and the combine's sums
    interleaved with the sends (``Tuning.interleave``), and the EP layer against the
    single-process oracle, on every rank; the remote path (staging, puts, signals) with the
    receiving kernel waiting for the signals; then a combine one rank runs alone times out with an
    error that names the peer, the program and the value its wait wanted and saw."""
    pytest.importorskip("triton")
    code, text = multi_pe_run[2].result(timeout_s=1200)
    assert code == 0 and text.startswith("OK"), text[-4000:]


def test_exchange_kernels_across_three_pes_under_the_interpreter(multi_pe_run):
    """Three ranks with the default launch tuning, where the combine sends its rows back in ring
    order (``Tuning.rotate_peers``, the default from three ranks): the transport cases that vary
    the rows per source most (``FEW_CASES``) and the EP layer against the oracle on every rank."""
    pytest.importorskip("triton")
    code, text = multi_pe_run[3].result(timeout_s=1200)
    assert code == 0 and text.startswith("OK"), text[-4000:]


def test_fp8_rows_on_the_wire_across_two_pes_under_the_interpreter():
    """FP8 rows on the wire through the NVSHMEM exchange kernels (byte rows of H + 4·H/128 moved
    as words, the scales beside the E4M3 bytes): the FP8 layer with the wire equals it without
    within float32 round-off on both ranks, and the receive rows' bytes fall to
    (H + 4·H/128) / (2·H) of bf16's (~3 s)."""
    pytest.importorskip("triton")
    from tests.nvshmem_pes import launch

    fails = launch(2, 1 << 21, 300.0, fp8_wire=True)
    assert not fails, "\n".join(fails)[-4000:]
