"""Large CPU tensors on 2 MB pages.

A decoding pass reads every weight once, 270 MB for the default target: on 4 KB pages that is
69,000 pages a pass, each a TLB miss and a page walk, and the CPU's prefetchers stop at every
page's end. Linux backs anonymous memory with 2 MB pages where it is asked to
(`madvise(MADV_HUGEPAGE)`; transparent huge pages in "madvise" or "always" mode), so the weights
and the KV cache live in such memory. It gains 0-1% on a quiet machine, about 2% on a busy one
(docs/kernels.md, "Weights on 2 MB pages"). Where the OS does not give them, the memory is
ordinary and nothing else changes.
"""
from __future__ import annotations

import mmap

import torch

HUGE = 2 << 20


def _zeros_bytes(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed memory, 2 MB aligned, asked for on 2 MB pages: a uint8 tensor that keeps
    its mapping alive. Pages are given on first touch, so a large cache costs only what it uses."""
    if hasattr(mmap, "MAP_PRIVATE"):  # private: shared anonymous memory is shmem, paged otherwise
        m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        m = mmap.mmap(-1, nbytes + HUGE)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):  # no such advice on this OS: ordinary pages
        pass
    buf = torch.frombuffer(m, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE
    return buf[start:start + nbytes]


def zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, on 2 MB pages where the OS gives them."""
    n = 1
    for s in shape:
        n *= s
    return _zeros_bytes(n * dtype.itemsize).view(dtype).view(shape)


def to_huge_pages(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of CPU tensors, contiguous, laid end to end (64-byte aligned) in one mapping on 2 MB
    pages. Tensors that share storage stay shared."""
    unique = {}
    for t in tensors.values():
        unique.setdefault(t.data_ptr(), t)
    sizes = {p: -(-t.numel() * t.element_size() // 64) * 64 for p, t in unique.items()}
    arena = _zeros_bytes(max(sum(sizes.values()), 64))
    moved, off = {}, 0
    for p, t in unique.items():
        n = t.numel() * t.element_size()
        moved[p] = arena[off:off + n].view(t.dtype).view(t.shape)
        moved[p].copy_(t)
        off += sizes[p]
    return {k: moved[t.data_ptr()] for k, t in tensors.items()}
