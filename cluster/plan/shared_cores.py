"""Steps of CPU workers that share one machine's cores, as processor sharing: while the steps
in progress want more threads than there are cores, every one of them advances at cores over
threads wanted, and that rate changes whenever a step starts or ends.

A step's time from the step-time model is its time with a core for each of its threads; here it
is work, done at the rate of the moment. The rule it replaces fixed a step's slowdown when the
step started, so a 2.6 s prefill that began while no other worker stepped ran at full speed
through every short decode step that started during it, and those decode steps paid for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

EPSILON_S = 1e-12  # work left under this is done (float residue of the rate changes)


@dataclass
class _Step:
    work_s: float  # the step's time with a core per thread, what is left of it
    threads: int
    started_at: float
    done: Callable[[float], None]  # called with the step's wall seconds
    version: int = 0  # its end event's version: an end scheduled before the latest rate change is stale


class SharedCores:
    """``start(key, seconds, threads, done)`` runs a step; ``done(wall_seconds)`` is called when
    it ends. ``after(delay, fn)`` is the simulator's clock (``now()``) scheduling ``fn``."""

    def __init__(self, cores: float, now: Callable[[], float], after: Callable[[float, Callable[[], None]], None]):
        if cores <= 0:
            raise ValueError(f"shared cores must be positive, got {cores}")
        self.cores, self.now, self.after = cores, now, after
        self.running: dict[Hashable, _Step] = {}
        self._since = 0.0  # when the steps' work was last brought up to date

    def rate(self) -> float:
        """How fast each running step advances: 1, or the cores over the threads wanting one."""
        wanting = sum(step.threads for step in self.running.values())
        return min(1.0, self.cores / wanting) if wanting else 1.0

    def start(self, key: Hashable, seconds: float, threads: int, done: Callable[[float], None]) -> None:
        if key in self.running:
            raise ValueError(f"{key!r} is already stepping")
        self._advance()
        before = self.rate()
        self.running[key] = _Step(max(0.0, seconds), max(1, threads), self.now(), done)
        self._schedule(everyone=self.rate() != before, key=key)

    def _advance(self) -> None:
        now, rate = self.now(), self.rate()
        for step in self.running.values():
            step.work_s = max(0.0, step.work_s - (now - self._since) * rate)
        self._since = now

    def _schedule(self, everyone: bool = True, key: Hashable = None) -> None:
        """(Re)schedules the end of every running step (the rate changed), or only ``key``'s, or
        none (``everyone`` False and no ``key``: the rate did not change)."""
        rate = self.rate()
        for k, step in self.running.items():
            if everyone or k == key:
                step.version += 1
                self.after(step.work_s / rate, lambda k=k, v=step.version: self._end(k, v))

    def _end(self, key: Hashable, version: int) -> None:
        step = self.running.get(key)
        if step is None or step.version != version:
            return
        self._advance()
        if step.work_s > EPSILON_S:  # float residue: not done yet, end it when it is
            self._schedule(everyone=False, key=key)
            return
        before = self.rate()
        del self.running[key]
        self._schedule(everyone=self.rate() != before)
        step.done(self.now() - step.started_at)
