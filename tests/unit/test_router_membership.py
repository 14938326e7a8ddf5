"""The router follows its deployment's membership record: a draining worker takes no new placement
(by the registry or by load only), a worker added is placed on once the record names it, an older
record changes nothing, and the filter itself keeps pool order."""

from __future__ import annotations

import pytest

from cluster.registry.membership import Membership
from router.filters import LivePools, not_draining
from router.router import Router
from test_router import NOW, TOPOLOGY, FakeRegistry, config, load, route

pytestmark = pytest.mark.unit


def test_not_draining_keeps_the_others_in_pool_order():
    assert not_draining(["d0", "d1", "d2", "d3"], {"d2", "d0"}) == ["d1", "d3"]
    loads = {w: load(w) for w in ("p0", "p1", "d0", "d1")}
    live = LivePools.of(("p0", "p1"), ("d0", "d1"), (), loads, failed={"d1"}, draining={"p0"})
    assert (live.prefill, live.decode, live.colocated) == (["p1"], ["d0"], [])


def test_a_draining_decode_worker_takes_no_new_placement_and_its_placements_finish():
    router = Router(TOPOLOGY, FakeRegistry(), config(policy="round_robin"))
    before = [route(router, f"a{i}").decode for i in range(4)]
    assert sorted(set(before)) == ["d0", "d1"]
    assert router.set_membership(Membership(1, ("p0", "p1"), ("d0", "d1"), draining=("d0",)))
    assert router.topology.draining == ("d0",) and router.topology.version == 1
    after = [route(router, f"b{i}", now=NOW + 0.01 * i) for i in range(6)]
    assert [d.decode for d in after] == ["d1"] * 6
    assert {d.prefill for d in after} == {"p0", "p1"}
    finished = router.finished("a0")  # placed on d0 before it drained: it ends as any other
    assert finished is not None and "a0" not in router.inflight
    status = router.status(NOW)
    assert status["topology_version"] == 1 and status["draining_workers"] == ["d0"]


def test_a_draining_prefill_worker_takes_no_new_prefill():
    router = Router(TOPOLOGY, FakeRegistry(), config(policy="round_robin"))
    router.set_membership(Membership(1, ("p0", "p1"), ("d0", "d1"), draining=("p1",)))
    assert {route(router, f"r{i}", now=NOW + 0.01 * i).prefill for i in range(6)} == {"p0"}


def test_placing_by_load_only_skips_draining_workers():
    registry = FakeRegistry()
    router = Router(TOPOLOGY, registry, config())
    router.set_membership(Membership(1, ("p0", "p1"), ("d0", "d1"), draining=("d0", "p0")))
    registry.down = True
    decision = route(router)
    assert decision.load_only and (decision.prefill, decision.decode) == ("p1", "d1")


def test_a_worker_added_is_placed_on_once_the_record_names_it_and_an_older_record_changes_nothing():
    registry = FakeRegistry({"d2": load("d2")})
    router = Router(TOPOLOGY, registry, config(policy="round_robin"))
    assert {route(router, f"a{i}", now=NOW + 0.01 * i).decode for i in range(6)} == {"d0", "d1"}
    assert router.set_membership(Membership(2, ("p0", "p1"), ("d1", "d2")))  # d0 removed, d2 added
    placed = [route(router, f"b{i}", now=NOW + 0.1 + 0.01 * i).decode for i in range(6)]
    assert set(placed) == {"d1", "d2"}
    assert not router.set_membership(Membership(1, ("p0",), ("d0",)))  # stale: kept as it is
    assert router.topology.decode == ("d1", "d2") and router.topology.version == 2
    assert router.topology.workers == ("p0", "p1", "d1", "d2")
    assert router.status(NOW + 0.2)["live_workers"] == ["d1", "d2", "p0", "p1"]  # nothing kept of d0


def test_the_membership_record_round_trips_and_names_each_workers_state():
    record = Membership(7, ("prefill-0",), ("decode-1", "decode-2"), (), draining=("decode-1",))
    assert Membership.from_json(record.to_json()) == record
    assert [record.state_of(w) for w in ("prefill-0", "decode-1", "decode-0")] == ["serving", "draining", "removed"]
