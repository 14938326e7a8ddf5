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


class WatchedFaultIn:
    """A background fault-in under watch: ``populated``, each chunk's outcome; ``looked``, each
    test of the machine's ``check`` (``held`` or ``serving``) the thread made, polled every ms."""

    def __init__(self, monkeypatch, tmp_path, check: str):
        from cluster.engine import memory as memory_module
        from cluster.engine import node_quiet

        monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(memory_module, "QUIET_POLL_S", 0.001)
        self.populated, self.looked = [], []
        populate, test = HugePagedZeros._populate_chunk, getattr(node_quiet, check)
        monkeypatch.setattr(HugePagedZeros, "_populate_chunk",
                            lambda memory: self.populated.append(populate(memory)) or self.populated[-1])
        monkeypatch.setattr(node_quiet, check, lambda descriptor: self.looked.append(test(descriptor)) or self.looked[-1])
        self.memory = None

    def start_and_see_it_wait(self) -> None:
        """Makes the tensor, then waits until its thread has looked three times, finding the machine busy."""
        import time

        self.memory = HugePagedZeros(SHAPE, torch.float32, background=True)
        if self.populated != [True]:
            pytest.skip("this kernel does not fault pages in by madvise")  # every page touched in the constructor
        deadline = time.monotonic() + 60  # a hang guard only
        while self.looked.count(True) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert self.looked.count(True) >= 3 and self.populated == [True]  # the thread looked three times and waited

    def assert_all_faulted_in(self) -> None:
        self.memory._thread.join(timeout=60)
        assert not self.memory._thread.is_alive()
        assert self.populated == [True] * 4 + [False]  # the constructor's chunk, then the other three, then none left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="faulted in by madvise on Linux only")
def test_the_fault_in_pauses_while_a_start_up_profile_is_measured_on_the_machine(monkeypatch, tmp_path):
    """Not a chunk is faulted in by the thread while the machine's profiling lock is held (it
    looks again and again), and every chunk once it is let go."""
    from cluster.worker.step_profile import measuring_alone

    fault_in = WatchedFaultIn(monkeypatch, tmp_path, "held")
    with measuring_alone():
        fault_in.start_and_see_it_wait()
    fault_in.assert_all_faulted_in()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="faulted in by madvise on Linux only")
def test_the_fault_in_pauses_while_an_engine_serves_on_the_machine(monkeypatch, tmp_path):
    """Not a chunk is faulted in by the thread while an engine marks itself serving (here, through
    another descriptor of this process), and every chunk once it marks itself idle; marking the
    same state again makes no lock call."""
    import fcntl

    from cluster.engine import node_quiet

    fault_in = WatchedFaultIn(monkeypatch, tmp_path, "serving")
    mark = node_quiet.ServingMark()
    mark.mark(True)
    locks, flock = [], fcntl.flock
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: locks.append(op) or flock(fd, op))
    mark.mark(True)  # already serving: no call
    assert locks == []
    fault_in.start_and_see_it_wait()
    mark.mark(False)
    fault_in.assert_all_faulted_in()
    mark.close()
