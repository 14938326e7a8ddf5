"""Short scheduler slices for the threads that serve requests (cluster/runtime/short_slice.py):
asked for the calling thread (and inherited by the threads it starts), or for a whole process;
read back with sched_getattr where Linux has it."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
import threading
import time

import pytest

from cluster.runtime.short_slice import SERVING_SLICE_NS, _SchedAttr, serve_with_short_slices

pytestmark = pytest.mark.unit

_SYS_SCHED_GETATTR = {"x86_64": 315, "aarch64": 275}


def slice_of(tid: int) -> int | None:
    """The thread's slice as sched_getattr reads it, None where it cannot be read."""
    number = _SYS_SCHED_GETATTR.get(os.uname().machine)
    if not sys.platform.startswith("linux") or number is None:
        return None
    attr = _SchedAttr()
    if ctypes.CDLL(None, use_errno=True).syscall(number, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return None
    return attr.sched_runtime


def _in_child(whole_process: bool, queue) -> None:
    helper_tid = []
    started, stop = threading.Event(), threading.Event()

    def helper():
        helper_tid.append(threading.get_native_id())
        started.set()
        stop.wait()

    before = threading.Thread(target=helper)  # started before the call
    before.start()
    started.wait()
    took = serve_with_short_slices(whole_process)
    later_tid = []
    later = threading.Thread(target=lambda: later_tid.append(threading.get_native_id()) or stop.wait())
    later.start()
    while not later_tid:
        pass
    slices = (slice_of(threading.get_native_id()), slice_of(helper_tid[0]), slice_of(later_tid[0]))
    stop.set()
    before.join()
    later.join()
    queue.put((took, slices))


def run_in_child(whole_process: bool):
    context = multiprocessing.get_context("spawn")  # a process of its own: the test runner's threads keep theirs
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(whole_process, queue))
    child.start()
    try:
        return queue.get(timeout=120)
    finally:
        child.join(timeout=60)


def test_the_calling_thread_and_those_it_starts_take_the_short_slice():
    took, (caller, before, later) = run_in_child(whole_process=False)
    if caller is None or took == 0:
        pytest.skip("this kernel has no slices to ask for (Linux 6.12+ reads sched_runtime)")
    assert took == 1
    assert (caller, later) == (SERVING_SLICE_NS, SERVING_SLICE_NS)
    assert before != SERVING_SLICE_NS  # the kernel's default (it reads back as the base slice)


def test_a_whole_process_takes_it_on_every_thread():
    took, (caller, before, later) = run_in_child(whole_process=True)
    if caller is None or took == 0:
        pytest.skip("this kernel has no slices to ask for (Linux 6.12+ reads sched_runtime)")
    assert took >= 2
    assert (caller, before, later) == (SERVING_SLICE_NS, SERVING_SLICE_NS, SERVING_SLICE_NS)


def _compute_threads_in_child(queue) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # packed_weights, beside this test
    from packed_weights import packed

    from cluster.engine.kernels.quantized_matmul import native_quantized_matmul
    from cluster.engine.kernels.threads import pool_worker_tids
    from cluster.worker.engine_worker import EngineWorker

    weight = packed("q4", 301, 256)
    torch.set_num_threads(3)

    def warm_up():  # the pool's workers start here, as a worker's warm-up starts them off its stepping thread
        native_quantized_matmul()(torch.randn(4, 256), weight, torch.empty(4, weight.rows))

    warmer = threading.Thread(target=warm_up)
    warmer.start()
    warmer.join()
    workers, deadline = pool_worker_tids(), time.monotonic() + 30
    while len(workers) < 2 and time.monotonic() < deadline:  # a worker writes its id once it first runs
        time.sleep(0.01)
        workers = pool_worker_tids()
    before = [slice_of(tid) for tid in workers]
    took = EngineWorker._compute_with_short_slices()  # as the stepping loop calls it, on its own thread
    queue.put((sorted(workers), sorted(int(t) for t in os.listdir("/proc/self/task")), before, took,
               slice_of(threading.get_native_id()), [slice_of(tid) for tid in workers]))


def test_an_engine_workers_stepping_thread_and_the_kernels_pool_workers_take_it():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_compute_threads_in_child, args=(queue,))
    child.start()
    try:
        workers, tasks, before, took, stepping, after = queue.get(timeout=300)
    finally:
        child.join(timeout=60)
    if not workers:
        pytest.skip("no native kernels here (no C compiler), or not Linux: the pool has no thread ids to read")
    assert len(workers) == 2 and set(workers) <= set(tasks)  # 3 threads: the caller and 2 workers of this process
    if stepping is None or took == 0:
        pytest.skip("this kernel has no slices to ask for (Linux 6.12+ reads sched_runtime)")
    assert SERVING_SLICE_NS not in before  # the warm-up's thread did not have it
    assert took == 3
    assert stepping == SERVING_SLICE_NS and after == [SERVING_SLICE_NS] * 2
