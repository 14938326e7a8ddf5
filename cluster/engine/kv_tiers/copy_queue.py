"""Copies between the KV tiers made off the step's critical path: one background thread applies
batches of moves (jobs) in the order they were queued, while the engine schedules and runs its
next steps. The engine keeps two: write-backs to the host tier, and loads from it.

Who may touch what meanwhile is the block manager's rule (``BlockManager.write_back``,
``BlockManager.load_from_host``): a block being written back is free and cached, so a forward
may read it but nothing writes it until it is reallocated, and before anything reallocates one
or makes copies of its own the engine waits for the write-backs (``wait``); a block being loaded
is referenced by its load and read by nobody until the load's job is done (``CopyJob.done``).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from cluster.engine.kv_tiers.host_pool import TierMove


@dataclass(eq=False)
class CopyJob:
    """One batch of moves: when it was queued, when its copies began and when they were made
    (``time.perf_counter``), or the error that stopped them."""

    moves: list[TierMove]
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished_at: float | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def wait_seconds(self) -> float:
        """From queued to made: what a request waiting for these copies waits."""
        return (self.finished_at or time.perf_counter()) - self.submitted_at


class CopyQueue:
    def __init__(self, apply: Callable[[Sequence[TierMove]], None], name: str = "kv-host-copies",
                 torch_threads: int | None = None):
        """``torch_threads``: torch's CPU ops in the copier's thread run on this many threads (the
        setting is per thread); None: as many as torch has."""
        self._apply = apply
        self._torch_threads = torch_threads
        self._jobs: queue.Queue[CopyJob | None] = queue.Queue()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, moves: Sequence[TierMove]) -> CopyJob | None:
        """Queues the moves as one job (None when there are none)."""
        if not moves:
            return None
        if self._closed:
            raise RuntimeError("the copy queue is closed")
        job = CopyJob(list(moves))
        self._jobs.put(job)
        return job

    @property
    def idle(self) -> bool:
        """Nothing queued or being copied."""
        return self._jobs.unfinished_tasks == 0

    @property
    def running(self) -> bool:
        """Its thread runs (until ``close``)."""
        return self._thread.is_alive()

    def wait(self) -> None:
        """Until every queued copy is made; a copy that failed raises here, in the engine's thread."""
        self._jobs.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Ends the thread after the job it is copying, if any: the jobs queued behind it are
        not made (each is done, with an error saying so). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._closed:
                    raise RuntimeError("the engine shut down before this copy was made")
                job.started_at = time.perf_counter()
                self._apply(job.moves)
            except BaseException as exc:  # noqa: BLE001 - handed to the engine's thread by wait() or the job
                if job is not None:
                    job.error = exc
                    self._error = exc
            finally:
                if job is not None:
                    job.finished_at = time.perf_counter()
                    job.done.set()
                self._jobs.task_done()
