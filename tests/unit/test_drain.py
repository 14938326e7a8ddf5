"""A worker's drain as a state machine (``cluster/deployment/drain.py``): announced until every
router places by the record that names it draining (or the wait for routers ends), emptying until
two looks in a row find nothing in flight, or its timeout; exact phases and counts."""

from __future__ import annotations

import pytest

from cluster.deployment.drain import ANNOUNCED, EMPTYING, STOPPING, Drain, DrainLook

pytestmark = pytest.mark.unit


def drain(**kw) -> Drain:
    return Drain("decode-0", version=5, started_at=100.0, timeout_s=30.0, router_wait_s=10.0, **kw)


def test_it_waits_for_every_router_then_for_its_requests_to_finish():
    d = drain()
    assert d.step(DrainLook(100.2, router_versions=(5, 4), in_flight=3)) == ANNOUNCED  # one router has not read it
    assert d.step(DrainLook(100.4, router_versions=(5, 6), in_flight=3)) == EMPTYING
    assert d.step(DrainLook(100.6, (5, 6), in_flight=1)) == EMPTYING
    assert d.step(DrainLook(100.8, (5, 6), in_flight=0)) == EMPTYING  # one quiet look is not enough
    assert d.step(DrainLook(101.0, (5, 6), in_flight=2)) == EMPTYING  # a late placement arrived: count again
    assert d.quiet == 0
    assert d.step(DrainLook(101.2, (5, 6), in_flight=0)) == EMPTYING
    assert d.step(DrainLook(101.4, (5, 6), in_flight=0)) == STOPPING
    assert d.done and d.left_in_flight == 0
    assert d.history == [ANNOUNCED, EMPTYING, STOPPING]


def test_no_router_at_all_is_no_router_to_wait_for_and_an_idle_worker_stops_after_two_looks():
    d = drain()
    assert d.step(DrainLook(100.2, (), 0)) == EMPTYING  # announced and emptied in one look: quiet 1
    assert d.quiet == 1
    assert d.step(DrainLook(100.4, (), 0)) == STOPPING


def test_a_router_that_never_answers_holds_the_drain_up_only_until_the_router_wait():
    d = drain()
    assert d.step(DrainLook(109.9, (4,), 2)) == ANNOUNCED
    assert d.step(DrainLook(110.0, (4,), 2)) == EMPTYING


def test_past_its_timeout_it_stops_with_its_requests_in_flight_to_move():
    d = drain()
    d.step(DrainLook(100.2, (5,), 4))
    assert d.step(DrainLook(129.9, (5,), 4)) == EMPTYING
    assert d.step(DrainLook(130.0, (5,), 3)) == STOPPING
    assert d.left_in_flight == 3
    assert d.step(DrainLook(131.0, (5,), 0)) == STOPPING  # stopping is where it stays
    assert d.history == [ANNOUNCED, EMPTYING, STOPPING]
