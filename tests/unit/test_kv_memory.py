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
