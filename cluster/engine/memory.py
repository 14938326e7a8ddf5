"""Host-memory placement for the large, long-lived tensors of the engine (the KV cache)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def empty_huge_paged(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory is backed by transparent huge pages where Linux allows.

    Decode attention reads the KV cache block by block from scattered places; with 4 KiB pages
    nearly every block costs TLB misses (in a VM, two-level page walks). The advice is given
    before the pages are first touched, so they are faulted in as huge pages. Elsewhere, or
    when the kernel refuses, this is a plain ``torch.zeros``.
    """
    element = torch.empty((), dtype=dtype).element_size()
    nbytes = element * int(torch.Size(shape).numel())
    libc = _libc()
    if libc is None or nbytes < 2 * HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    backing = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -backing.data_ptr() % HUGE_PAGE
    aligned = backing[offset : offset + nbytes]
    libc.madvise(aligned.data_ptr(), nbytes - nbytes % HUGE_PAGE, _MADV_HUGEPAGE)
    return aligned.view(dtype).view(shape).zero_()
