"""Host-memory placement for the large, long-lived tensors of the engine (the KV cache)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import sys
import threading
import time
from functools import cache
from typing import Iterator

import torch

from cluster.engine import node_quiet

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without changing what they hold
POPULATE_CHUNK = HUGE_PAGE  # one at a time: the fault holds the process's memory map (a thread or an allocation waits)
QUIET_POLL_S = 0.05  # how often a paused fault-in looks again whether the machine is quiet


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


class HugePagedZeros:
    """A zeroed CPU tensor whose memory is backed by transparent huge pages where Linux allows.

    Decode attention reads the KV cache block by block from scattered places; with 4 KiB pages
    nearly every block costs TLB misses (in a VM, two-level page walks). The memory is a fresh
    private anonymous map (zero by definition), advised as huge pages before any is touched.

    Faulting gigabytes in (the kernel clearing and, in a VM, compacting huge pages) takes
    seconds: measured 3 to 10 s for 3 GiB on a 2-core VM. With ``background`` a thread at the
    lowest CPU priority faults them in (``MADV_POPULATE_WRITE``, which never changes what a page
    holds, so the tensor is usable at once and a page written meanwhile keeps its bytes; a page
    used first is faulted in by its user), and none while a start-up profile is measured or an
    engine serves on the machine (``node_quiet.py``): an engine's requests never share the CPU
    with it, and pages a busy engine uses first come in as it uses them; :meth:`wait`
    faults the rest in at the caller's priority. So memory the machine cannot back after all
    (the kernel's overcommit lets a map through) shows seconds later, when it is faulted in,
    not in the constructor. Without ``background``, or where the kernel lacks that advice, every
    page is faulted in before the constructor returns. Elsewhere, or for small tensors, this is
    a plain ``torch.zeros``.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, background: bool = False):
        element = torch.empty((), dtype=dtype).element_size()
        nbytes = element * int(torch.Size(shape).numel())
        self._chunks: Iterator[int] = iter(())
        self._next_chunk = threading.Lock()
        self._thread: threading.Thread | None = None
        libc = _libc()
        if libc is None or nbytes < 2 * HUGE_PAGE:
            self.tensor = torch.zeros(shape, dtype=dtype)
            return
        try:
            backing = torch.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
        except OSError:  # more than the kernel will ever give (its overcommit check)
            raise MemoryError(f"could not allocate {nbytes / 2**30:,.1f} GiB") from None
        offset = -backing.data_ptr() % HUGE_PAGE
        self._memory = aligned = backing[offset: offset + nbytes]  # held while pages are faulted in
        libc.madvise(aligned.data_ptr(), nbytes - nbytes % HUGE_PAGE, _MADV_HUGEPAGE)
        self.tensor = aligned.view(dtype).view(shape)
        self._libc, self._end = libc, aligned.data_ptr() + nbytes
        self._chunks = iter(range(aligned.data_ptr(), self._end, POPULATE_CHUNK))
        if not self._populate_chunk():  # the kernel does not know the advice: touch every page now
            aligned.zero_()
            self._chunks = iter(())
        elif background:
            self._thread = threading.Thread(target=self._populate_idly, name="kv-memory", daemon=True)
            self._thread.start()
        else:
            self.wait()

    def wait(self) -> None:
        """Until every page is faulted in."""
        while self._populate_chunk():
            pass
        if self._thread is not None:
            self._thread.join()

    def _populate_idly(self) -> None:
        """Faults chunks in at the lowest CPU priority, pausing while a start-up profile is
        measured or an engine serves on this machine (``node_quiet.py``)."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread's priority alone
        except OSError:
            pass
        quiet, serving = node_quiet.open_lock(), node_quiet.open_lock(node_quiet.serving_lock_path())
        try:
            while True:
                while node_quiet.held(quiet) or node_quiet.serving(serving):
                    time.sleep(QUIET_POLL_S)
                if not self._populate_chunk():
                    return
        finally:
            for descriptor in (quiet, serving):
                if descriptor is not None:
                    os.close(descriptor)

    def _populate_chunk(self) -> bool:
        """Faults the next chunk in; False when none is left, or the kernel refused."""
        with self._next_chunk:
            start = next(self._chunks, None)
        if start is None:
            return False
        if self._libc.madvise(start, min(POPULATE_CHUNK, self._end - start), _MADV_POPULATE_WRITE) == 0:
            return True
        code = ctypes.get_errno()
        self._chunks = iter(())
        if code != errno.EINVAL:
            logger.warning("faulting the KV cache's memory in failed (%s); its pages come in as they are used",
                           errno.errorcode.get(code, code))
        return False
