"""Processor sharing of a machine's cores among the simulated workers' steps, worked by hand."""

import heapq
import itertools

import pytest

from cluster.plan.shared_cores import SharedCores

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.t, self.events, self.order = 0.0, [], itertools.count()

    def after(self, delay, fn):
        heapq.heappush(self.events, (self.t + delay, next(self.order), fn))

    def run(self):
        while self.events:
            self.t, _, fn = heapq.heappop(self.events)
            fn()


def test_steps_share_the_cores_at_the_rate_of_the_moment():
    clock = Clock()
    cores = SharedCores(2, lambda: clock.t, clock.after)
    ended = {}

    def start(key, seconds, threads):
        cores.start(key, seconds, threads, lambda wall: ended.setdefault(key, (clock.t, wall)))

    start("a", 1.0, 1)
    start("b", 0.4, 2)  # 3 threads on 2 cores: both at 2/3
    clock.after(0.3, lambda: start("c", 0.1, 1))  # from 0.3 s: 4 threads, all at 1/2
    clock.run()
    # 0-0.3: a and b do 0.2 each (a 0.8 left, b 0.2). 0.3-0.5: c's 0.1 at 1/2 ends at 0.5; a and
    # b do 0.1 each (a 0.7, b 0.1). Then 3 threads again, 2/3: b ends 0.15 later (0.65), a does
    # 0.1 (0.6 left) and finishes alone at full speed at 1.25.
    assert ended["c"] == pytest.approx((0.5, 0.2))
    assert ended["b"] == pytest.approx((0.65, 0.65))
    assert ended["a"] == pytest.approx((1.25, 1.25))
    assert cores.running == {} and cores.rate() == 1.0


def test_a_worker_steps_one_step_at_a_time():
    clock = Clock()
    cores = SharedCores(2, lambda: clock.t, clock.after)
    cores.start("a", 1.0, 1, lambda wall: None)
    with pytest.raises(ValueError, match="already stepping"):
        cores.start("a", 1.0, 1, lambda wall: None)
    with pytest.raises(ValueError, match="must be positive"):
        SharedCores(0, lambda: 0.0, clock.after)
