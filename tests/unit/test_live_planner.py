"""The live planner's choices: which split it proposes for the traffic seen (simulated with the
router's own code), which it prefers, and when the hysteresis lets it act."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.bench.arrivals import Arrivals
from cluster.bench.metrics import Objectives, RequestResult, summarize
from cluster.bench.workloads import Length, synthetic
from cluster.plan.live.hysteresis import Hysteresis
from cluster.plan.live.observe import Observation
from cluster.plan.live.propose import (DECISION_SEEDS, LENGTH_SPREAD, Bounds, Prediction, Proposal, Split, chosen,
                                       predict, predict_settled, propose, simulated_requests, steady, step_fit,
                                       with_classes)
from cluster.plan.simulator import Pools, SimConfig, WorkerSpec, simulate
from cluster.topology.spec import PlannerSpec
from router.config import RouterConfig
from router.cost_model import StepTimeModel

pytestmark = pytest.mark.unit

# prefill: 5 ms + 0.5 ms a token; decode: 10 ms + 12 ms a sequence
WORKER = WorkerSpec(StepTimeModel(prefill=(0.005, 0.0005, 0.0), decode=(0.010, 0.012, 0.0), transfer_s_per_block=0.0,
                                  max_num_batched_tokens=512), 2000, max_num_seqs=32)
OBJECTIVES = {c.name: Objectives(c.ttft_s, c.tpot_s) for c in RouterConfig().slo_classes}
P1D1, P1D2, P2D1 = Split(1, 1), Split(1, 2), Split(2, 1)


def traffic(rate: float, prompt: float, output: float) -> Observation:
    return Observation(0.0, 60.0, 100, rate, 0.0, 0.0, prompt, output)


def test_bounds_fill_their_nulls_from_the_workers_the_topology_starts_with():
    assert Bounds.of(PlannerSpec(), 3) == Bounds(1, 2, 1, 2, 3)
    assert Bounds.of(PlannerSpec(), 3).splits() == [P1D1, P1D2, P2D1]
    assert Bounds.of(PlannerSpec(max_workers=4, decode_max=2), 3).splits() == [
        P1D1, P1D2, P2D1, Split(2, 2), Split(3, 1)]
    assert Bounds.of(PlannerSpec(min_workers=3), 3).splits() == [P1D2, P2D1]  # moves only


def test_the_split_that_meets_the_objectives_with_fewest_workers_is_chosen():
    meets, misses = Prediction(2.0, 0.95), Prediction(3.0, 0.80)
    assert chosen({P1D1: meets, P1D2: Prediction(2.5, 0.99), P2D1: misses}) == P1D1  # fewest that meet
    assert chosen({P1D1: Prediction(1.0, 0.5), P1D2: misses, P2D1: Prediction(2.0, 0.7)}) == P1D2  # none meet: goodput
    tie = {P1D2: Prediction(3.0, 1.0), P2D1: Prediction(3.0, 1.0)}
    assert (chosen(tie), chosen(tie, current=P2D1), chosen(tie, current=P1D2)) == (P1D2, P2D1, P1D2)  # the current stays


@pytest.mark.parametrize("rate, prompt, output, best", [
    (1.0, 64, 256, P1D2),  # long answers: decode-bound, a second decode worker
    (3.0, 1024, 16, P2D1),  # long prompts, short answers: prefill-bound, a second prefill worker
])
def test_the_traffic_seen_decides_the_split(rate, prompt, output, best):
    proposal = propose(traffic(rate, prompt, output), P1D1, Bounds(1, 2, 1, 2, 3), lambda role: WORKER,
                       SimConfig(router=RouterConfig(), duration_s=60), OBJECTIVES, vocab_size=32000)
    assert set(proposal.predictions) == {P1D1, P1D2, P2D1}
    assert proposal.best == best
    assert proposal.predictions[best].goodput_rps > proposal.predictions[P1D1].goodput_rps
    assert proposal.gain > 0.1


def test_a_prediction_simulates_steady_traffic_whatever_the_window():
    """A window's worth of requests at a low rate is a dozen from an empty cluster: too few to
    see the queue a near-saturated pool builds. At least 80 are simulated (at most
    ``max_requests``), all of them sent however long that takes."""
    assert simulated_requests(0.48, 20.0) == 80  # 10 in the window
    assert simulated_requests(30.0, 20.0, 1200) == 600  # the window's own
    assert simulated_requests(30.0, 60.0, 1200) == 1200  # capped
    assert simulated_requests(0.1, 20.0, 50) == 50  # the cap wins over the floor


def test_the_first_quarter_of_a_simulation_is_warm_up_and_not_judged():
    results = [RequestResult(f"r{i}", "standard", 10, sent_at=at) for i, at in enumerate([3.0, 0.0, 2.0, 1.0, 5.0, 4.0,
                                                                                          7.0, 6.0])]
    assert [r.request_id for r in steady(results)] == ["r2", "r0", "r5", "r4", "r7", "r6"]  # sent from 2.0 s on
    assert steady(results[:3]) == [results[1], results[2], results[0]]  # int(3 / 4) = 0 dropped, in send order


def test_a_prediction_is_the_rate_times_the_attainment_after_the_warm_up():
    """1,024-token prompts at 3 req/s on one prefill worker (0.52 s each): beyond it, the queue
    builds from empty. The prediction judges the 60 requests after the first 20 of 80,
    sent without the window's cut-off (20 s would send about 60)."""
    seen = Observation(0.0, 20.0, 60, 3.0, 0.0, 0.0, 1024, 16)
    config = SimConfig(router=RouterConfig(), duration_s=20.0)
    predicted = predict(seen, P1D1, lambda role: WORKER, config, OBJECTIVES, vocab_size=32000, seed=3)
    workload = synthetic(80, Length("normal", 1024, LENGTH_SPREAD * 1024), Length("normal", 16, LENGTH_SPREAD * 16),
                         32000, 3, slo_class="standard")  # the router's default class: none was observed
    result = simulate(Pools(prefill=(1, WORKER), decode=(1, WORKER)), workload, Arrivals("poisson", rate=3.0, seed=3),
                      SimConfig(router=RouterConfig()))
    assert len(result.results) == 80
    judged = summarize(result.results[20:], None, OBJECTIVES)["goodput"]["attainment"]
    everything = summarize(result.results, None, OBJECTIVES)["goodput"]["attainment"]
    assert predicted == Prediction(3.0 * judged, judged)
    assert judged < everything  # the empty start flatters a saturated pool


def test_the_step_fit_says_what_a_request_of_the_observed_lengths_costs():
    # 1,024 tokens in two 512-token chunks of 5 + 256 ms; one sequence's decode step 10 + 12 ms
    assert step_fit(lambda role: WORKER, traffic(3.0, 1024, 16)) == (
        "a 1024-token prompt's prefill 0.52 s; a decode step of one sequence at 1040 tokens 22 ms")
    assert step_fit(lambda role: WORKER, Observation(0.0, 60.0, 0, 0.0, 0.0, 0.0, None, None)) == ""


def proposal(best: Split, goodput: float, current: Split = P1D1, now_goodput: float = 1.0) -> Proposal:
    return Proposal(current, best, {current: Prediction(now_goodput, 0.5), best: Prediction(goodput, 0.95)})


def test_the_hysteresis_acts_only_on_a_confirmed_gain_outside_the_cooldown():
    h = Hysteresis(min_gain=0.1, confirmations=2, cooldown_s=100.0)
    assert h.offer(proposal(P1D2, 1.05), 0.0) == "predicted gain +5% is under 10%"
    assert h.offer(proposal(P1D2, 1.5), 1.0) == "proposed 1 of 2 looks in a row"
    assert h.offer(proposal(P2D1, 1.5), 2.0) == "proposed 1 of 2 looks in a row"  # another split: starts again
    assert h.offer(proposal(P2D1, 1.5), 3.0) is None
    h.acted(3.0)
    assert h.offer(proposal(P1D2, 1.5, current=P2D1), 4.0) == "proposed 1 of 2 looks in a row"
    assert h.offer(proposal(P1D2, 1.5, current=P2D1), 5.0) == "98 s of cooldown left"
    assert h.offer(proposal(P1D2, 1.5, current=P2D1), 103.0) is None
    keep = Proposal(P1D1, P1D1, {P1D1: Prediction(1.0, 1.0)})
    assert h.offer(keep, 104.0) == "the current split is the best"
    # fewer workers that meet the objectives need no gain in goodput
    fewer = Proposal(P1D2, P1D1, {P1D2: Prediction(1.0, 1.0), P1D1: Prediction(1.0, 0.95)})
    h = Hysteresis(min_gain=0.1, confirmations=1, cooldown_s=0.0)
    assert h.offer(fewer, 0.0) is None


def test_the_planner_thread_yields_the_cores_to_the_workers():
    """Its simulations run at a lower CPU priority than the process's other threads (Linux)."""
    import os
    import threading

    from cluster.plan.live.controller import PLANNER_NICE, yield_to_workers

    seen = {}

    def planner_thread():
        seen["before"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        yield_to_workers()
        seen["after"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=planner_thread)
    thread.start()
    thread.join()
    assert seen["after"] == min(19, seen["before"] + PLANNER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before  # the other threads keep theirs


def test_simulated_requests_take_the_observed_classes_and_are_judged_by_their_objectives():
    """A simulated request is judged as the registry judged the observed ones: by its class's
    objectives. Unclassed, a late first token counted as met: 1P+1D at 3 req/s of 1,024-token
    prompts came out at 87% (those not refused) where 72% met the default class's objectives."""
    workload = synthetic(8, Length("fixed", 16), Length("fixed", 4), 32000, 0)
    shares = (("standard", 0.75), ("interactive", 0.25))
    assert [s.slo_class for s in with_classes(workload, shares).sessions] == ["standard"] * 6 + ["interactive"] * 2
    assert {s.slo_class for s in with_classes(workload, (("batch", 1.0),)).sessions} == {"batch"}
    seen = Observation(0.0, 20.0, 60, 3.0, 0.0, 0.0, 1024, 16)
    judged = predict(seen, P1D1, lambda role: WORKER, SimConfig(router=RouterConfig(), duration_s=20.0), OBJECTIVES,
                     vocab_size=32000, seed=3)
    unknown = predict(replace(seen, class_shares=(("renamed", 1.0),)), P1D1, lambda role: WORKER,
                      SimConfig(router=RouterConfig(), duration_s=20.0), OBJECTIVES, vocab_size=32000, seed=3)
    assert unknown == judged  # a class the router does not know: its default class, as with none observed
    workload = synthetic(80, Length("normal", 1024, LENGTH_SPREAD * 1024), Length("normal", 16, LENGTH_SPREAD * 16),
                         32000, 3)  # unclassed, as the planner simulated before
    result = simulate(Pools(prefill=(1, WORKER), decode=(1, WORKER)), workload, Arrivals("poisson", rate=3.0, seed=3),
                      SimConfig(router=RouterConfig()))
    unclassed = summarize(steady(result.results), None, OBJECTIVES)["goodput"]["attainment"]
    assert judged.attainment < unclassed  # unclassed, every request not refused counted as met
    batch = predict(replace(seen, class_shares=(("batch", 1.0),)), P1D1, lambda role: WORKER,
                    SimConfig(router=RouterConfig(), duration_s=20.0), OBJECTIVES, vocab_size=32000, seed=3)
    assert batch.attainment == 1.0  # batch has no objectives and is never refused


def test_a_decision_predicts_the_mean_of_several_seeds():
    seen = Observation(0.0, 20.0, 60, 2.0, 0.0, 0.0, 1024, 16)
    config = SimConfig(router=RouterConfig(), duration_s=20.0)
    each = [predict(seen, P1D1, lambda role: WORKER, config, OBJECTIVES, 32000, seed) for seed in range(DECISION_SEEDS)]
    settled = predict_settled(seen, P1D1, lambda role: WORKER, config, OBJECTIVES, 32000)
    assert settled.attainment == pytest.approx(sum(p.attainment for p in each) / DECISION_SEEDS)
    assert settled.goodput_rps == pytest.approx(sum(p.goodput_rps for p in each) / DECISION_SEEDS)
    assert predict_settled(seen, P1D1, lambda role: WORKER, config, OBJECTIVES, 32000, first=each[0]) == settled
