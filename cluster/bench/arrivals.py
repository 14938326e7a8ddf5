"""When sessions start: an open-loop schedule of offsets (seconds from the run's start), or a
closed loop of a fixed number of concurrent clients.

    poisson   exponential gaps at ``rate`` per second (seeded)
    constant  one every ``1 / rate`` seconds
    burst     ``burst_size`` at once, every ``burst_size / rate`` seconds (the same mean rate)
    trace     the workload's own timestamps, divided by ``speedup``
    concurrency N: N clients, each starting the next session as soon as its last one ended

Offsets count sessions, not requests: a multi-turn session's later turns follow its own
answers and think time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("poisson", "constant", "burst", "trace")


class ArrivalError(ValueError):
    """An arrival process that cannot work; the message names the flag."""


@dataclass(frozen=True)
class Arrivals:
    kind: str  # one of KINDS, or "concurrency"
    rate: float | None = None  # sessions per second (poisson, constant, burst)
    burst_size: int = 1
    speedup: float = 1.0
    concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind == "concurrency":
            if not self.concurrency or self.concurrency < 1:
                raise ArrivalError(f"--concurrency: must be at least 1, got {self.concurrency}")
            return
        if self.kind not in KINDS:
            raise ArrivalError(f"--arrival: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "trace" and not (self.rate and self.rate > 0):
            raise ArrivalError(f"--rate: {self.kind} arrivals need a rate > 0 (requests per second)")
        if self.burst_size < 1:
            raise ArrivalError(f"--burst-size: must be at least 1, got {self.burst_size}")
        if not self.speedup > 0:
            raise ArrivalError(f"--speedup: must be > 0, got {self.speedup}")

    @property
    def closed_loop(self) -> bool:
        return self.kind == "concurrency"

    def offsets(self, count: int, timestamps: list[float | None] | None = None) -> list[float]:
        """Start offsets of ``count`` sessions, non-decreasing; ``timestamps`` are the
        sessions' own (trace) times."""
        if self.closed_loop:
            raise ArrivalError("a closed loop (--concurrency) has no schedule")
        if self.kind == "trace":
            if timestamps is None or any(t is None for t in timestamps[:count]):
                raise ArrivalError("--arrival trace: the workload has no timestamps (use a Mooncake trace)")
            return [t / self.speedup for t in timestamps[:count]]
        if self.kind == "poisson":
            return poisson_offsets(self.rate, count, self.seed)
        if self.kind == "constant":
            return [i / self.rate for i in range(count)]
        every = self.burst_size / self.rate
        return [(i // self.burst_size) * every for i in range(count)]

    def describe(self) -> str:
        if self.closed_loop:
            return f"concurrency {self.concurrency}"
        if self.kind == "trace":
            return f"trace timestamps / {self.speedup:g}"
        burst = f" in bursts of {self.burst_size}" if self.kind == "burst" else ""
        return f"{self.kind} {self.rate:g}/s{burst}"


def poisson_offsets(rate: float, count: int, seed: int = 0) -> list[float]:
    """A seeded Poisson process: exponential gaps of mean ``1 / rate``, the first after one gap."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out
