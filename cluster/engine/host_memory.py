"""The node's RAM as a CPU rank's KV budget sees it: all of it (its cgroup's limit where that is
lower, as in a container), and what is available now. Light (no torch): the deployment asks it
on a worker's node before sizing an added worker's cache."""

from __future__ import annotations

import os
from pathlib import Path

_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_USAGE = ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes")


def host_memory_bytes() -> int:
    """The node's RAM, or its cgroup's limit where that is lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_number(_LIMITS)
    return min(physical, limit) if limit else physical


def available_host_memory_bytes() -> int:
    """Memory a new allocation could take now without swapping: the kernel's MemAvailable, or
    what is left under the cgroup's limit where that is less."""
    available = _meminfo_available()
    limit, usage = _cgroup_number(_LIMITS), _cgroup_number(_USAGE)
    if limit and usage is not None:
        available = min(available, max(0, limit - usage))
    return available


def node_memory() -> tuple[int, int]:
    """(host_memory_bytes, available_host_memory_bytes), in one call."""
    return host_memory_bytes(), available_host_memory_bytes()


def _meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return host_memory_bytes()


def _cgroup_number(paths: tuple[str, ...]) -> int | None:
    for path in paths:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() else None  # "max": no limit
    return None
