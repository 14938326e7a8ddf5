"""The native kernels' thread count, and torch's own threads kept out of their way.

Torch runs its parallel CPU ops on OpenMP (libgomp), whose threads spin for a while after each
parallel region before they sleep. In an engine whose step is the fused native step, torch's ops
are the small ones around it (the sampler over ``[rows, vocab]`` logits, the embedding rows);
once a step had a few rows they went parallel, and libgomp's spinning threads then took the CPUs
from the kernels' own pool (``thread_pool.c``) through the next step. Default model, 2 cores:
8 streams decoded at 364 tok/s against 525 with libgomp passive, and a step of 2 rows took
12 ms against 6. So in such an engine torch's ops run on the stepping thread alone
(:func:`torch_ops_single_threaded`: the setting is per thread, nothing else changes), while the
kernels keep the threads torch had (:func:`kernel_threads`). An argmax over 64 rows of 49,152
logits takes 1.6 ms on one thread against 0.9 on two: far less than the spinning cost.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from cluster.engine.kernels.build import loaded_libraries

_local = threading.local()


def kernel_threads() -> int:
    """The threads a native kernel called from this thread runs on."""
    return getattr(_local, "threads", None) or torch.get_num_threads()


@contextmanager
def torch_ops_single_threaded() -> Iterator[None]:
    """Within it, torch's ops on this thread run on this thread alone, and the native kernels
    keep the thread count torch had before."""
    threads = torch.get_num_threads()
    if threads <= 1 or getattr(_local, "threads", None):
        yield
        return
    _local.threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _local.threads = None


def pool_worker_tids() -> list[int]:
    """The kernel thread ids of the native kernels' pool workers started so far, in every kernel
    library loaded (each holds its own pool); empty where none is loaded, or off Linux."""
    tids: list[int] = []
    for library in loaded_libraries():
        read = getattr(library, "pool_worker_tids", None)
        if read is None:
            continue
        out = (ctypes.c_int * 256)()
        read.restype, read.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        tids.extend(out[:read(out, len(out))])
    return tids
