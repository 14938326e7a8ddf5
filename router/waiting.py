"""Requests the router holds until it can place them: a priority queue that is never blocked
by its head.

Each retry offers every waiting request in order (higher priority first, then earlier
arrival), so one that cannot be placed yet is skipped and those behind it still go. The queue
is bounded (``limit``): past it a request that would wait is rejected instead, so a burst
beyond what the cluster can ever drain turns into fast rejections, not unbounded memory.
A waiting request keeps the prefix hits it was routed with for ``hits_ttl_s``, so offering a
long queue again does not cost one registry lookup per request per retry.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

from cluster.registry.kv_index import TierHits


@dataclass(order=True)
class Waiting:
    sort_key: tuple[int, float, int]
    request: object = field(compare=False)  # a RouteRequest
    hits: dict[str, TierHits] | None = field(default=None, compare=False)
    hits_at: float = field(default=float("-inf"), compare=False)


class WaitingQueue:
    def __init__(self, limit: int):
        self.limit = limit
        self._entries: dict[str, Waiting] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def full(self) -> bool:
        return len(self._entries) >= self.limit

    def add(self, request, priority: int, arrival: float, hits: dict[str, TierHits] | None, now: float) -> None:
        self._entries[request.request_id] = Waiting((-priority, arrival, next(self._order)), request, hits, now)

    def ahead_of(self, priority: int, arrival: float) -> tuple[int, int]:
        """The requests that would be offered before one of ``priority`` arriving at ``arrival``,
        and their prompt tokens."""
        key = (-priority, arrival)
        before = [e for e in self._entries.values() if e.sort_key[:2] <= key]
        return len(before), sum(len(e.request.prompt_token_ids) for e in before)

    def remove(self, request_id: str) -> Waiting | None:
        return self._entries.pop(request_id, None)

    def in_order(self) -> Iterator[Waiting]:
        """A snapshot in placement order: safe to remove entries while iterating."""
        return iter(sorted(self._entries.values()))

    def by_class(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self._entries.values():
            name = entry.request.slo_class or ""
            counts[name] = counts.get(name, 0) + 1
        return counts
