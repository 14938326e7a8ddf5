"""A caller that goes away while its request is being placed or started leaves nothing behind,
whatever order the calls that follow it run in:

- the router: a placement whose caller cancelled is not in flight, whether the cancel runs
  after the placement or (Ray may run an actor's calls out of order) before it, and a request
  id used again later is placed as usual;
- the decode worker: the release of a request waits for its add, reserve or KV receive still
  under way (a reserve that ran after the release would hold its blocks for ever).

The router here has no registry (an unreachable Redis): it places by load only, which is all
these checks need."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from decode_worker.worker import DecodeWorker
from router.actor import RouterActor
from router.config import RouterConfig
from router.router import Topology

pytestmark = pytest.mark.unit

PROMPT = list(range(4, 44))


@pytest.fixture
def router():
    return RouterActor("c1", "redis://127.0.0.1:1/0", Topology(("prefill-0",), ("decode-0",), 16, ()), RouterConfig())


def place(router: RouterActor, request_id: str, arrival: float):
    return asyncio.run(router.place(request_id, PROMPT, 8, arrival=arrival))


def test_a_cancel_after_the_placement_takes_it_back(router):
    arrival = time.time()
    decision = place(router, "r1", arrival)
    assert decision.action == "place" and router.status()["in_flight"] == 1
    router.cancel("r1", arrival)
    assert router.status()["in_flight"] == 0


def test_a_cancel_that_runs_before_its_placement_places_nothing(router):
    arrival = time.time()
    router.cancel("r2", arrival)
    decision = place(router, "r2", arrival)
    assert decision.action == "reject" and decision.reason == "its caller went away"
    assert router.status()["in_flight"] == 0
    again = place(router, "r2", arrival + 1)  # the same id, another call: placed as usual
    assert again.action == "place" and router.status()["in_flight"] == 1


class Worker:
    """What DecodeWorker._release_after uses: its call threads and a release that records."""

    def __init__(self):
        self._calls = ThreadPoolExecutor(2)
        self.released = threading.Event()

    def _release(self, request_id: str) -> None:
        self.released.set()


def test_the_release_waits_for_the_call_under_way():
    worker = Worker()
    added, reserving = Future(), Future()
    added.set_result(None)  # the calls before the last are done: each was awaited before the next began
    DecodeWorker._release_after(worker, [added, reserving], "r1")
    assert not worker.released.wait(0.2)
    reserving.set_result((0, [1, 2]))
    assert worker.released.wait(10)


def test_with_nothing_under_way_the_release_runs_at_once():
    worker = Worker()
    done: Future = Future()
    done.set_result(None)
    DecodeWorker._release_after(worker, [done], "r1")
    assert worker.released.wait(10)
