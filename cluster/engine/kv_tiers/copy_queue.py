"""Copies to the host tier made off the step's critical path: one background thread applies
batches of moves in the order they were queued, while the engine schedules and runs its next
steps.

Who may touch what meanwhile is the block manager's rule (``BlockManager.write_back``): a block
being copied is free and cached, so a forward may read it but nothing writes it until it is
reallocated, and before anything reallocates one, loads from the host or makes copies of its own,
the engine waits for the queue (``wait``).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence

from cluster.engine.kv_tiers.host_pool import TierMove


class CopyQueue:
    def __init__(self, apply: Callable[[Sequence[TierMove]], None], name: str = "kv-host-copies"):
        self._apply = apply
        self._jobs: queue.Queue[Sequence[TierMove] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, moves: Sequence[TierMove]) -> None:
        if moves:
            self._jobs.put(list(moves))

    @property
    def idle(self) -> bool:
        """Nothing queued or being copied."""
        return self._jobs.unfinished_tasks == 0

    def wait(self) -> None:
        """Until every queued copy is made; a copy that failed raises here, in the engine's thread."""
        self._jobs.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            moves = self._jobs.get()
            try:
                if moves is None:
                    return
                self._apply(moves)
            except BaseException as exc:  # noqa: BLE001 - handed to the engine's thread by wait()
                self._error = exc
            finally:
                self._jobs.task_done()
