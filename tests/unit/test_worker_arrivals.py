"""What a load report says of the requests its worker took lately (``cluster/worker/arrivals.py``),
and whether it shows a placement (``WorkerLoad.shows``): a placement made before the report is
in it only once the worker had taken it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.registry.load import ARRIVALS_KEPT_S, WorkerLoad
from cluster.worker.arrivals import RecentArrivals

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_requests_taken_within_the_kept_second_are_named_and_older_ones_forgotten():
    clock = Clock(100.0)
    arrivals = RecentArrivals(clock)
    assert arrivals.ids() == frozenset()
    arrivals.took("a")
    clock.now = 100.6
    arrivals.took("b")
    assert arrivals.ids() == {"a", "b"}
    clock.now = 100.0 + ARRIVALS_KEPT_S + 0.01
    assert arrivals.ids() == {"b"}
    clock.now = 101.7
    assert arrivals.ids() == frozenset()


REPORT = WorkerLoad("d0", "decode", 0, 15, 0, 0, 0, 80, 100, 4, 2048, 16, updated_at=50.0)


def test_a_report_shows_a_placement_from_before_it_only_once_its_worker_took_it():
    named = replace(REPORT, arrived=frozenset({"taken"}))
    assert named.shows("taken", 49.99)
    assert not named.shows("in flight", 49.99)  # placed before the report, not at the worker yet
    assert not named.shows("taken", 50.0)  # placed after (or as) it was written
    assert named.shows("in flight", 50.0 - ARRIVALS_KEPT_S)  # so long before it: taken
    # A worker of an earlier version does not say: what was placed before its report counts.
    assert REPORT.shows("in flight", 49.99) and not REPORT.shows("in flight", 50.01)


def test_a_report_carries_its_arrivals_through_the_registry_and_an_earlier_ones_lack_of_them():
    named = replace(REPORT, arrived=frozenset({"b", "a"}))
    assert '"arrived":["a","b"]' in named.to_json()
    assert WorkerLoad.from_json(named.to_json()) == named
    assert WorkerLoad.from_json(replace(named, arrived=frozenset()).to_json()).arrived == frozenset()
    assert WorkerLoad.from_json(REPORT.to_json()).arrived is None


class Engine:
    """What a decode worker's calls use of its engine; ``room``: whether a reserve finds blocks."""

    def __init__(self, room: bool):
        self.room = room

    def add_request(self, *args, **kwargs) -> None:
        pass

    def reserve_transfer(self, *args, **kwargs):
        return (0, [3, 4]) if self.room else None

    def reserve_pull(self, *args, **kwargs):
        return (0, [3]) if self.room else None

    def draft_destination(self, request_id: str):
        return None

    def draft_catch_up_s_per_token(self) -> float:
        return 0.0


def test_a_decode_worker_names_the_requests_it_took_and_not_those_it_had_no_blocks_for():
    from types import SimpleNamespace

    from cluster.engine.sampling_params import SamplingParams
    from cluster.protocol.messages import WorkerRequest
    from decode_worker.worker import DecodeWorker

    def request(request_id: str) -> WorkerRequest:
        return WorkerRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4), kv_source_blocks=1)

    worker = SimpleNamespace(engine=Engine(room=True), arrivals=RecentArrivals(Clock(10.0)))
    DecodeWorker._add_local(worker, request("local"))
    assert DecodeWorker._reserve(worker, request("remote")) == (0, [3, 4], None, 0.0)
    assert DecodeWorker._reserve_pull(worker, request("pulled")) == (0, [3])
    full = SimpleNamespace(engine=Engine(room=False), arrivals=worker.arrivals)
    assert DecodeWorker._reserve(full, request("no room")) is None
    assert DecodeWorker._reserve_pull(full, request("no room either")) is None
    assert worker.arrivals.ids() == {"local", "remote", "pulled"}
