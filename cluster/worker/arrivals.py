"""The requests a worker took lately, for its load report: a router counts a placement it made
before a report as in that report only if the worker had taken it by then.

Without it, a report written in the milliseconds between a placement and the request's arrival
at the worker hides that request until the next report (0.1 s later): a decode worker at
``max_num_seqs`` looks a slot short of full, and a request placed meanwhile waits inside it. It is
common: in a burst of 200 requests, 16 at a time, on the quick start (2 cores), 21 placements had
a report written after them and before their worker took them (6 ms after the placement at the
median, 54 ms at most). (The likely cause of a CI failure: a request that should have been
refused for want of a slot, 50 decode steps after the two requests that filled the worker, was
placed.)
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from cluster.registry.load import ARRIVALS_KEPT_S


class RecentArrivals:
    """Request ids with the time the worker took them (``clock``: its report's clock)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._taken: deque[tuple[float, str]] = deque()

    def took(self, request_id: str) -> None:
        self._taken.append((self._clock(), request_id))

    def ids(self) -> frozenset[str]:
        """Those taken within ``ARRIVALS_KEPT_S`` of now (older ones are forgotten)."""
        taken, oldest = self._taken, self._clock() - ARRIVALS_KEPT_S
        while taken and taken[0][0] < oldest:
            taken.popleft()
        return frozenset(request_id for _, request_id in taken)
