"""Batch headroom between SLO classes: a looser class is placed on a decode worker only while its
predicted TPOT stays within (1 - router.class_headroom) of the tightest objective of the classes
running there or arriving (exact arithmetic on hand-made loads, test_router's step-time fits)."""

from __future__ import annotations

import pytest

from router.class_headroom import ArrivingClasses, tpot_limit
from router.config import RouterConfig, RouterConfigError
from router.router import RouteRequest, Router
from test_router import NOW, PROMPT, TOPOLOGY, FakeRegistry, config, load

pytestmark = pytest.mark.unit

# decode step = 20 ms + 5 ms per sequence + 0.1 ms per context token: 11 running and this
# request of 33 prompt tokens predict 20 + 60 + 3.3 = 83.3 ms; 10 running, 78.3 ms
TPOT_12 = 0.020 + 0.005 * 12 + 0.0001 * 33
TPOT_11 = 0.020 + 0.005 * 11 + 0.0001 * 33


def request(rid: str, slo_class: str, **kw) -> RouteRequest:
    return RouteRequest(rid, PROMPT, 8, slo_class, **kw)


def busy(d0: int = 11, d1: int = 11) -> Router:
    return Router(TOPOLOGY, FakeRegistry({"d0": load("d0", running=d0), "d1": load("d1", running=d1)}), config())


def test_the_limit_is_the_tightest_tighter_objective_less_the_headroom():
    assert tpot_limit(0.25, [0.1, 0.25], 0.2) == pytest.approx(0.08, abs=1e-15)
    assert tpot_limit(0.25, [0.1], 0.0) == 0.1  # no headroom: up to the tighter objective itself
    assert tpot_limit(0.1, [0.1, 0.25], 0.2) == 0.1  # the tightest class is held to its own objective only
    assert tpot_limit(0.05, [0.1], 0.2) == 0.05  # a tighter own objective stays
    assert tpot_limit(0.25, [], 0.2) == 0.25
    assert tpot_limit(None, [0.1], 0.5) == 0.05  # a class without an objective keeps the headroom too
    assert tpot_limit(None, [], 0.2) is None


def test_a_class_counts_as_arriving_for_its_window_after_its_last_request():
    arriving = ArrivingClasses(window_s=30.0)
    arriving.saw("interactive", 0.1, at=NOW)
    arriving.saw("interactive", 0.1, at=NOW - 50)  # an older arrival (a request retried) does not move it back
    arriving.saw("batch", None, at=NOW)  # no objective: nothing to keep room for
    assert (arriving.objectives(NOW + 30), arriving.names(NOW + 30)) == ([0.1], ["interactive"])
    assert (arriving.objectives(NOW + 30.5), arriving.names(NOW + 30.5)) == ([], [])


def test_standard_is_held_to_the_headroom_while_interactive_arrives_and_placed_after_the_window():
    router = busy()
    alone = router.route(request("s0", "standard"), now=NOW)  # no interactive seen: up to 250 ms
    assert (alone.action, alone.predicted_tpot_s) == ("place", pytest.approx(TPOT_12))
    router.forget("s0")
    interactive = router.route(request("i", "interactive"), now=NOW)  # 83.3 ms is within its 100 ms
    assert (interactive.action, interactive.predicted_tpot_s) == ("place", pytest.approx(TPOT_12))
    router.forget("i")  # it ended: what holds standard back now is interactive arriving, not running
    held = router.route(request("s1", "standard"), now=NOW + 1)
    assert (held.action, held.predicted_tpot_s) == ("queue", pytest.approx(TPOT_12))
    assert held.reason.endswith("looser ones keep its TPOT within 80 ms (router.class_headroom)")
    assert router.tpot_limits(router.config.slo_class("standard"), ["d0", "d1"], NOW + 1) == {
        "d0": pytest.approx(0.08, abs=1e-15), "d1": pytest.approx(0.08, abs=1e-15)}
    assert router.status(NOW + 1)["arriving_classes"] == ["interactive", "standard"]
    after = router.route(request("s2", "standard"), now=NOW + 30.5)  # 30 s without an interactive request
    assert (after.action, after.predicted_tpot_s) == ("place", pytest.approx(TPOT_12))


def test_standard_goes_where_no_interactive_request_runs_once_none_arrives():
    router = busy()
    interactive = router.route(request("i", "interactive"), now=NOW - 100)
    assert interactive.action == "place"
    there = interactive.decode
    other = {"d0": "d1", "d1": "d0"}[there]
    # the window has passed, but the interactive request still runs on its worker (its report counts it)
    router.registry.state[there] = load(there, running=11)
    assert router.tpot_limits(router.config.slo_class("standard"), ["d0", "d1"], NOW) == {
        there: pytest.approx(0.08, abs=1e-15), other: 0.25}
    standard = router.route(request("s", "standard"), now=NOW)
    assert (standard.action, standard.decode, standard.predicted_tpot_s) == ("place", other, pytest.approx(TPOT_12))


def test_standard_fills_to_the_headroom_and_interactive_past_it():
    router = busy(d0=10, d1=11)
    router.route(request("i0", "interactive"), now=NOW)
    router.forget("i0")
    standard = router.route(request("s", "standard"), now=NOW)  # 78.3 ms on d0 is within 80
    assert (standard.action, standard.decode, standard.predicted_tpot_s) == ("place", "d0", pytest.approx(TPOT_11))
    router.forget("s")
    router.registry.state["d0"] = load("d0", running=11)
    router._loads_read_at = -1e9
    interactive = router.route(request("i1", "interactive"), now=NOW)  # 83.3 ms: past the headroom, within 100
    assert (interactive.action, interactive.predicted_tpot_s) == ("place", pytest.approx(TPOT_12))


def test_a_held_standard_request_waits_for_a_slot_under_the_headroom():
    """19 running: 20 + 5 x 19 = 115 ms a step, 8 tokens each; under 80 ms at most 12 sequences
    fit, so it waits for 8 of the 38 to end (at 19 / (8 x 0.115) a second per worker), past the
    first to end (its last 4 steps)."""
    router = busy(d0=19, d1=19)
    router.route(request("i", "interactive"), now=NOW)  # refused: 120.3 ms is past 100
    held = router.route(request("s", "standard"), now=NOW)
    per_worker = 19 / (8 * 0.115)
    assert (held.action, held.predicted_wait_s) == ("queue", pytest.approx(15 / (2 * per_worker)))


def test_a_request_s_own_tighter_objective_narrows_no_one_else_s_batch():
    router = busy()
    tight = router.route(request("t", "standard", tpot_s=0.09), now=NOW)  # its own objective: 90 ms
    assert (tight.action, tight.tpot_objective_s) == ("place", 0.09)
    other = router.route(request("s", "standard"), now=NOW)
    assert other.action == "place"


def test_a_class_without_objectives_prefers_a_worker_within_the_headroom():
    router = busy(d0=11, d1=10)
    router.route(request("i", "interactive"), now=NOW)
    router.forget("i")
    batch = router.route(request("b", "batch"), now=NOW)
    assert (batch.action, batch.decode, batch.reason) == ("place", "d1", "")
    router.forget("b")
    router.registry.state["d1"] = load("d1", running=11)
    router._loads_read_at = -1e9
    anyway = router.route(request("b2", "batch"), now=NOW)  # no worker within it: placed best-effort still
    assert anyway.action == "place"


def test_headroom_keys_are_read_checked_and_written_back():
    assert (RouterConfig().class_headroom, RouterConfig().class_headroom_window_s) == (0.2, 30.0)
    read = RouterConfig.from_mapping({"class_headroom": 0, "class_headroom_window_s": 5})
    assert (read.class_headroom, read.class_headroom_window_s) == (0.0, 5.0)
    assert read.to_mapping()["class_headroom"] == 0.0
    with pytest.raises(RouterConfigError, match=r"^router\.class_headroom: must be in \[0, 1\), got 1$"):
        RouterConfig.from_mapping({"class_headroom": 1})
    with pytest.raises(RouterConfigError, match=r"^router\.class_headroom_window_s: must be a positive number"):
        RouterConfig.from_mapping({"class_headroom_window_s": 0})
    no_headroom = Router(TOPOLOGY, FakeRegistry({"d0": load("d0", running=14), "d1": load("d1", running=14)}),
                         config(class_headroom=0))
    no_headroom.route(request("i", "interactive"), now=NOW)
    no_headroom.forget("i")
    up_to_it = no_headroom.route(request("s", "standard"), now=NOW)  # 20 + 75 + 3.3 ms: within 100 ms itself
    assert (up_to_it.action, up_to_it.predicted_tpot_s) == ("place", pytest.approx(0.0983))
