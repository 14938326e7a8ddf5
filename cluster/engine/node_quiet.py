"""A machine-wide lock for work that must have its node to itself: a worker's start-up profile,
whose steps are timed (``cluster/worker/step_profile.py``, ``measuring_alone``). Background work
of the engine that would share the CPU with it pauses while the lock is held: the KV cache's pages
being faulted in (``memory.py``).

Why the fault-in must pause and not merely run at the lowest priority: Ray runs its workers
niced (15), so a fault-in thread at 19 still took a large share of the 2 cores. The quick start's
profiles measured beside both workers' fault-ins took 6.8 and 9.6 s against 3.3 and 5.6 with them paused,
and waiting for the fault-ins first (7.2 s of 3 GiB each) cost as much as it saved.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from cluster.paths import cache_dir


def lock_path() -> Path:
    """The lock of this machine (its host name: a cache folder shared by several machines)."""
    return cache_dir() / "step-profiles" / f".measuring-{socket.gethostname()}.lock"


def open_lock() -> int | None:
    """A descriptor of the lock file (None: it cannot be made); each holds or tests the lock on its own."""
    path = lock_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return None


def held(descriptor: int | None) -> bool:
    """Whether some process (this one too, through another descriptor) holds the lock now."""
    if descriptor is None:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    fcntl.flock(descriptor, fcntl.LOCK_UN)
    return False
