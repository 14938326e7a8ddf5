"""The router's placements for hand-made registry states: exact workers, exact predictions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.engine.block_hash import hash_token_blocks
from cluster.registry.kv_index import TierHits
from cluster.registry.load import StepSample, WorkerLoad
from router.config import RouterConfig, RouterConfigError
from router.cost_model import StepTimeModel, fit_nonnegative
from router.router import RegistryUnavailable, RouteRequest, Router, Topology

pytestmark = pytest.mark.unit

BS = 4
TOPOLOGY = Topology(prefill=("p0", "p1"), decode=("d0", "d1"), block_size=BS, hash_keys=("m",))
NOW = 1000.0
# prefill step = 10 ms + 1 ms per token; decode step = 20 ms + 5 ms per sequence + 0.1 ms per context token
PREFILL_STEPS = tuple(StepSample(n, 0, 0, 0, 0.010 + 0.001 * n) for n in (16, 64, 256))
DECODE_STEPS = tuple(StepSample(0, 0, s, c, 0.020 + 0.005 * s + 0.0001 * c) for s, c in ((1, 100), (2, 400), (4, 300)))


def load(worker: str, queued: int = 0, running: int = 0, free: int = 100, context: int = 0,
         steps=None, updated_at: float = NOW - 0.01) -> WorkerLoad:
    role = "prefill" if worker.startswith("p") else "decode"
    steps = steps if steps is not None else (PREFILL_STEPS if role == "prefill" else PREFILL_STEPS + DECODE_STEPS)
    return WorkerLoad(worker, role, 0, running, 0, queued, context, free, 100, BS, 2048, 16, steps, updated_at)


class FakeRegistry:
    def __init__(self, loads: dict[str, WorkerLoad] | None = None):
        self.state = {w: load(w) for w in TOPOLOGY.prefill + TOPOLOGY.decode}
        self.state.update(loads or {})
        self.blocks: dict[bytes, set[str]] = {}
        self.down = False
        self.calls: list[str] = []  # the reads asked for, one round trip each

    def hold(self, worker: str, tokens: list[int], blocks: int) -> None:
        for h in hash_token_blocks(tokens, BS, ("m",))[:blocks]:
            self.blocks.setdefault(h, set()).add(worker)

    def loads(self, workers):
        if self.down:
            raise RegistryUnavailable("connection refused")
        self.calls.append("loads")
        return {w: self.state[w] for w in workers if w in self.state}

    def prefix_tiers(self, hashes, workers):
        if self.down:
            raise RegistryUnavailable("connection refused")
        self.calls.append("prefix_tiers")
        return self._matched(hashes, workers)

    def loads_and_prefix_tiers(self, workers, hashes):
        if self.down:
            raise RegistryUnavailable("connection refused")
        self.calls.append("loads_and_prefix_tiers")
        return {w: self.state[w] for w in workers if w in self.state}, self._matched(hashes, workers)

    def _matched(self, hashes, workers):
        matched, still = {w: 0 for w in workers}, set(workers)
        for i, h in enumerate(hashes):
            still &= self.blocks.get(h, set())
            for w in still:
                matched[w] = i + 1
        return {w: TierHits(n) for w, n in matched.items()}


PROMPT = list(range(100, 133))  # 33 tokens: 8 full blocks, all 8 cacheable


def config(policy: str = "slo", **overrides) -> RouterConfig:
    """Most tests pin remote prefill: no decode worker prefills a prompt just for being short."""
    return RouterConfig.from_mapping({"policy": policy, "local_prefill_max_tokens": 0, **overrides})


def route(router: Router, rid: str = "r", prompt=PROMPT, now: float = NOW, **kw):
    return router.route(RouteRequest(rid, prompt, max_tokens=8, **kw), now=now)


def test_cost_model_fits_the_reported_steps_exactly():
    model = StepTimeModel.fit(PREFILL_STEPS + DECODE_STEPS, 2048)
    assert model.prefill == pytest.approx((0.010, 0.001, 0.0), abs=1e-9)
    assert model.decode == pytest.approx((0.020, 0.005, 0.0001), abs=1e-9)
    assert model.prefill_seconds(33) == pytest.approx(0.043)
    assert model.queue_seconds(4096) == pytest.approx(2 * 0.010 + 4.096)
    assert model.transfer_seconds(5) == 0.0


def test_nonnegative_fit_pins_a_negative_coefficient_at_zero():
    assert fit_nonnegative([(1, 1)], [1.0]) is None
    coef = fit_nonnegative([(1, 0), (1, 1), (1, 2)], [3.0, 2.0, 1.0])  # falling times: slope would be -1
    assert coef == pytest.approx((2.0, 0.0))


def test_a_step_slowed_by_something_outside_the_model_does_not_bend_the_fit():
    """Measured on a 2-core machine: 888 decode steps of 1 to 4 sequences at 7-15 ms, and one
    of 613 ms (a pause). Least squares put every sequence at 7 ms and no fixed cost, so 16
    sequences were predicted at 111 ms a step (they took about 30); without the hiccup, the
    line through the others."""
    steps = tuple(StepSample(0, 0, n, 50 * n + 13 * k, 0.005 + 0.002 * n) for n in (1, 2, 3, 4) for k in range(20))
    hiccup = StepSample(0, 0, 4, 400, 0.613)
    assert StepTimeModel.fit(steps, 2048).decode == pytest.approx((0.005, 0.002, 0.0), abs=1e-9)
    bent = fit_nonnegative([(1.0, s.decodes, s.decode_context) for s in steps + (hiccup,)],
                           [s.seconds for s in steps + (hiccup,)])
    assert bent[0] + 16 * bent[1] + 1600 * bent[2] > 0.05  # the plain fit: 16 sequences over 50 ms a step
    assert StepTimeModel.fit(steps + (hiccup,), 2048).decode == pytest.approx((0.005, 0.002, 0.0), abs=1e-9)


def test_transfer_time_per_block_comes_from_measured_send_tails():
    steps = PREFILL_STEPS + (StepSample(32, 0, 0, 0, 0.5, kv_blocks_sent=8, transfer_tail_s=0.08),)
    assert StepTimeModel.fit(steps, 2048).transfer_seconds(3) == pytest.approx(0.03)


def test_prefix_affinity_goes_where_the_prompt_is_cached():
    registry = FakeRegistry()
    registry.hold("p1", PROMPT, 8)
    registry.hold("d1", PROMPT, 2)
    decision = route(Router(TOPOLOGY, registry, config("prefix_affinity")))
    assert (decision.action, decision.prefill, decision.decode) == ("place", "p1", "d1")
    assert (decision.prefill_hit_blocks, decision.decode_hit_blocks) == (8, 2)


def test_a_prompt_never_counts_its_last_token_as_cached():
    registry = FakeRegistry()
    prompt = PROMPT[:32]  # 8 full blocks, but only 7 can hit: the last token is always computed
    registry.hold("p0", prompt, 8)
    decision = route(Router(TOPOLOGY, registry, config("prefix_affinity")), prompt=prompt)
    assert (decision.prefill, decision.prefill_hit_blocks) == ("p0", 7)


def test_round_robin_rotates_both_sides():
    router = Router(TOPOLOGY, FakeRegistry(), config("round_robin"))
    placed = [route(router, f"r{i}") for i in range(4)]
    assert [(d.prefill, d.decode) for d in placed] == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


def test_least_loaded_avoids_the_queue_and_the_busy_decoder():
    registry = FakeRegistry({"p0": load("p0", queued=1000), "d0": load("d0", running=10, free=20, context=500)})
    decision = route(Router(TOPOLOGY, registry, config("least_loaded")))
    assert (decision.prefill, decision.decode) == ("p1", "d1")


def test_placements_not_yet_in_a_report_count_as_load():
    router = Router(TOPOLOGY, FakeRegistry(), config("least_loaded"))
    first, second = route(router, "a"), route(router, "b")
    assert (first.prefill, first.decode) == ("p0", "d0")
    assert (second.prefill, second.decode) == ("p1", "d1")
    router.finished("a")
    router.finished("b")
    assert router.inflight == {}


def test_slo_prediction_is_queue_plus_prefill_plus_transfer_and_the_decode_step():
    registry = FakeRegistry({"p0": load("p0", queued=200), "p1": load("p1", queued=300),
                             "d0": load("d0", running=3, context=600)})
    decision = route(Router(TOPOLOGY, registry, config()))
    assert (decision.prefill, decision.decode) == ("p0", "d1")
    assert decision.predicted_ttft_s == pytest.approx((0.010 + 0.200) + (0.010 + 0.033))
    assert decision.predicted_tpot_s == pytest.approx(0.020 + 0.005 * 1 + 0.0001 * 33)


def test_a_speculating_worker_predicts_tpot_from_its_measured_tokens_per_step():
    """Its decode steps checked 1.5 guesses and kept 1.2 per sequence: a step of one sequence
    has 2.5 rows and makes 2.2 tokens of it (the fit counts guess rows as rows)."""
    speculating = tuple(StepSample(0, 0, s, c, 0.020 + 0.005 * s * 2.5 + 0.0001 * c, guess_tokens=3 * s // 2,
                                   accepted_tokens=6 * s // 5) for s, c in ((10, 100), (20, 400), (40, 300)))
    registry = FakeRegistry({"d0": load("d0", running=3, context=600),
                             "d1": load("d1", steps=PREFILL_STEPS + speculating)})
    decision = route(Router(TOPOLOGY, registry, config()))
    assert decision.decode == "d1"
    assert decision.predicted_tpot_s == pytest.approx((0.020 + 0.005 * 2.5 + 0.0001 * 33) / 2.2)
    model = StepTimeModel.fit(speculating, 2048)
    assert (model.guesses_per_sequence, model.accepted_per_sequence) == pytest.approx((1.5, 1.2))
    assert model.decode_step_seconds(4, 0) == pytest.approx(0.020 + 0.005 * 10)  # the step itself, for waits


def test_slo_takes_the_cache_hit_when_it_still_meets_the_objectives():
    registry = FakeRegistry({"p1": load("p1", queued=500)})
    registry.hold("p1", PROMPT, 8)
    decision = route(Router(TOPOLOGY, registry, config()), slo_class="interactive")
    assert decision.prefill == "p1"
    assert decision.predicted_ttft_s == pytest.approx(0.510 + 0.011)


def test_slo_leaves_the_cache_hit_when_its_queue_would_miss_the_ttft():
    registry = FakeRegistry({"p1": load("p1", queued=1500)})
    registry.hold("p1", PROMPT, 8)
    decision = route(Router(TOPOLOGY, registry, config()), slo_class="interactive")  # TTFT <= 1 s
    assert decision.prefill == "p0"
    assert decision.prefill_hit_blocks == 0


def test_admission_rejects_at_once_with_the_reason():
    busy = {w: load(w, queued=3000) for w in ("p0", "p1")}  # two 2048-token steps each: 3.02 s
    router = Router(TOPOLOGY, FakeRegistry(busy), config())
    decision = route(router, slo_class="interactive")
    assert decision.action == "reject"
    assert "no (prefill, decode) pair can meet now slo_class 'interactive' (TTFT <= 1000 ms" in decision.reason
    assert "p0 -> d0, predicts TTFT 3063 ms (queue 3020 ms + prefill 43 ms + transfer 0 ms)" in decision.reason
    assert decision.reason.endswith("idle, TTFT 43 ms and TPOT 28 ms")
    assert router.inflight == {}
    assert router.status(NOW)["rejected"] == 1


def full_decode(next_slot_tokens: int = 4) -> dict[str, WorkerLoad]:
    """Both decode workers at max_num_seqs (16) sequences, the one closest to its end 4 steps away."""
    return {d: replace(load(d, running=16, updated_at=NOW), next_slot_tokens=next_slot_tokens) for d in ("d0", "d1")}


def test_a_queueable_class_waits_and_a_hopeless_prompt_runs_best_effort():
    router = Router(TOPOLOGY, FakeRegistry(full_decode()), config())
    assert route(router, slo_class="standard").action == "queue"
    long_prompt = list(range(6000))  # 6 s of prefill on an idle worker: no queue makes it meet 5 s
    decision = route(Router(TOPOLOGY, FakeRegistry(), config()), prompt=long_prompt, slo_class="standard")
    assert decision.action == "place"
    assert decision.reason.startswith("best effort: even an idle cluster cannot meet")


def test_a_decode_worker_caching_nearly_the_whole_prompt_prefills_it_itself():
    registry = FakeRegistry()
    registry.hold("d1", PROMPT, 8)
    router = Router(TOPOLOGY, registry, config())
    decision = route(router)
    assert (decision.prefill, decision.decode) == (None, "d1")
    assert decision.predicted_ttft_s == pytest.approx(0.010 + 0.001)  # one token left to compute
    assert router.status(NOW)["local_prefills"] == 1


def test_a_decode_worker_without_room_is_passed_over():
    registry = FakeRegistry({"d0": load("d0", free=2)})
    decision = route(Router(TOPOLOGY, registry, config("round_robin")))
    assert decision.decode == "d1"


def test_dead_and_failed_workers_are_not_candidates():
    registry = FakeRegistry()
    del registry.state["p0"]  # heartbeat expired: no load report
    router = Router(TOPOLOGY, registry, config("round_robin"))
    router.worker_failed("d0")
    assert [(d.prefill, d.decode) for d in (route(router, "a"), route(router, "b"))] == [("p1", "d1"), ("p1", "d1")]


def test_a_failed_worker_is_placed_on_again_once_another_incarnation_reports():
    """Found dead under a request, d0 stays out while its reports are those of the worker that
    died (or none: it is being started again); a report of another incarnation (the worker its
    deployment started in its place) brings it back, with no word from anyone else."""
    registry = FakeRegistry({w: replace(load(w), incarnation=f"{w}-a") for w in TOPOLOGY.prefill + TOPOLOGY.decode})
    router = Router(TOPOLOGY, registry, config("round_robin", load_refresh_s=0.1))
    assert {route(router, f"r{i}", now=NOW + i).decode for i in range(2)} == {"d0", "d1"}
    router.worker_failed("d0")
    assert [route(router, f"s{i}", now=NOW + 10 + i).decode for i in range(2)] == ["d1", "d1"]
    del registry.state["d0"]  # its heartbeat ran out
    assert [route(router, f"t{i}", now=NOW + 20 + i).decode for i in range(2)] == ["d1", "d1"]
    registry.state["d0"] = replace(load("d0"), incarnation="d0-b")  # started again under its name
    assert [route(router, f"u{i}", now=NOW + 30 + i).decode for i in range(2)] == ["d0", "d1"]
    assert router.status(NOW + 31)["failed_workers"] == []
    router.worker_failed("d1")  # a report without an incarnation is not another one
    registry.state["d1"] = replace(load("d1"), incarnation="")
    assert [route(router, f"v{i}", now=NOW + 40 + i).decode for i in range(2)] == ["d0", "d0"]


def test_a_worker_marked_lost_is_cut_from_placement_at_once_and_back_as_another_incarnation():
    """A lapsed report keeps a worker placed on for REPORT_GRACE_S; one its deployment marked
    lost (Ray found it dead) is out at the next read, and a report of the worker started again
    under its name brings it back."""
    registry = FakeRegistry({w: replace(load(w), incarnation=f"{w}-a") for w in TOPOLOGY.prefill + TOPOLOGY.decode})
    router = Router(TOPOLOGY, registry, config("round_robin", load_refresh_s=0.1))
    assert {route(router, f"r{i}", now=NOW + i).decode for i in range(2)} == {"d0", "d1"}
    registry.state["d0"] = replace(registry.state["d0"], lost=True)  # within the grace a lapsed one would have
    assert [route(router, f"s{i}", now=NOW + 2.2 + i).decode for i in range(2)] == ["d1", "d1"]
    assert router.status(NOW + 4)["failed_workers"] == ["d0"]
    assert router.status(NOW + 4)["live_workers"] == ["d1", "p0", "p1"]
    registry.state["d0"] = replace(load("d0"), incarnation="d0-b")  # started again under its name
    assert [route(router, f"u{i}", now=NOW + 5 + i).decode for i in range(2)] == ["d0", "d1"]
    assert router.status(NOW + 6)["failed_workers"] == []


def test_registry_down_places_by_load_only_then_recovers():
    registry = FakeRegistry()
    router = Router(TOPOLOGY, registry, config("slo", registry_retry_s=1.0))
    registry.down = True
    placed = [route(router, f"r{i}", now=NOW + i * 0.1) for i in range(3)]
    assert [(d.prefill, d.decode, d.load_only) for d in placed] == [
        ("p0", "d0", True), ("p1", "d1", True), ("p0", "d0", True)]
    status = router.status(NOW + 0.3)
    assert status["registry"].startswith("unreachable for 0.3s (connection refused); placing by load only")
    registry.down = False
    assert route(router, "soon", now=NOW + 0.5).load_only  # waits registry_retry_s before trying again
    back = route(router, "later", now=NOW + 1.2)
    assert not back.load_only
    assert router.status(NOW + 1.2)["registry"] == "ok"


def test_a_router_whose_owner_probes_the_registry_does_not_read_it_again_until_told():
    registry = FakeRegistry()
    router = Router(TOPOLOGY, registry, config("slo", registry_retry_s=1.0), probe_elsewhere=True)
    registry.down = True
    assert route(router, "r0", now=NOW).load_only and router.registry_down
    registry.down = False
    read, loads = [], registry.loads
    registry.loads = lambda workers: read.append(workers) or loads(workers)
    assert route(router, "r1", now=NOW + 5).load_only  # long past registry_retry_s: not read on the way
    assert read == []
    router.registry_answers()
    assert not route(router, "r2", now=NOW + 5.1).load_only and not router.registry_down


def test_config_errors_name_the_key():
    with pytest.raises(RouterConfigError, match=r"router.policy: unknown policy 'fastest'; known: round_robin"):
        RouterConfig.from_mapping({"policy": "fastest"})
    with pytest.raises(RouterConfigError, match=r"router.weights.cache: unknown scorer"):
        RouterConfig.from_mapping({"weights": {"cache": 1}})
    with pytest.raises(RouterConfigError, match=r"router.slo_classes.chat.on_overload: must be one of"):
        RouterConfig.from_mapping({"slo_classes": {"chat": {"ttft_ms": 500, "on_overload": "drop"}},
                                   "default_class": "chat"})
    with pytest.raises(RouterConfigError, match=r"router.default_class: unknown slo_class 'standard'"):
        RouterConfig.from_mapping({"slo_classes": {"chat": {"ttft_ms": 500}}})
    with pytest.raises(RouterConfigError, match=r"router.replicas: the router runs inside each ingress replica "
                                                r"\(one router each\), so server.replicas sets how many"):
        RouterConfig.from_mapping({"replicas": 2})
    config = RouterConfig.from_mapping({"policy": "slo", "weights": {"least_loaded": 2},
                                        "slo_classes": {"chat": {"ttft_ms": 500, "tpot_ms": 50}},
                                        "default_class": "chat"})
    assert config.weights["least_loaded"] == 2.0 and config.slo_class(None).ttft_s == 0.5


def test_the_ttft_the_model_leaves_out_is_learned_per_path_from_the_time_after_placement():
    router = Router(TOPOLOGY, FakeRegistry(), config("round_robin"))
    first = route(router, "a")
    assert first.predicted_ttft_s == pytest.approx(0.043) and first.ttft_correction_s == 0.0
    router.finished("a", service_ttft_s=0.243, now=NOW)  # 0.2 s more than predicted: a tenth of it is learned
    assert router.ttft_residual == pytest.approx({"remote": 0.02, "local": 0.0})
    second = route(router, "b")
    assert second.predicted_ttft_s == pytest.approx(0.043 + 0.02) and second.ttft_correction_s == pytest.approx(0.02)
    router.finished("b", service_ttft_s=0.063, now=NOW)  # as predicted with the correction: it holds
    assert router.ttft_residual["remote"] == pytest.approx(0.02)
    assert router.status(NOW)["ttft_prediction_error"] == pytest.approx((0.2 / 0.243 + 0.0) / 2)


def test_the_correction_is_bounded_and_decays():
    router = Router(TOPOLOGY, FakeRegistry(), config("round_robin", correction_limit_ms=100,
                                                     correction_half_life_s=10))
    for i in range(200):  # a burst whose requests took 37 s each after placement
        route(router, f"r{i}")
        router.finished(f"r{i}", service_ttft_s=37.0, now=NOW)
    assert router.correction("remote", NOW) == pytest.approx(0.1, rel=1e-6)  # never past the limit
    assert router.correction("remote", NOW + 10) == pytest.approx(0.05, rel=1e-6)  # one half-life later
    assert router.correction("remote", NOW + 100) < 0.0001
    assert route(router, "later", now=NOW + 10).ttft_correction_s == pytest.approx(0.05, rel=1e-6)


def test_an_idle_cluster_admits_an_interactive_request_after_a_burst():
    """The wedge of issue 11: after a burst, an idle cluster rejected interactive requests for ever."""
    router = Router(TOPOLOGY, FakeRegistry(), config())
    for i in range(400):
        route(router, f"burst{i}", slo_class="batch")
        router.finished(f"burst{i}", service_ttft_s=37.0, now=NOW)
    decision = route(router, "fresh", slo_class="interactive")
    assert decision.action == "place"
    assert decision.predicted_ttft_s == pytest.approx(0.043 + 0.5)  # prefill + the bounded correction


def test_an_objective_no_idle_pair_can_meet_is_known_at_once_from_the_same_prediction():
    router = Router(TOPOLOGY, FakeRegistry(), config())
    # TPOT: an idle decode step with this request alone is 20 + 5 + 3.3 ms; 1 ms can never be met.
    hopeless = route(router, "tpot", slo_class="standard", tpot_s=0.001)
    assert hopeless.action == "place"
    assert hopeless.reason.startswith("best effort: even an idle cluster cannot meet")
    assert "idle, TTFT 43 ms and TPOT 28 ms" in hopeless.reason
    assert route(router, "tpot-i", slo_class="interactive", tpot_s=0.001).action == "reject"
    # TTFT: with a learned correction of 0.1 s, an idle pair predicts 143 ms for a 33-token prompt.
    for objective, reason in ((0.120, "best effort: even an idle cluster cannot meet"), (0.150, "")):
        router = Router(TOPOLOGY, FakeRegistry(), config())
        router.finished("none")  # nothing was placed: nothing learned
        router._residual["remote"] = (0.1, NOW)
        decision = route(router, "ttft", slo_class="standard", ttft_s=objective)
        assert decision.action == "place" and decision.reason.startswith(reason)
        assert decision.predicted_ttft_s == pytest.approx(0.143)


def test_a_queued_request_no_idle_pair_serves_in_time_still_waits_no_longer_than_its_bound():
    """Every decode slot taken, the slot nearest 4 steps away. A ``standard`` request whose 1 ms
    TTFT no idle pair meets is placed best effort where there is room; with none, waiting for a
    slot, in the router or in a decode worker's queue (a local prefill), is bounded by its class
    as for any other: refused now when the wait is predicted past it, held when within it."""
    for local_prefill in (0, 64):  # waits in the router / would wait in the decode worker's queue
        router = Router(TOPOLOGY, FakeRegistry(full_decode()), config(local_prefill_max_tokens=local_prefill))
        refused = route(router, "tight", slo_class="standard", ttft_s=0.001)
        assert refused.action == "reject"
        assert refused.reason.startswith("predicted to wait 400 ms more for a decode slot (after 0 ms), past its "
                                         "bound of 1 ms; even an idle cluster cannot meet")
        assert refused.retry_after_s == pytest.approx(4 * (0.020 + 16 * 0.005))  # 4 steps of the 16-sequence batch
        patient = Router(TOPOLOGY, FakeRegistry(full_decode()), config(
            local_prefill_max_tokens=local_prefill, slo_classes={"standard": {"max_wait_ms": 1000}}))
        held = route(patient, "tight", slo_class="standard", ttft_s=0.001)
        assert (held.action, held.decode) == (("queue", None) if local_prefill == 0 else ("place", "d0"))


def test_a_class_that_may_not_wait_counts_the_time_it_already_spent():
    router = Router(TOPOLOGY, FakeRegistry(), config())
    on_time = route(router, "a", slo_class="interactive", arrival=NOW - 0.9)  # 0.9 + 0.043 <= 1 s
    assert on_time.action == "place" and on_time.waited_s == pytest.approx(0.9)
    late = route(router, "b", slo_class="interactive", arrival=NOW - 0.98)  # 0.98 + 0.043 > 1 s
    assert late.action == "reject"
    assert "even an idle cluster cannot meet" in late.reason and "predicts TTFT waited 980 ms + 43 ms" in late.reason


def test_a_waiting_head_never_holds_back_a_request_that_can_be_placed():
    tight = {d: replace(load(d, running=2, free=12), next_slot_tokens=4) for d in ("d0", "d1")}  # 12 free blocks each
    registry = FakeRegistry(tight)
    router = Router(TOPOLOGY, registry, config())
    head = router.submit(RouteRequest("head", list(range(300)), 8, "standard", priority=5), now=NOW)
    assert head.action == "queue"  # its 77 blocks fit on no decode worker now
    behind = router.submit(RouteRequest("short", PROMPT, 8, "standard"), now=NOW)
    assert behind.action == "place"  # 11 blocks: placed at once, past the waiting head
    assert router.retry_waiting(NOW + 0.01) == []  # nothing changed: it keeps waiting
    assert router.status(NOW)["waiting"] == 1
    registry.state.update({w: load(w, updated_at=NOW + 0.05) for w in ("d0", "d1")})  # blocks freed
    placed = router.retry_waiting(NOW + 0.1)
    assert [(d.request_id, d.action) for d in placed] == [("head", "place")]
    assert router.status(NOW + 0.1)["waiting"] == 0


def test_waiting_requests_are_offered_in_priority_order_each_on_its_own():
    registry = FakeRegistry(full_decode())
    router = Router(TOPOLOGY, registry, config("slo"))
    for rid, priority, arrival in (("low", 0, NOW - 2), ("high", 3, NOW - 1), ("mid", 1, NOW - 3)):
        assert router.submit(RouteRequest(rid, PROMPT, 8, "standard", priority=priority, arrival=arrival),
                             now=NOW).action == "queue"
    assert router.cancel("mid") and not router.cancel("mid")
    registry.state.update({w: load(w, updated_at=NOW + 0.05) for w in ("d0", "d1")})
    assert [d.request_id for d in router.retry_waiting(NOW + 0.1)] == ["high", "low"]


def test_a_full_queue_rejects_instead_of_holding():
    router = Router(TOPOLOGY, FakeRegistry(full_decode()), config(queue_limit=1))
    assert router.submit(RouteRequest("a", PROMPT, 8, "standard"), now=NOW).action == "queue"
    second = router.submit(RouteRequest("b", PROMPT, 8, "standard"), now=NOW)
    assert second.action == "reject"
    assert second.reason.startswith("the router already holds 1 waiting requests (router.queue_limit)")
    assert second.retry_after_s == pytest.approx(0.4)  # behind "a": the first sequence to end, 4 steps of 100 ms


def test_before_the_first_reports_requests_wait_and_then_face_admission():
    registry = FakeRegistry()
    reports = dict(registry.state)
    registry.state.clear()  # the workers are still starting: nothing reported yet
    router = Router(TOPOLOGY, registry, config())
    impossible = router.submit(RouteRequest("x", PROMPT, 8, "interactive", ttft_s=0.000001), now=NOW)
    fine = router.submit(RouteRequest("y", PROMPT, 8, "interactive"), now=NOW)
    assert (impossible.action, fine.action) == ("queue", "queue")
    assert impossible.reason == "waiting for the first load report of d0"
    registry.state.update(reports)
    resolved = {d.request_id: d.action for d in router.retry_waiting(NOW + 0.1)}
    assert resolved == {"x": "reject", "y": "place"}
    registry.state.clear()  # every worker reported once, and none has for a while now
    lapsed = router.submit(RouteRequest("z", PROMPT, 8, "standard"), now=NOW + 5)  # slow to report, not dead
    assert lapsed.action == "place"
    gone = router.submit(RouteRequest("z2", PROMPT, 8, "standard"), now=NOW + 11)  # past REPORT_GRACE_S: gone
    assert (gone.action, gone.reason) == ("reject", "no live decode worker")
    registry.state.update({w: reports[w] for w in ("d0", "d1")})  # decode workers back, prefill workers gone
    remote = router.submit(RouteRequest("r", PROMPT, 8, "standard"), now=NOW + 11.1)
    assert (remote.action, remote.reason) == ("reject", "no live prefill worker")


def test_a_pair_being_rebuilt_or_failed_under_the_request_is_placed_around():
    """A decode worker reports the prefill workers whose transfer group it is rebuilding
    (``unpaired``), and a retried request names the pairs that failed under it (``avoid``):
    neither pair is a candidate; a decode worker cut off from every prefill worker prefills
    the prompt itself rather than being left out."""
    registry = FakeRegistry({"d0": replace(load("d0"), unpaired=("p0",))})
    router = Router(TOPOLOGY, registry, config("round_robin"))
    pairs = {(d.prefill, d.decode) for d in (route(router, f"r{i}") for i in range(8))}
    assert pairs == {("p1", "d0"), ("p0", "d1"), ("p1", "d1")}
    avoided = route(Router(TOPOLOGY, registry, config()), "a", avoid=(("p1", "d0"), ("p0", "d1"), ("p1", "d1")))
    assert (avoided.prefill, avoided.decode) == (None, "d0")  # d0 takes KV from neither: it prefills itself
    assert avoided.predicted_ttft_s == pytest.approx(0.010 + 0.033)
    registry.state["d0"] = load("d0")  # the pair is back: the router's next read of the reports shows it
    back = route(Router(TOPOLOGY, registry, config()), "b", avoid=(("p1", "d0"), ("p1", "d1")))
    assert back.prefill == "p0"


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_worker():
    """Up to local_prefill_max_tokens left to compute, a decode worker may prefill the prompt
    itself; the slo policy then takes whichever meets the objectives with the most headroom."""
    registry = FakeRegistry()
    router = Router(TOPOLOGY, registry, config(local_prefill_max_tokens=64))
    short = route(router, "short")  # 33 tokens: no queue, no transfer on the decode worker
    assert (short.prefill, short.decode) == (None, "d0")
    assert short.predicted_ttft_s == pytest.approx(0.010 + 0.033)
    long = route(router, "long", prompt=list(range(100)))  # 100 tokens left: only a prefill worker may
    assert long.prefill is not None
    busy = FakeRegistry({d: load(d, queued=2000) for d in ("d0", "d1")})  # the decode workers' prefill queues
    remote = route(Router(TOPOLOGY, busy, config(local_prefill_max_tokens=64)), "busy")
    assert remote.prefill is not None  # 2 s of queue there: a prefill worker has more headroom


def test_a_colocated_pool_prefills_and_decodes_on_one_worker():
    topology = Topology(prefill=(), decode=(), colocated=("c0", "c1"), block_size=BS, hash_keys=("m",))
    registry = FakeRegistry()
    registry.state.update({c: replace(load("d0"), worker=c, role="colocated") for c in ("c0", "c1")})
    router = Router(topology, registry, config("round_robin"))
    placed = [route(router, f"r{i}", prompt=list(range(300))) for i in range(3)]
    assert [(d.prefill, d.decode) for d in placed] == [(None, "c0"), (None, "c1"), (None, "c0")]


def test_a_request_never_refused_waits_in_the_router_for_room_it_would_not_find_at_a_worker():
    """Placed without room, a remote prefill fails at the decode worker (its blocks are reserved
    up front): a best-effort request waits in the router until a slot frees instead."""
    registry = FakeRegistry(full_decode())
    router = Router(TOPOLOGY, registry, config(slo_classes={
        "batch": {"ttft_ms": None, "tpot_ms": None, "on_overload": "admit"},
        "admit_chat": {"ttft_ms": 1000, "tpot_ms": 200, "on_overload": "admit"}}, default_class="batch"))
    for slo_class in ("batch", "admit_chat"):
        decision = router.route(RouteRequest(f"{slo_class}-1", PROMPT, 8, slo_class), NOW)
        assert decision.action == "queue" and decision.reason.startswith("no decode worker has a free slot")
    assert router.submit(RouteRequest("admit-held", PROMPT, 8, "admit_chat"), now=NOW).action == "queue"
    assert router.retry_waiting(NOW + 60) == []  # an admit class has no wait bound: held, never refused
    registry.state["d1"] = replace(registry.state["d1"], running=15, updated_at=NOW + 61)
    (placed,) = router.retry_waiting(NOW + 61)
    assert (placed.action, placed.request_id, placed.decode) == ("place", "admit-held", "d1")


def test_a_long_queue_is_offered_again_only_on_change_and_pruned_by_what_must_wait():
    registry = FakeRegistry(full_decode())
    router = Router(TOPOLOGY, registry, config())
    for i in range(100):
        assert router.submit(RouteRequest(f"long{i}", list(range(40)), 8, "standard"), now=NOW).action == "queue"
    assert router.submit(RouteRequest("short", PROMPT, 8, "standard"), now=NOW).action == "queue"
    routed = []
    original = router.route
    router.route = lambda request, now=None, hits=None, ahead=None: (routed.append(request.request_id)
                                                                     or original(request, now, hits, ahead))
    assert router.retry_waiting(NOW + 0.1) == []
    assert routed == ["long0", "short"]  # the 99 longer ones behind long0 would wait too: not routed
    assert router.retry_waiting(NOW + 0.2) == [] and len(routed) == 2  # nothing changed: nothing offered
    router.finished("unknown")  # not a request of this router's: no change
    assert router.retry_waiting(NOW + 0.3) == [] and len(routed) == 2
    # (One that no worker could ever hold is placed best effort at once: it waits for nothing.)
    assert original(RouteRequest("bulk", PROMPT, 10**6, "batch"), NOW).action == "place"
    router.finished("bulk")  # a finished request is a change
    router.retry_waiting(NOW + 0.4)
    assert len(routed) == 4


def test_a_decode_worker_without_a_free_slot_makes_requests_wait_in_the_router():
    """max_num_seqs 8, all taken: a 9th sequence would wait inside the worker for one to finish.
    A standard request waits in the router; an interactive one may take the first place in the
    worker's line (the wait is known: 4 more steps of the sequence closest to its end), a second
    one may not; batch requests (no objectives) prefilled on their decode worker are placed and queue in the worker."""
    full = {d: replace(load(d, running=8), max_num_seqs=8, next_slot_tokens=4) for d in ("d0", "d1")}
    router = Router(TOPOLOGY, FakeRegistry(full), config())
    assert route(router, "s", slo_class="standard").action == "queue"
    first = route(router, "i1", slo_class="interactive")
    step = 0.020 + 0.005 * 9 + 0.0001 * 33  # a decode step with this request in the batch
    assert (first.action, first.decode) == ("place", "d0")
    assert first.predicted_ttft_s == pytest.approx(4 * step)  # the slot frees later than the KV lands
    second = route(router, "i2", slo_class="interactive")
    assert (second.action, second.decode) == ("place", "d1")
    third = route(router, "i3", slo_class="interactive")
    assert third.action == "reject"
    assert "no decode worker has a free slot and KV blocks now for slo_class 'interactive'" in third.reason
    # A batch request prefilled remotely waits in the router: its blocks could not be reserved
    # on a full worker; one the decode worker prefills itself queues in the worker.
    assert route(router, "b", slo_class="batch").action == "queue"
    local = Router(TOPOLOGY, FakeRegistry(full), config(local_prefill_max_tokens=64))
    assert (route(local, "b", slo_class="batch").action, route(local, "b2", slo_class="batch").prefill) == ("place",
                                                                                                         None)


def test_a_phase_without_fresh_samples_keeps_its_last_fit():
    """After a run of decode steps a decode worker's report holds no prefill step: its local
    prefill keeps the last fit instead of being predicted as free."""
    registry = FakeRegistry()
    router = Router(TOPOLOGY, registry, config(local_prefill_max_tokens=64))
    assert route(router, "a").predicted_ttft_s == pytest.approx(0.043)  # local prefill on d0
    registry.state["d0"] = load("d0", steps=DECODE_STEPS, updated_at=NOW + 0.1)
    registry.state["d1"] = load("d1", steps=DECODE_STEPS, updated_at=NOW + 0.1)
    decision = route(router, "b", now=NOW + 0.2)
    assert decision.prefill is None and decision.predicted_ttft_s == pytest.approx(0.043)


def test_a_negative_correction_never_predicts_a_request_as_free():
    router = Router(TOPOLOGY, FakeRegistry(), config("round_robin", correction_limit_ms=500))
    route(router, "a")
    router.finished("a", service_ttft_s=0.001, now=NOW)  # much faster than the 43 ms predicted
    for i in range(100):
        route(router, f"r{i}")
        router.finished(f"r{i}", service_ttft_s=0.001, now=NOW)
    assert router.correction("remote", NOW) < -0.03
    decision = route(router, "b")
    assert decision.predicted_ttft_s == pytest.approx(0.043 / 2)  # at most half the prediction taken off
    fresh = Router(TOPOLOGY, FakeRegistry(), config())
    fresh._residual["remote"] = (-0.5, NOW)
    assert route(fresh, "x", slo_class="interactive", ttft_s=0.000001).action == "reject"


def test_a_request_forgotten_before_it_arrives_is_never_placed():
    """An asyncio actor may run a caller's forget before the place it sent first."""
    router = Router(TOPOLOGY, FakeRegistry(), config())
    assert router.forget("early") is None
    late = router.submit(RouteRequest("early", PROMPT, 8, "standard"), now=NOW)
    assert (late.action, late.reason) == ("reject", "its caller went away before it was placed")
    assert router.inflight == {}
    assert router.submit(RouteRequest("early", PROMPT, 8, "standard"), now=NOW).action == "place"  # remembered once
    busy = Router(TOPOLOGY, FakeRegistry(full_decode()), config())
    assert busy.submit(RouteRequest("w", PROMPT, 8, "standard"), now=NOW).action == "queue"
    busy.forget("w")  # a waiting request forgotten leaves the queue
    assert len(busy.waiting) == 0 and "w" not in busy._gone


def test_a_large_prefill_pool_is_cut_to_the_workers_soonest_done_before_pairing():
    from router.router import _soonest_prefill

    # (model, cached blocks, queue s, prefill s) per worker, as _candidates computes them
    side = {"p0": (None, TierHits(0), 0.300, 0.043), "p1": (None, TierHits(0), 0.000, 0.043),
            "p2": (None, TierHits(8), 0.000, 0.011),
            "p3": (None, TierHits(0), 0.200, 0.043), "p4": (None, TierHits(2), 0.000, 0.043)}
    pool = ["p0", "p1", "p2", "p3", "p4"]
    assert _soonest_prefill(pool, side, 5) == pool
    assert _soonest_prefill(pool, side, 2) == ["p2", "p4"]  # p2 sooner; p4 ties p1 on time, caches more
    assert _soonest_prefill(pool, side, 3) == ["p1", "p2", "p4"]
    assert _soonest_prefill(pool, side, 2, turn="p0") == ["p0", "p2", "p4"]  # the rotation's turn stays


def test_the_shortlist_keeps_placements_and_the_round_robin_rotation():
    topology = Topology(prefill=("p0", "p1", "p2", "p3"), decode=("d0", "d1"), block_size=BS, hash_keys=("m",))
    state = {w: load(w) for w in topology.prefill + topology.decode}
    state.update(p0=load("p0", queued=300), p1=load("p1", queued=200))
    registry = FakeRegistry(state)
    registry.hold("p3", PROMPT, 8)
    short = route(Router(topology, registry, config(prefill_shortlist=2)))
    full = route(Router(topology, registry, config(prefill_shortlist=4)))
    assert (short.prefill, short.decode, short.predicted_ttft_s) == (full.prefill, full.decode, full.predicted_ttft_s)
    assert short.prefill == "p3"
    rotating = Router(topology, registry, config("round_robin", prefill_shortlist=1))
    assert [route(rotating, f"r{i}").prefill for i in range(4)] == ["p0", "p1", "p2", "p3"]
    with pytest.raises(RouterConfigError, match="router.prefill_shortlist"):
        config(prefill_shortlist=0)


def test_a_dead_worker_its_deployment_restarts_is_waited_for_within_the_class_bound():
    """With ``ray.restart_workers`` the router holds a request that finds no live decode worker
    while the dead one is expected back (``RESTART_WAIT_S``): placed on its new incarnation,
    refused at its class's wait bound, and without restarts refused at once as before."""
    from router.router import RESTART_WAIT_S

    registry = FakeRegistry()
    registry.state.update({w: replace(l, incarnation="first") for w, l in registry.state.items()})
    reports = dict(registry.state)
    router = Router(replace(TOPOLOGY, restarts_workers=True), registry, config())
    assert router.submit(RouteRequest("a", PROMPT, 8, "standard"), now=NOW).action == "place"
    router.finished("a", now=NOW)
    for d in ("d0", "d1"):
        router.worker_failed(d, now=NOW + 1)
        del registry.state[d]
    held = router.submit(RouteRequest("b", PROMPT, 8, "standard", arrival=NOW + 1), now=NOW + 1)
    assert (held.action, held.reason) == ("queue", "waiting for d0 to start again")
    registry.state["d1"] = replace(reports["d1"], incarnation="second", updated_at=NOW + 2)  # d1 is back
    resolved = router.retry_waiting(NOW + 3)
    assert [(d.request_id, d.action, d.decode) for d in resolved] == [("b", "place", "d1")]
    assert router.failed == {"d0"}
    del registry.state["d1"]
    router.worker_failed("d1", now=NOW + 4)
    late = router.submit(RouteRequest("c", PROMPT, 8, "standard", arrival=NOW + 4), now=NOW + 4)
    assert late.action == "queue"
    bound = router.config.slo_class("standard").wait_bound_s
    refused = router.retry_waiting(NOW + 4 + bound + 0.5)
    assert [(d.request_id, d.action) for d in refused] == [("c", "reject")]
    gone = router.submit(RouteRequest("e", PROMPT, 8, "standard"), now=NOW + 4 + RESTART_WAIT_S)
    assert (gone.action, gone.reason) == ("reject", "no live decode worker")
    # Only a worker gone is waited for: a live one (whatever it lacks, a pair say) is not coming back.
    registry.state.update({"p0": replace(reports["p0"], updated_at=NOW + 40)})
    router.worker_failed("d0", now=NOW + 39)
    router.retry_waiting(NOW + 40)
    assert (router._restarting("p0", NOW + 40), router._restarting("d0", NOW + 40)) == (False, True)
    plain = Router(TOPOLOGY, FakeRegistry(), config())
    plain.submit(RouteRequest("f", PROMPT, 8, "standard"), now=NOW)
    plain.registry.state.clear()
    for d in ("d0", "d1"):
        plain.worker_failed(d, now=NOW + 1)
    assert plain.submit(RouteRequest("g", PROMPT, 8, "standard"), now=NOW + 1).reason == "no live decode worker"


# A prefill worker 2 ms faster a prompt than the decode workers: 8 ms + 1 ms per token.
FASTER_PREFILL = tuple(StepSample(n, 0, 0, 0, 0.008 + 0.001 * n) for n in (16, 64, 256))


def test_a_short_prompt_on_an_idle_cluster_is_prefilled_where_its_first_token_comes_sooner():
    """A remote prefill adds the decode worker's measured call to the prefill worker: 2 ms of
    faster prefill there does not pay for a 4 ms hop, so the decode worker prefills the prompt
    itself (43 ms against 41 + 4); without the hop to count, the prefill worker is sooner."""
    prefill = {p: load(p, steps=FASTER_PREFILL) for p in TOPOLOGY.prefill}
    hop = {d: replace(load(d), prefill_call_s=0.004) for d in TOPOLOGY.decode}
    local = route(Router(TOPOLOGY, FakeRegistry({**prefill, **hop}), RouterConfig()))
    assert (local.prefill, local.decode, local.predicted_ttft_s) == (None, "d0", pytest.approx(0.010 + 0.033))
    remote = route(Router(TOPOLOGY, FakeRegistry(prefill), RouterConfig()))
    assert (remote.prefill, remote.predicted_ttft_s) == ("p0", pytest.approx(0.008 + 0.033))
    forced = route(Router(TOPOLOGY, FakeRegistry({**prefill, **hop}), config()))  # local_prefill_max_tokens 0
    assert (forced.prefill, forced.predicted_ttft_s) == ("p0", pytest.approx(0.008 + 0.033 + 0.004))


def test_a_report_from_before_a_request_ended_does_not_count_it():
    """One stream: the next request comes a few ms after the last ended, and the decode worker's
    latest report (every 0.1 s) still shows it running. What ended since the report, as this
    router was told, is taken off: no step in progress to wait for, and a batch of none."""
    topology = Topology(prefill=("p0",), decode=("d0",), block_size=BS, hash_keys=("m",))
    step = 0.020 + 0.005 * 2 + 0.0001 * (41 + 33)  # the report's sequence of 33 + 8 tokens, and this one
    registry = FakeRegistry({"d0": load("d0", running=1, context=41, updated_at=NOW - 0.05)})
    router = Router(topology, registry, config())
    assert route(router, "a", now=NOW - 0.1).action == "place"  # placed before the report: it counts it
    router.finished("a", output_tokens=8, now=NOW - 0.02)
    after = route(router, "b")
    assert after.predicted_ttft_s == pytest.approx(0.043)  # prefill only: the report's running one ended
    router.finished("b", output_tokens=8, now=NOW + 0.01)  # placed after the report: it never counted it
    busy = Router(topology, registry, config())
    assert route(busy, "c").predicted_ttft_s == pytest.approx(0.043 + step)  # nothing ended: it still runs
    busy.finished("c", output_tokens=8, now=NOW + 0.01)
    assert route(busy, "d", now=NOW + 0.06).predicted_ttft_s == pytest.approx(0.043 + step)
    busy.finished("d", output_tokens=8, now=NOW + 0.065)
    registry.state["d0"] = load("d0", updated_at=NOW + 0.07)  # the next report shows it ended
    assert route(busy, "e", now=NOW + 0.12).predicted_ttft_s == pytest.approx(0.043)
    assert busy._ended == {}  # what the reports show ended is forgotten


def test_a_placement_its_worker_had_not_taken_when_it_reported_still_takes_a_slot():
    """The decode worker has one free slot (15 of 16 running). Its next report is written after
    ``a`` was placed there but before ``a`` reached it: the report names the requests it took
    lately, and not ``a``, so ``a`` still counts, and ``b`` waits for a slot rather than being
    placed into a full worker. A report that names ``a`` counts it as it counts the rest."""
    topology = Topology(prefill=("p0",), decode=("d0",), block_size=BS, hash_keys=("m",))
    one_slot = replace(load("d0", running=15, updated_at=NOW - 0.3), next_slot_tokens=4, arrived=frozenset())
    registry = FakeRegistry({"d0": one_slot})
    router = Router(topology, registry, config())
    assert route(router, "a", now=NOW - 0.2).action == "place"
    registry.state["d0"] = replace(one_slot, updated_at=NOW - 0.1)  # written before a arrived
    held = route(router, "b", now=NOW)
    assert held.action == "queue" and held.reason.startswith("no decode worker has a free slot")
    assert [p.decision.request_id for p in router._pending(registry.state, ["d0"])["d0"]] == ["a"]
    registry.state["d0"] = replace(one_slot, running=16, updated_at=NOW + 0.05, arrived=frozenset({"a"}))
    assert router._pending(registry.state, ["d0"])["d0"] == []
    assert route(router, "c", now=NOW + 0.1).action == "queue"
    # The same report from a worker that does not name what it took: a counts as in it, b is placed.
    registry.state["d0"] = replace(one_slot, updated_at=NOW - 0.1, arrived=None)
    earlier = Router(topology, registry, config())
    assert route(earlier, "a", now=NOW - 0.2).action == "place"
    assert route(earlier, "b", now=NOW).action == "place"


def test_a_report_from_before_a_burst_ended_does_not_fill_the_idle_worker():
    """A burst's requests were running, receiving and waiting on the decode worker when it last
    reported (18 sequences, 16 the most it takes); all have ended since, as this router was told.
    The next request is placed on the idle worker, with the blocks they held free again, not
    refused for want of a decode slot (what a drill saw right after a burst of 93 streams)."""
    topology = Topology(prefill=("p0",), decode=("d0",), block_size=BS, hash_keys=("m",))
    registry = FakeRegistry({"d0": load("d0", updated_at=NOW - 0.3)})
    router = Router(topology, registry, config(local_prefill_max_tokens=64))  # a full worker's line: its own
    burst = [route(router, f"b{i}", prompt=[7, i] + PROMPT[2:], now=NOW - 0.2, slo_class="batch") for i in range(18)]
    assert all(d.action == "place" for d in burst)
    context = 18 * (len(PROMPT) + 8)
    registry.state["d0"] = replace(load("d0", running=2, free=100 - 18 * 3, context=2 * (len(PROMPT) + 8),
                                        updated_at=NOW - 0.05), receiving=7, waiting=9)
    for i in range(18):
        router.finished(f"b{i}", output_tokens=8, now=NOW - 0.03)
    netted = router._net_of_ended(dict(registry.state))["d0"]
    assert (netted.running, netted.receiving, netted.waiting, netted.free_blocks) == (0, 0, 0, 100)
    assert context and netted.decode_context_tokens == 0
    decision = route(router, "next", slo_class="standard")
    assert (decision.action, decision.decode) == ("place", "d0")
    assert decision.predicted_ttft_s == pytest.approx(0.043)  # an idle worker: the prompt's prefill alone


def test_an_unrefreshed_correction_decays_towards_the_other_paths():
    """What the step-time model leaves out is mostly shared by both paths (the API, the stream):
    a path not used since the other was refreshed tends to the other's correction, not to 0,
    so it does not look sooner for lacking it."""
    router = Router(TOPOLOGY, FakeRegistry(), config("round_robin", correction_half_life_s=10))
    route(router, "a")
    router.finished("a", service_ttft_s=0.243, now=NOW)  # remote: 0.2 s over its prediction, a tenth learned
    assert router.correction("local", NOW) == pytest.approx(0.02)  # never learned: the remote path's
    assert router.correction("local", NOW + 10) == pytest.approx(0.01)  # ... as it decays
    local = Router(TOPOLOGY, FakeRegistry(), config(correction_half_life_s=10, local_prefill_max_tokens=64))
    assert route(local, "r", prompt=list(range(100))).prefill == "p0"  # 100 tokens: too long to prefill locally
    local.finished("r", service_ttft_s=0.110 + 0.1, now=NOW)  # remote from 0 to 0.01
    assert local.correction("local", NOW) == pytest.approx(0.01)
    short = route(local, "s", now=NOW + 10)
    assert (short.prefill, short.ttft_correction_s) == (None, pytest.approx(0.005))
    local.finished("s", service_ttft_s=0.043 + 0.105, now=NOW + 10)  # local: 0.005 + (0.105 - 0.005) / 10
    assert local.correction("local", NOW + 10) == pytest.approx(0.015)
    assert local.correction("remote", NOW + 10) == pytest.approx(0.015 + (0.01 - 0.015) * 0.5)  # towards it
    assert local.correction("local", NOW + 20) == pytest.approx(0.0075)  # the fresher one: towards 0


def test_a_placement_reads_the_reports_and_the_prefix_hits_in_one_round_trip():
    registry = FakeRegistry()
    registry.hold("p1", PROMPT, 8)
    router = Router(TOPOLOGY, registry, config("prefix_affinity"))
    assert (route(router, "a").prefill, registry.calls) == ("p1", ["loads_and_prefix_tiers"])
    assert route(router, "b", now=NOW + 0.01).prefill == "p1"  # the reports are fresh: the hits alone
    assert registry.calls == ["loads_and_prefix_tiers", "prefix_tiers"]
    registry.state.pop("p0")  # a worker that never reported: its hits are not placed by
    fresh = Router(TOPOLOGY, registry, config("prefix_affinity"))
    assert route(fresh, "c").prefill == "p1"
    assert registry.calls[-1] == "loads_and_prefix_tiers" and set(fresh._last_hits) == {"p1", "d0", "d1"}


def test_a_prompt_its_decode_worker_may_prefill_stays_there_when_the_prefill_worker_shares_its_cores():
    """Decode workers whose prefill queues make a prefill worker the sooner path (2 s queued)
    keep a short prompt all the same when every prefill worker takes turns with them on the same
    CPU cores (2 + 2 threads on cores 0-1 of one node); a prompt too long to prefill locally
    still goes to a prefill worker, and workers on cores of their own, or on another node, are
    paired as before."""
    def on(worker: str, cpus: str, node: str = "n1", **kw) -> WorkerLoad:
        return replace(load(worker, **kw), node_id=node, cpus=cpus, threads=2)

    def registry(prefill_cpus: str, node: str = "n1") -> FakeRegistry:
        return FakeRegistry({**{p: on(p, prefill_cpus, node) for p in ("p0", "p1")},
                             **{d: on(d, "0-1", queued=2000) for d in ("d0", "d1")}})

    shared = Router(TOPOLOGY, registry("0-1"), config(local_prefill_max_tokens=64))
    short = route(shared, "short")
    assert (short.prefill, short.decode) == (None, "d0")
    assert short.predicted_ttft_s == pytest.approx(0.010 + 2.000 + 0.010 + 0.033)  # its queue (one chunk), then it
    assert route(shared, "long", prompt=list(range(100))).prefill == "p0"  # 100 tokens left: too many locally
    for apart in (registry("2-3"), registry("0-1", node="n2")):
        assert route(Router(TOPOLOGY, apart, config(local_prefill_max_tokens=64)), "short").prefill == "p0"


def test_a_deferred_refit_places_on_the_last_model_and_refits_after():
    """``defer_refits`` (the ingress's router): a report whose steps changed is placed on the
    model fitted before, exactly, and ``refit_deferred`` then fits the new steps; a worker with
    no model yet is fitted at once, and without deferral every placement refits first."""
    registry = FakeRegistry()
    router = Router(TOPOLOGY, registry, config(local_prefill_max_tokens=64), defer_refits=True)
    assert route(router, "a").predicted_ttft_s == pytest.approx(0.010 + 0.033)  # fitted at once: no model yet
    assert not router.refits_due
    slower = tuple(StepSample(n, 0, 0, 0, 0.020 + 0.002 * n) for n in (16, 64, 256))  # 20 ms + 2 ms a token
    for w in ("p0", "p1", "d0", "d1"):
        registry.state[w] = load(w, steps=slower + (DECODE_STEPS if w.startswith("d") else ()), updated_at=NOW + 0.5)
    assert route(router, "b", now=NOW + 1).predicted_ttft_s == pytest.approx(0.010 + 0.033)  # the models before
    assert router.refits_due
    router.refit_deferred()
    assert not router.refits_due
    assert route(router, "c", now=NOW + 1).predicted_ttft_s == pytest.approx(0.020 + 0.066)  # the new steps
    at_once = Router(TOPOLOGY, FakeRegistry(), config(local_prefill_max_tokens=64))
    route(at_once, "a")
    at_once.registry.state.update(registry.state)
    assert route(at_once, "b", now=NOW + 1).predicted_ttft_s == pytest.approx(0.020 + 0.066)
    assert not at_once.refits_due
