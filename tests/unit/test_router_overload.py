"""Overload: a request that may wait is held only as long as its class's bound, refused at once
when the router predicts it would wait longer, and every refusal says when to retry, from the
queue and the workers' step-time fits (exact arithmetic on hand-made loads)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.registry.load import StepSample
from router.config import RouterConfig, RouterConfigError
from router.cost_model import measured_step_scale
from router.router import RouteRequest, Router
from router.wait_forecast import DecodeSlots, WaitForecast, decode_slots, slot_wait_s
from test_router import NOW, PREFILL_STEPS, PROMPT, TOPOLOGY, FakeRegistry, config, full_decode, load

pytestmark = pytest.mark.unit

# decode step = 20 ms + 5 ms per sequence + 0.1 ms per context token (test_router's fits)
STEP_16 = 0.020 + 0.005 * 16  # 100 ms: a full worker's step


def model_of(router: Router, worker: str):
    return router.model(router.registry.loads([worker])[worker])


def test_slots_free_at_the_rate_sequences_finish():
    """16 sequences of 8 tokens at 100 ms a step: 16 / 0.8 s = 20 a second per worker; the first
    frees its slot after its last 4 steps."""
    router = Router(TOPOLOGY, FakeRegistry(full_decode()), config())
    slots = decode_slots(full_decode()["d0"], model_of(router, "d0"), [], blocks_per_request=11,
                         tpot_objective_s=0.25, output_tokens=8)
    assert slots == DecodeSlots(room=0, departures_per_s=pytest.approx(20.0), first_departure_s=pytest.approx(0.4))
    assert slot_wait_s([slots, slots], 1) == pytest.approx(0.4)  # the first to end
    assert slot_wait_s([slots, slots], 41) == pytest.approx(41 / 40)  # 40 ahead: at 40 a second
    assert slot_wait_s([DecodeSlots(3, 0.0, float("inf"))], 3) == 0.0  # room now
    assert slot_wait_s([DecodeSlots(0, 0.0, float("inf"))], 1) == float("inf")  # nothing decodes


def test_the_tpot_objective_and_free_blocks_bound_a_worker_s_slots():
    router = Router(TOPOLOGY, FakeRegistry(), config())
    model = model_of(router, "d0")
    # 4 sequences of 1,000 context tokens: each adds 5 + 100 ms to a step; within 250 ms, 2 fit
    long_context = load("d0", running=4, context=4000)
    assert decode_slots(long_context, model, [], 11, tpot_objective_s=0.25, output_tokens=8).room == 0
    assert decode_slots(long_context, model, [], 11, tpot_objective_s=None, output_tokens=8).room == 100 // 11
    # 2 running, 23 free blocks, a placement since the report holding 33 prompt tokens (9 blocks):
    # 14 blocks left, one request of 11
    few_blocks = load("d0", running=2, free=23)
    assert decode_slots(few_blocks, model, [33], 11, tpot_objective_s=None, output_tokens=8).room == 1


def test_forecast_first_token_and_retry_after():
    held = WaitForecast(wait_s=2.0, backlog_s=0.5, after_s=0.3)
    assert held.first_token_s(spent_s=1.0) == pytest.approx(3.3)
    assert held.retry_after_s(5.0) == pytest.approx(2.0)  # the slot is what it waits for
    backlog = WaitForecast(wait_s=0.0, backlog_s=9.05, after_s=0.043)
    assert backlog.retry_after_s(5.0) == pytest.approx(4.093)  # until the backlog leaves time for its prefill
    assert backlog.retry_after_s(None) == 0.0


def test_a_held_request_is_told_its_predicted_wait_behind_those_ahead():
    router = Router(TOPOLOGY, FakeRegistry(full_decode()), config())
    first = router.submit(RouteRequest("a", PROMPT, 8, "standard"), now=NOW)
    assert (first.action, first.predicted_wait_s, first.retry_after_s) == ("queue", pytest.approx(0.4),
                                                                         pytest.approx(0.4))
    for i in range(40):
        router.submit(RouteRequest(f"b{i}", PROMPT, 8, "standard"), now=NOW)
    last = router.submit(RouteRequest("c", PROMPT, 8, "standard"), now=NOW)
    assert last.predicted_wait_s == pytest.approx(42 / 40)  # 41 ahead and itself, 40 slots a second


def test_a_decode_fit_missing_when_the_model_was_made_is_fitted_at_once_not_deferred():
    """The ingress's router defers refits, but a model made from reports with no decode steps
    (placed before the workers decoded) is refitted as soon as a report has them: deferred, the
    full workers were predicted to decode in no time, so never to free a slot, and the request
    was refused as waiting "with no end in sight" (CI). A report still without decode samples
    leaves the deferral as it was."""
    no_decodes = {d: load(d, steps=PREFILL_STEPS, updated_at=NOW) for d in ("d0", "d1")}
    router = Router(TOPOLOGY, FakeRegistry(no_decodes), config(), defer_refits=True)
    assert router.route(RouteRequest("first", PROMPT, 8, "batch"), now=NOW).action == "place"
    assert model_of(router, "d0").decode is None
    router.finished("first", now=NOW)
    still = {d: load(d, steps=PREFILL_STEPS + PREFILL_STEPS[:1], updated_at=NOW + 0.5) for d in ("d0", "d1")}
    router.registry.state.update(still)
    router._loads_read_at = -1e9
    assert router.route(RouteRequest("second", PROMPT, 8, "batch"), now=NOW + 1).action == "place"
    assert router.refits_due  # nothing to fill the gap with: deferred as before
    router.refit_deferred()
    router.finished("second", now=NOW + 1)
    router.registry.state.update({d: replace(w, updated_at=NOW + 1.5) for d, w in full_decode().items()})
    router._loads_read_at = -1e9
    held = router.submit(RouteRequest("a", PROMPT, 8, "standard"), now=NOW + 1.5)
    assert (held.action, held.predicted_wait_s) == ("queue", pytest.approx(0.4))  # as test_..._predicted_wait
    assert model_of(router, "d0").decode == pytest.approx((0.020, 0.005, 0.0001))


def test_the_learned_output_length_sets_how_fast_slots_free():
    router = Router(TOPOLOGY, FakeRegistry(), config())
    route = router.route(RouteRequest("done", PROMPT, 8, "batch"), now=NOW)
    assert route.action == "place"
    router.finished("done", output_tokens=40, now=NOW)  # the mean output: 40 tokens
    router.registry.state.update(full_decode())
    router._loads_read_at = -1e9
    decision = router.submit(RouteRequest("a", PROMPT, 8, "standard"), now=NOW)
    # 16 sequences of 40 tokens at 100 ms a step: 4 a second per worker, 8 in all; 1 needed
    assert decision.predicted_wait_s == pytest.approx(max(0.4, 1 / 8))
    assert router.status(NOW)["mean_output_tokens"] == 40


def test_a_request_predicted_to_wait_past_its_bound_is_refused_on_arrival():
    classes = {"standard": {"ttft_ms": 5000, "tpot_ms": 250, "on_overload": "queue", "max_wait_ms": 300}}
    router = Router(TOPOLOGY, FakeRegistry(full_decode()), config(slo_classes=classes))
    decision = router.submit(RouteRequest("a", PROMPT, 8, "standard", arrival=NOW), now=NOW)
    assert decision.action == "reject"
    assert decision.retry_after_s == pytest.approx(0.4)
    assert decision.reason.startswith("predicted to wait 400 ms more for a decode slot (after 0 ms), past its "
                                      "bound of 300 ms; no decode worker has a free slot")
    assert len(router.waiting) == 0 and router.inflight == {}
    assert router.status(NOW)["rejected_by_class"] == {"standard": 1}


def test_blocks_held_by_no_sequence_are_being_released_not_waited_on_forever():
    """Both decode workers run nothing, yet their reports show 95 of 100 blocks in use: requests
    that ended (a deadline, a cancel) while the reports were taken. A request needing 3 blocks is
    held for the next report, not refused as waiting "with no end in sight"; once a report shows
    the blocks free it is placed; blocks that stay held past its bound refuse it then."""
    tearing_down = {d: load(d, free=5, updated_at=NOW) for d in ("d0", "d1")}
    slots = decode_slots(tearing_down["d0"], model_of(Router(TOPOLOGY, FakeRegistry(), config()), "d0"), [],
                         blocks_per_request=11, tpot_objective_s=0.25, output_tokens=8)
    assert slots == DecodeSlots(room=0, departures_per_s=0.0, first_departure_s=float("inf"), releasing=9)
    assert slot_wait_s([slots], 9) == 0.0 and slot_wait_s([slots], 10) == float("inf")
    assert slot_wait_s([DecodeSlots(0, 0.0, float("inf"))], 1) == float("inf")  # nothing held, nothing decodes

    classes = {"standard": {"ttft_ms": 5000, "tpot_ms": 250, "on_overload": "queue", "max_wait_ms": 500}}
    registry = FakeRegistry(tearing_down)
    router = Router(TOPOLOGY, registry, config(slo_classes=classes))
    long = list(range(100, 133 + 16 * 8))  # 161 tokens + 8: 11 blocks, more than the 5 free
    held = router.submit(RouteRequest("a", long, 8, "standard", arrival=NOW), now=NOW)
    assert (held.action, held.predicted_wait_s) == ("queue", 0.0)
    registry.state["d0"] = load("d0", updated_at=NOW + 0.1)  # released
    [placed] = router.retry_waiting(NOW + 0.15)
    assert (placed.action, placed.request_id, placed.decode) == ("place", "a", "d0")

    stuck = Router(TOPOLOGY, FakeRegistry(tearing_down), config(slo_classes=classes))
    assert stuck.submit(RouteRequest("b", long, 8, "standard", arrival=NOW), now=NOW).action == "queue"
    [refused] = stuck.retry_waiting(NOW + 0.6)
    assert (refused.action, refused.request_id) == ("reject", "b")
    assert refused.reason.startswith("predicted to wait 0 ms more for a decode slot (after 600 ms), past its bound "
                                     "of 500 ms")


def test_a_prefill_backlog_past_the_objective_is_refused_at_once():
    """9,000 queued prompt tokens (9.05 s of prefill) on each prefill worker: holding the
    request would not bring its first token sooner than 9.09 s, past its 5 s."""
    busy = {w: load(w, queued=9000) for w in ("p0", "p1")}
    router = Router(TOPOLOGY, FakeRegistry(busy), config())
    decision = router.submit(RouteRequest("a", PROMPT, 8, "standard", arrival=NOW), now=NOW)
    assert decision.action == "reject"
    assert decision.retry_after_s == pytest.approx(9.05 + 0.043 - 5.0)
    assert decision.reason.startswith("its first token is predicted 9093 ms after arrival however long it waits "
                                      "(backlog 9050 ms, slot in 0 ms)")


def test_a_request_placed_again_after_admission_is_never_refused_by_it():
    """The same 9 s prefill backlog: a fresh request is refused, but one whose worker failed under
    it (admitted before, placed again) is placed best effort, or held for room, never cut; an
    interactive one too, and where every decode worker is full it is held past its class's bound."""
    busy = {w: load(w, queued=9000) for w in ("p0", "p1")}
    router = Router(TOPOLOGY, FakeRegistry(busy), config())
    assert router.submit(RouteRequest("a", PROMPT, 8, "standard", arrival=NOW), now=NOW).action == "reject"
    again = router.submit(RouteRequest("a.1", PROMPT, 8, "standard", arrival=NOW, admitted=True), now=NOW)
    assert (again.action, again.slo_class) == ("place", "standard")
    assert again.reason.startswith("best effort: ")
    interactive = router.submit(RouteRequest("i.1", PROMPT, 8, "interactive", arrival=NOW, admitted=True), now=NOW)
    assert interactive.action == "place"
    assert router.status(NOW)["rejected_by_class"] == {"standard": 1}

    full = Router(TOPOLOGY, FakeRegistry(full_decode()), config())
    held = full.submit(RouteRequest("b.1", PROMPT, 8, "standard", arrival=NOW, admitted=True), now=NOW)
    assert held.action == "queue" and held.reason.startswith("no decode worker has a free slot")
    assert full.retry_waiting(NOW + 6.0) == []  # past standard's 5 s bound, still held, not refused
    assert len(full.waiting) == 1


def test_a_held_request_past_its_bound_is_refused_with_a_fresh_forecast():
    classes = {"standard": {"ttft_ms": 5000, "tpot_ms": 250, "on_overload": "queue", "max_wait_ms": 500}}
    registry = FakeRegistry(full_decode())
    router = Router(TOPOLOGY, registry, config(slo_classes=classes))
    assert router.submit(RouteRequest("a", PROMPT, 8, "standard", arrival=NOW), now=NOW).action == "queue"
    assert router.retry_waiting(NOW + 0.3) == []  # its slot 100 ms away, by the report 300 ms old: it waits
    registry.state.update(full_decode(next_slot_tokens=9))  # a report: still full, and its first slot further off
    for d in ("d0", "d1"):
        registry.state[d] = replace(registry.state[d], updated_at=NOW + 0.5)
    [refused] = router.retry_waiting(NOW + 0.6)
    assert (refused.action, refused.request_id) == ("reject", "a")
    assert refused.retry_after_s == pytest.approx(0.8)  # 9 steps of 100 ms from a report 100 ms old
    assert len(router.waiting) == 0


def test_a_class_that_may_not_wait_is_told_when_to_retry():
    router = Router(TOPOLOGY, FakeRegistry({w: load(w, queued=3000) for w in ("p0", "p1")}), config())
    decision = router.submit(RouteRequest("i", PROMPT, 8, "interactive"), now=NOW)
    assert decision.action == "reject"
    assert decision.retry_after_s == pytest.approx(3.02 + 0.043 - 1.0)  # the backlog leaves its 43 ms in 1 s


def test_max_wait_is_read_checked_and_written_back():
    classes = {"chat": {"ttft_ms": 800, "max_wait_ms": 300}}
    cfg = RouterConfig.from_mapping({"slo_classes": classes, "default_class": "chat"})
    assert cfg.slo_class("chat").wait_bound_s == pytest.approx(0.3)
    assert cfg.to_mapping()["slo_classes"]["chat"]["max_wait_ms"] == 300
    assert RouterConfig.from_mapping(cfg.to_mapping()) == cfg
    assert RouterConfig().slo_class("standard").wait_bound_s == 5.0  # default: its TTFT objective
    assert RouterConfig().slo_class("batch").wait_bound_s is None
    with pytest.raises(RouterConfigError, match=r"router.slo_classes.chat.max_wait_ms: must be at most ttft_ms \(800\)"):
        RouterConfig.from_mapping({"slo_classes": {"chat": {"ttft_ms": 800, "max_wait_ms": 900}},
                                   "default_class": "chat"})
    with pytest.raises(RouterConfigError, match=r"router.slo_classes.chat.max_wait_ms: must be a positive number"):
        RouterConfig.from_mapping({"slo_classes": {"chat": {"max_wait_ms": -1}}, "default_class": "chat"})


def test_tpot_measured_slower_than_predicted_scales_what_the_router_predicts():
    """A request that decoded at twice its predicted TPOT (contended cores): the scale moves a
    tenth of the way (1.1), later TPOTs are predicted 10% slower, and it decays as the TTFT
    correction does."""
    router = Router(TOPOLOGY, FakeRegistry(), config())
    first = router.route(RouteRequest("a", PROMPT, 8, "standard"), now=NOW)
    router.finished("a", now=NOW, tpot_s=2 * first.predicted_tpot_s)
    assert router.tpot_scale(NOW) == pytest.approx(1.1)
    second = router.route(RouteRequest("b", PROMPT, 8, "standard"), now=NOW)
    assert second.predicted_tpot_s == pytest.approx(first.predicted_tpot_s * 1.1)
    assert second.tpot_scale == pytest.approx(1.1)
    router.finished("b", now=NOW, tpot_s=second.predicted_tpot_s / 1.1)  # as fitted: towards 1
    assert router.tpot_scale(NOW) == pytest.approx(1.1 + 0.1 * (1.0 - 1.1))
    assert router.tpot_scale(NOW + 30.0) == pytest.approx(1.0 + 0.09 * 0.5)  # a half-life later
    # a worker's batch within 252.5 ms: at scale 1, (0.2525 - 0.02) / 0.005 = 46.5 sequences; at
    # scale 2, (0.12625 - 0.02) / 0.005 = 21.25: 21
    model = model_of(router, "d0")
    wide = replace(load("d0", running=18), max_num_seqs=64)
    assert decode_slots(wide, model, [], 1, 0.2525, 8).room == 46 - 18
    assert decode_slots(wide, model, [], 1, 0.2525, 8, step_scale=2.0).room == 21 - 18


def test_a_worker_s_latest_steps_measure_how_much_slower_its_decodes_run_than_its_fit():
    """Fit: 20 ms + 5 ms per sequence (+ 0.1 ms per context token). 8 decode steps of 4
    sequences as fitted (40 ms each), then 8 steps that also prefilled a prompt and took 120 ms:
    the slowest 2 of 16 are left out, (8 * 40 + 6 * 120) / (14 * 40) = 1040 / 560. A single
    613 ms pause among 32 fitted steps is left out: 1.0."""

    router = Router(TOPOLOGY, FakeRegistry(), config())
    model = model_of(router, "d0")
    fitted = StepSample(0, 0, 4, 0, 0.040)
    mixed = StepSample(64, 2080, 4, 0, 0.120)
    assert measured_step_scale(model, (fitted,) * 8 + (mixed,) * 8) == pytest.approx(1040 / 560)
    assert measured_step_scale(model, (fitted,) * 31 + (StepSample(0, 0, 4, 0, 0.613),)) == pytest.approx(1.0)
    assert measured_step_scale(model, (StepSample(64, 2080, 0, 0, 0.1),)) == 1.0  # no decodes: nothing to scale
    # only the latest 32 steps with decodes count: 40 slow ones, then 32 as fitted
    assert measured_step_scale(model, (mixed,) * 40 + (fitted,) * 32) == pytest.approx(1.0)


def test_a_worker_measured_slower_than_its_fit_is_predicted_slower_at_once():
    """A decode worker whose latest steps ran 3x its fit (prompts prefilled among its decodes,
    contended cores): its TPOT predictions are 3x at once, not a finished request later, so an
    interactive request (TPOT <= 100 ms) is refused where it fits (5 sequences: 45 ms + context);
    the decision records the scale."""
    slow = tuple(StepSample(64, 2080, 4, 0, 3 * 0.040) for _ in range(32))  # left out of the fit: they prefilled
    base = load("d0", running=4)
    measured = {"d0": replace(base, steps=base.steps + slow)}
    routers = {}
    for name, loads in (("fitted", {"d0": base}), ("measured", measured)):
        routers[name] = Router(TOPOLOGY, FakeRegistry(loads), config())
        routers[name].worker_failed("d1", now=NOW)
    assert routers["measured"].step_scale(measured["d0"], NOW) == pytest.approx(3.0)
    fitted = routers["fitted"].route(RouteRequest("a", PROMPT, 8, "standard"), now=NOW)
    slowed = routers["measured"].route(RouteRequest("a", PROMPT, 8, "standard"), now=NOW)
    assert (fitted.decode, slowed.decode) == ("d0", "d0")
    assert slowed.predicted_tpot_s == pytest.approx(3 * fitted.predicted_tpot_s)
    assert (fitted.tpot_scale, slowed.tpot_scale) == (pytest.approx(1.0), pytest.approx(3.0))
    assert routers["fitted"].route(RouteRequest("i", PROMPT, 8, "interactive"), now=NOW).action == "place"
    assert routers["measured"].route(RouteRequest("i", PROMPT, 8, "interactive"), now=NOW).action == "reject"
    assert routers["measured"].status(NOW)["measured_step_scales"]["d0"] == pytest.approx(3.0)  # tandem status shows it
