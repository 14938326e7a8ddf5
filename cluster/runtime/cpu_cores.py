"""Where a worker computes on the CPU: the cores its threads may run on, as a Linux cpulist
("0-3,8"), and how many compute threads it runs. Two workers whose threads outnumber the cores
they may run on together take turns on those cores: work given to one slows the other
(:func:`share_cores`), which the router weighs (``router/router.py``)."""

from __future__ import annotations

import os
from functools import lru_cache
from types import MappingProxyType

NO_CORES = MappingProxyType({"cpus": "", "threads": 0})  # the load fields of a worker that computes on a GPU


def format_cpulist(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


@lru_cache(maxsize=256)
def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-2,5"`` -> ``{0, 1, 2, 5}``; ``""`` -> none. Cached: the router asks for the same few
    workers' lists on every placement."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def this_process_cpus() -> frozenset[int]:
    """The cores this process may run on (all of them where the platform cannot say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def compute_cores(on_cpu: bool, threads: int, ranks: int = 1) -> dict:
    """A worker's ``cpus`` and ``threads`` load fields: ``ranks`` processes of ``threads``
    threads each, placed on this process's node (a CPU TP group is packed on one node); none
    where it computes on a GPU."""
    return compute_cores_of(this_process_cpus(), threads * ranks) if on_cpu else NO_CORES


def compute_cores_of(cpus, threads: int) -> dict:
    """The ``cpus`` and ``threads`` load fields of a worker whose ``threads`` run on ``cpus``."""
    return {"cpus": format_cpulist(cpus), "threads": threads}


def share_cores(cpus_a: str, threads_a: int, cpus_b: str, threads_b: int) -> bool:
    """Whether two workers on one node take turns on cores: both compute on the CPU, their
    cores overlap, and their threads outnumber the cores they may use together."""
    if not (threads_a and threads_b):
        return False
    a, b = parse_cpulist(cpus_a), parse_cpulist(cpus_b)
    return bool(a & b) and threads_a + threads_b > len(a | b)
