"""A machine-wide lock for work that must have its node to itself: a worker's start-up profile,
whose steps are timed (``cluster/worker/step_profile.py``, ``measuring_alone``). Background work
of the engine that would share the CPU with it pauses while the lock is held: the KV cache's pages
being faulted in (``memory.py``).

The fault-in pauses too while any engine on the machine serves (:class:`ServingMark`: each
holds a shared lock on a second file while it has requests to step, and a TP follower while it
runs a step): at nice 19 it still took a fifth of the cores from workers at Ray's nice 15, and
the quick start decoded one stream at 71-74 tokens/s until it was done, 89-95 after.

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


def serving_lock_path() -> Path:
    """The machine's lock that engines hold, shared, while they serve (see :class:`ServingMark`)."""
    return cache_dir() / "step-profiles" / f".serving-{socket.gethostname()}.lock"


def open_lock(path: Path | None = None) -> int | None:
    """A descriptor of the lock file (default: the profiling lock's; None: it cannot be made);
    each holds or tests the lock on its own."""
    path = path or lock_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return None


def held(descriptor: int | None) -> bool:
    """Whether some process (this one too, through another descriptor) holds the lock now."""
    return _refused(descriptor, fcntl.LOCK_SH)


def _refused(descriptor: int | None, mode: int) -> bool:
    """Whether the lock cannot be taken in ``mode`` now (someone holds it so); False where it cannot be tested."""
    if descriptor is None:
        return False
    try:
        fcntl.flock(descriptor, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    fcntl.flock(descriptor, fcntl.LOCK_UN)
    return False


def serving(descriptor: int | None) -> bool:
    """Whether some engine (in this process too, through another descriptor) marks itself
    serving now: ``descriptor`` is one of the serving lock (``open_lock(serving_lock_path())``)."""
    return _refused(descriptor, fcntl.LOCK_EX)


class ServingMark:
    """An engine's mark on the machine while it serves: a shared lock on the serving lock file,
    taken and let go only when the engine's state changes (two system calls a busy spell)."""

    def __init__(self):
        self._descriptor = open_lock(serving_lock_path())
        self._busy = False

    def mark(self, busy: bool) -> None:
        if busy == self._busy or self._descriptor is None:
            return
        try:
            fcntl.flock(self._descriptor, fcntl.LOCK_SH if busy else fcntl.LOCK_UN)
        except OSError:
            return
        self._busy = busy

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # lets go of the lock
            self._descriptor = None
            self._busy = False
