"""The copy ceiling of an exchange: the same bytes written into every peer's memory at once by SMs.

``bench comm`` compares the dispatch's bandwidth with what a plain copy of the same bytes into
the peers' symmetric memory achieves. A device-to-device ``copy_`` runs on the copy engines, one
peer per stream: at two ranks that is a fair ceiling, but at four the dispatch's SM stores
outpaced the copies to three peers at once (278 against 230 GB/s on H200 x4, measured 2026-11-26), so
they bound nothing. :func:`peer_copy` is the SM counterpart: one persistent grid in which each
program loads a slice of the source once and stores it to every peer, as the dispatch's senders
do, without its layout, metadata or signals.

Kernel + launcher here (its torch reference: tests/references.py); ``bench comm`` times it beside the copy-engine ceiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _peer_copy_kernel(src_ptr, dst_tbl, n_words, PEERS: tl.constexpr, BLOCK: tl.constexpr):
    """src_ptr: int32 words [n_words]; dst_tbl: int64 [PEERS] byte addresses (16-byte aligned)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n_words, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_words
        words = tl.load(src_ptr + offs, mask=mask)
        for d in tl.static_range(PEERS):
            dst = tl.load(dst_tbl + d).to(tl.pointer_type(tl.int32))
            tl.store(dst + offs, words, mask=mask)


def peer_copy(src: torch.Tensor, destinations: list[torch.Tensor], programs: int | None = None,
              block: int = 4096, table: torch.Tensor | None = None) -> None:
    """Write ``src`` into each of ``destinations`` in one launch (SM stores).

    Args:
        src: uint8 [n] on the current device, contiguous, 16-byte aligned, n a multiple of 4.
        destinations: tensors of at least n bytes each, 16-byte aligned, whose pointers this
            device can store to (peer tensors of symmetric memory, or local ones); written from
            their first byte.
        programs: the grid (default: one program per SM; 4 under Triton's interpreter).
        table: int64 [len(destinations)], their addresses on src's device
            (:func:`destination_table`; default: built here, which makes the host wait).
    """
    if src.dtype != torch.uint8 or src.dim() != 1 or not src.is_contiguous():
        raise ValueError(f"src must be a contiguous uint8 vector, got {src.dtype} {tuple(src.shape)}")
    n = src.numel()
    if n % 4 or src.data_ptr() % 16:
        raise ValueError(f"src must be 16-byte aligned with a multiple of 4 bytes, got {n} bytes")
    for d in destinations:
        if d.numel() * d.element_size() < n or d.data_ptr() % 16:
            raise ValueError(f"each destination needs {n} bytes, 16-byte aligned")
    if not destinations or n == 0:
        return
    if programs is None:
        programs = torch.cuda.get_device_properties(src.device).multi_processor_count if src.is_cuda else 4
    if table is None:  # (a timed loop passes its own: this host-to-device copy makes the host wait)
        table = destination_table(destinations, src.device)
    _peer_copy_kernel[(programs,)](src.view(torch.int32), table, n // 4, PEERS=len(destinations), BLOCK=block,
                                   num_warps=8)


def destination_table(destinations: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 [len(destinations)]: their addresses, as :func:`peer_copy`'s ``table``."""
    return torch.tensor([d.data_ptr() for d in destinations], dtype=torch.int64, device=device)

