"""The KV cache's host memory: zeroed, usable at once while a background thread faults its pages
in, and what is written meanwhile is kept."""

from __future__ import annotations

import sys

import pytest
import torch

from cluster.engine.memory import HUGE_PAGE, HugePagedZeros

pytestmark = pytest.mark.unit

SHAPE = (16, 2, 64, 1024)  # 8 MiB of float32: four huge pages


@pytest.mark.parametrize("background", [False, True])
def test_the_memory_is_zero_and_keeps_what_is_written_while_it_is_faulted_in(background):
    memory = HugePagedZeros(SHAPE, torch.float32, background=background)
    tensor = memory.tensor
    assert tensor.shape == SHAPE and tensor.dtype == torch.float32
    tensor[15, 1, 63, 1023] = 3.0  # the last page: the thread has most likely not reached it yet
    tensor[0, 0, 0, 0] = 1.0
    memory.wait()
    assert tensor[15, 1, 63, 1023].item() == 3.0 and tensor[0, 0, 0, 0].item() == 1.0
    assert tensor.count_nonzero().item() == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are advised on Linux only")
def test_large_tensors_start_on_a_huge_page_boundary():
    memory = HugePagedZeros(SHAPE, torch.float32)
    assert memory.tensor.data_ptr() % HUGE_PAGE == 0


def test_small_tensors_are_plain_zeros():
    memory = HugePagedZeros((4, 4), torch.bfloat16, background=True)
    memory.wait()
    assert torch.equal(memory.tensor, torch.zeros(4, 4, dtype=torch.bfloat16))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="faulted in by madvise on Linux only")
def test_the_fault_in_pauses_while_a_start_up_profile_is_measured_on_the_machine(monkeypatch, tmp_path):
    """Not a chunk is faulted in by the thread while the machine's profiling lock is held (it
    looks again and again), and every chunk once it is let go."""
    import time

    from cluster.engine import memory as memory_module
    from cluster.engine import node_quiet
    from cluster.worker.step_profile import measuring_alone

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(memory_module, "QUIET_POLL_S", 0.001)
    populated, looked = [], []
    populate, held = HugePagedZeros._populate_chunk, node_quiet.held
    monkeypatch.setattr(HugePagedZeros, "_populate_chunk", lambda self: populated.append(populate(self)) or populated[-1])
    monkeypatch.setattr(node_quiet, "held", lambda descriptor: looked.append(held(descriptor)) or looked[-1])
    with measuring_alone():
        memory = HugePagedZeros(SHAPE, torch.float32, background=True)
        if populated != [True]:
            pytest.skip("this kernel does not fault pages in by madvise")  # every page touched in the constructor
        deadline = time.monotonic() + 60  # a hang guard only
        while looked.count(True) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert looked.count(True) >= 3 and populated == [True]  # the thread looked three times and waited
    memory._thread.join(timeout=60)
    assert not memory._thread.is_alive()
    assert populated == [True] * 4 + [False]  # the constructor's chunk, then the other three, then none left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="faulted in by madvise on Linux only")
def test_the_fault_in_pauses_while_an_engine_serves_on_the_machine(monkeypatch, tmp_path):
    """Not a chunk is faulted in by the thread while an engine marks itself serving (here, in
    another descriptor of this process), and every chunk once it marks itself idle; marking the
    same state again takes no lock call."""
    import fcntl
    import time

    from cluster.engine import memory as memory_module
    from cluster.engine import node_quiet

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(memory_module, "QUIET_POLL_S", 0.001)
    populated, looked = [], []
    populate, serving = HugePagedZeros._populate_chunk, node_quiet.serving
    monkeypatch.setattr(HugePagedZeros, "_populate_chunk", lambda self: populated.append(populate(self)) or populated[-1])
    monkeypatch.setattr(node_quiet, "serving", lambda descriptor: looked.append(serving(descriptor)) or looked[-1])
    mark = node_quiet.ServingMark()
    mark.mark(True)
    locks, flock = [], fcntl.flock
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: locks.append(op) or flock(fd, op))
    mark.mark(True)  # already serving: no call
    assert locks == []
    memory = HugePagedZeros(SHAPE, torch.float32, background=True)
    if populated != [True]:
        pytest.skip("this kernel does not fault pages in by madvise")  # every page touched in the constructor
    deadline = time.monotonic() + 60  # a hang guard only
    while looked.count(True) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert looked.count(True) >= 3 and populated == [True]  # the thread looked three times and waited
    mark.mark(False)
    memory._thread.join(timeout=60)
    assert not memory._thread.is_alive()
    assert populated == [True] * 4 + [False]  # the constructor's chunk, then the other three, then none left
    mark.close()
