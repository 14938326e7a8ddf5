"""The native kernels' thread pool (cluster/engine/kernels/thread_pool.c): one per process, used
from any thread, each output computed by one task, so results do not depend on how many threads
ran or on which thread called; calls from several threads at once and a forked child both work."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
import threading
import time

import pytest
import torch

from cluster.engine.kernels.quantized_matmul import native_quantized_matmul
from packed_weights import packed

pytestmark = pytest.mark.unit


def run(x: torch.Tensor, kind: str, threads: int) -> torch.Tensor:
    weight = packed(kind, 301, 256)
    out = torch.empty(x.shape[0], weight.rows)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native_quantized_matmul()(x, weight, out)
    finally:
        torch.set_num_threads(previous)
    return out


@pytest.mark.parametrize("kind", ["q4", "q8g32min", "f8"])
def test_results_are_the_same_bits_on_one_thread_and_on_several(kind):
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    one = run(x, kind, 1)
    assert torch.equal(run(x, kind, 2), one)
    assert torch.equal(run(x, kind, 4), one)  # more threads than this machine may have cores


def test_calls_from_several_threads_at_once_each_get_their_own_result():
    inputs = [torch.randn(3, 256, generator=torch.Generator().manual_seed(seed)) for seed in range(6)]
    expected = [run(x, "q4", 1) for x in inputs]
    results: dict[int, list[torch.Tensor]] = {}

    def caller(i: int) -> None:
        results[i] = [run(inputs[i], "q4", 2) for _ in range(20)]

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for i, outs in results.items():
        assert all(torch.equal(out, expected[i]) for out in outs)
    assert len(results) == len(inputs)


def _in_child(queue) -> None:
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5))
    queue.put(run(x, "q8g32min", 2).tolist())  # a list: a tensor would travel as shared memory the exiting child owns


def test_a_forked_child_runs_the_kernels_with_workers_of_its_own():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5))
    expected = run(x, "q8g32min", 2)  # the parent's pool has workers now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(queue,))
    child.start()
    try:
        assert torch.equal(torch.tensor(queue.get(timeout=120)), expected)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_runs_that_workers_join_late_or_skip_still_run_every_task_once():
    """A run waits only for the workers that joined it; one that wakes after the run closed skips
    it. Thousands of runs of every size, back to back and after pauses that let the workers
    sleep, each give the one-thread result's bits (a task run twice or never would not)."""
    shapes = [(1, 256), (3, 256), (8, 256), (17, 256)]
    inputs = [torch.randn(*shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    expected = {(i, kind): run(x, kind, 1) for i, x in enumerate(inputs) for kind in ("q4", "q8g32min")}
    for round_ in range(300):
        for (i, kind), want in expected.items():
            assert torch.equal(run(inputs[i], kind, 2 + round_ % 3), want), (round_, i, kind)
        if round_ % 50 == 49:
            time.sleep(0.01)  # longer than the workers spin: they sleep, and wake into later runs


def _worker_masks_after_a_run(queue) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    for _ in range(50):  # the caller may move between CPUs during a run: until it did not
        before = libc.sched_getcpu()
        run(x, "q4", 2)
        if libc.sched_getcpu() == before:
            break
    masks = [os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")]
    queue.put((before, sorted(os.sched_getaffinity(0)), [sorted(m) for m in masks]))


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="CPU affinity on Linux with two CPUs or more")
def test_workers_keep_off_the_cpu_the_caller_runs_on():
    """A guest kernel wakes a sleeping worker onto the waker's CPU when the other vCPUs idle:
    the pool keeps its workers off the caller's CPU (a process of its own: a fresh pool)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_worker_masks_after_a_run, args=(queue,))
    child.start()
    try:
        caller_cpu, allowed, masks = queue.get(timeout=120)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert [cpu for cpu in allowed if cpu != caller_cpu] in masks
