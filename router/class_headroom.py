"""Batch headroom between SLO classes: requests of a class with a loose TPOT objective may not
fill a decode worker's batch up to that objective while a class with a tighter one runs there
or is arriving, or the tighter class would find every batch too slow for it.

A decode step slows with every sequence in the batch, and all of them share it: a ``standard``
request (TPOT <= 250 ms) admitted while the worker's predicted TPOT is 240 ms breaks the TPOT
of any ``interactive`` one (<= 100 ms) running there, and leaves no batch an arriving one could
join. So a request is admitted on a worker only while the worker's predicted TPOT, this request
included, stays within ``(1 - router.class_headroom)`` of the tightest TPOT objective among

- the classes of the requests this router has running on that worker, and
- the classes that arrived in the last ``router.class_headroom_window_s`` (they will again),

where that objective is tighter than its own (a class is never held to less than itself needs:
the tightest class fills batches up to its own objective, and the headroom the looser ones left
is what it arrives into). Objectives are the configured classes', not a request's own
overrides, so one request cannot narrow everyone's batches.
"""

from __future__ import annotations

from typing import Iterable


def tpot_limit(own_s: float | None, others_s: Iterable[float], headroom: float) -> float | None:
    """The highest predicted TPOT a request whose class's objective is ``own_s`` (None: none)
    may bring a worker to, beside classes of objectives ``others_s``: its own objective, or
    ``(1 - headroom)`` of the tightest tighter one where that is lower (None: no limit)."""
    tighter = min((t for t in others_s if own_s is None or t < own_s), default=None)
    if tighter is None:
        return own_s
    kept = tighter * (1.0 - headroom)
    return kept if own_s is None else min(own_s, kept)


class ArrivingClasses:
    """The classes that arrived within ``window_s``, with their TPOT objectives: those plausibly
    arriving again."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._last: dict[str, tuple[float, float]] = {}  # class name -> (TPOT objective, last arrival)

    def saw(self, name: str, tpot_s: float | None, at: float) -> None:
        if tpot_s is None:
            return
        _, last = self._last.get(name, (tpot_s, at))
        self._last[name] = (tpot_s, max(last, at))

    def objectives(self, now: float) -> list[float]:
        return [tpot for tpot, at in self._last.values() if now - at <= self.window_s]

    def names(self, now: float) -> list[str]:
        return sorted(name for name, (_, at) in self._last.items() if now - at <= self.window_s)
