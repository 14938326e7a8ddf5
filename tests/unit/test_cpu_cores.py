"""Where workers compute on the CPU, and when two of them take turns on the same cores."""

from __future__ import annotations

import pytest

from cluster.runtime.cpu_cores import compute_cores, format_cpulist, parse_cpulist, share_cores, this_process_cpus

pytestmark = pytest.mark.unit


def test_a_cpulist_is_written_and_read_as_linux_writes_it():
    assert format_cpulist({5, 0, 1, 2, 8, 9}) == "0-2,5,8-9"
    assert format_cpulist([3]) == "3"
    assert format_cpulist(()) == ""
    assert parse_cpulist("0-2,5,8-9") == {0, 1, 2, 5, 8, 9}
    assert parse_cpulist("") == frozenset()
    assert parse_cpulist(format_cpulist(range(0, 64, 3))) == set(range(0, 64, 3))


def test_a_worker_on_the_cpu_reports_its_cores_and_every_ranks_threads():
    assert compute_cores(True, 2, ranks=2) == {"cpus": format_cpulist(this_process_cpus()), "threads": 4}
    assert compute_cores(False, 8) == {"cpus": "", "threads": 0}


@pytest.mark.parametrize("a, b, shared", [
    (("0-1", 2), ("0-1", 2), True),  # the quick start: 2 + 2 threads on 2 cores
    (("0-3", 2), ("0-3", 2), False),  # 4 threads on 4 cores: each has cores of its own
    (("0-1", 2), ("2-3", 2), False),  # pinned apart
    (("0-2", 2), ("2-3", 2), False),  # one core in common, but 4 threads on 4 cores between them
    (("0-2", 3), ("2-3", 2), True),  # one core in common, 5 threads on 4 cores
    (("0-1", 2), ("", 0), False),  # the other computes on a GPU
])
def test_two_workers_share_cores_when_their_threads_outnumber_the_cores_they_may_use(a, b, shared):
    assert share_cores(*a, *b) is shared
    assert share_cores(*b, *a) is shared
