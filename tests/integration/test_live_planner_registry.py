"""The live planner against a real registry: it reads the traffic and the workers' step times
there, acts on a confirmed proposal (or only says it), keeps each decision with its prediction,
and measures it a window later."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from cluster.plan.live.controller import LivePlanner
from cluster.registry.planner_decisions import Journal
from cluster.bench.metrics import class_objectives
from cluster.plan.live.observe import observe
from cluster.plan.live.propose import Split, predict, predict_settled
from cluster.registry.goodput import GoodputReader
from cluster.registry.goodput import GoodputRecorder, RequestRecord
from cluster.registry.load import StepSample, WorkerLoad, publish_load
from cluster.topology.spec import ClusterSpec, PlannerSpec

pytestmark = pytest.mark.integration

CLUSTER = "live"
# prefill: 5 ms + 0.5 ms a token; decode: 10 ms + 12 ms a sequence (as test_live_planner's WORKER)
PREFILL_STEPS = tuple(StepSample(n, 0, 0, 0, 0.005 + 0.0005 * n) for n in (64, 256, 512, 128))
DECODE_STEPS = tuple(StepSample(0, 0, n, 0, 0.010 + 0.012 * n) for n in (1, 2, 4, 8))


class Cluster:
    """What the deployment gives the planner: its split now, its workers, and a resize."""

    def __init__(self, fail: bool = False):
        self.split, self.resized, self.fail = Split(1, 1), [], fail

    def workers(self) -> list[str]:
        return ([f"prefill-{i}" for i in range(self.split.prefill)]
                + [f"decode-{i}" for i in range(self.split.decode)])

    def resize(self, split: Split) -> str:
        if self.fail:
            raise RuntimeError("no node has room for a prefill worker")
        self.resized.append(split)
        self.split = split
        return f"now {split.label()}"


def publish_workers(client, cluster: Cluster) -> None:
    for name in cluster.workers():
        role = name.rsplit("-", 1)[0]
        steps = PREFILL_STEPS if role == "prefill" else DECODE_STEPS
        publish_load(client, CLUSTER, WorkerLoad(name, role, 0, 0, 0, 0, 0, 2000, 2000, 16, 512, 32, steps), ttl_s=300)


def record_traffic(client, start: float, seconds: int, per_second: int, prompt: int, output: int, met: bool = True):
    recorder = GoodputRecorder(client, CLUSTER)
    for s in range(seconds):
        for i in range(per_second):
            recorder.record(RequestRecord(f"r{start}-{s}-{i}", "standard", "prefill-0", "decode-0",
                                          0.5 if met else 9.0, 0.05, 5.0, 0.25, finished_at=start + s + 0.5,
                                          prompt_tokens=prompt, output_tokens=output))


def planner(client, cluster: Cluster, clock, mode: str = "act", measure_s: float | None = None) -> LivePlanner:
    spec = replace(ClusterSpec(), planner=PlannerSpec(mode=mode, interval_s=1.0, window_s=30.0, max_workers=3,
                                                      confirmations=2, cooldown_s=0.0, measure_s=measure_s))
    return LivePlanner(spec, client, CLUSTER, lambda: cluster.split, cluster.workers, vocab_size=32000,
                       max_model_len=4096, resize=cluster.resize, clock=clock)


def test_it_acts_on_a_confirmed_proposal_and_measures_it_a_window_later(redis_client):
    cluster, now = Cluster(), [time.time()]
    publish_workers(redis_client, cluster)
    record_traffic(redis_client, now[0] - 30, 30, 3, prompt=1024, output=16)  # 3 req/s of long prompts
    live = planner(redis_client, cluster, lambda: now[0])
    assert live.look() is None  # proposed once: not yet
    assert Journal(redis_client, CLUSTER).latest()["waiting"] == "proposed 1 of 2 looks in a row"
    now[0] += 1
    decision = live.look()
    assert cluster.resized == [Split(2, 1)]
    assert (decision.number, decision.mode, decision.current, decision.proposed, decision.acted, decision.detail) == (
        1, "act", "1P+1D", "2P+1D", True, "now 2P+1D")
    latest = Journal(redis_client, CLUSTER).latest()
    assert latest["current"] == "1P+1D" and set(latest["predictions"]) == {"1P+1D", "1P+2D", "2P+1D"}
    # what the simulation took a request to cost (the fits of the steps published above; 512-token chunks)
    assert latest["step_fit"] == "a 1024-token prompt's prefill 0.52 s; a decode step of one sequence at 1040 tokens 22 ms"
    assert decision.predicted_goodput_rps == pytest.approx(latest["predictions"]["2P+1D"], abs=1e-3)  # rounded there
    # the window after it: 2 req/s met (60 in 30 s), then the look that measures it
    record_traffic(redis_client, int(decision.at) + 1, 30, 2, prompt=1024, output=16)  # the window's 30 whole seconds
    publish_workers(redis_client, cluster)
    now[0] = decision.at + 30.5
    live.look()
    [measured] = Journal(redis_client, CLUSTER).decisions()
    assert measured.number == 1 and measured.measured_goodput_rps == pytest.approx(60 / 30)
    assert measured.measured_attainment == 1.0
    assert measured.error == pytest.approx((measured.predicted_goodput_rps - 2.0) / 2.0)
    assert "resized 1P+1D -> 2P+1D" in measured.line() and "measured 2.00 req/s (100%)" in measured.line()
    # The model checked apart from its guess of the traffic: 2P+1D simulated at the 2 req/s that
    # came, by the same code that proposed it (the workers as they reported themselves).
    spec_for, config = live._simulation()
    after = observe(GoodputReader(redis_client, CLUSTER), 30.0, decision.at + 30)
    expected = predict_settled(after, Split(2, 1), spec_for, config, class_objectives(live.spec.router), 32000)
    assert measured.measured_rate_rps == pytest.approx(2.0)
    assert measured.expected_goodput_rps == pytest.approx(expected.goodput_rps) and expected.goodput_rps > 0
    assert measured.model_error == pytest.approx((expected.goodput_rps - 2.0) / 2.0)
    assert f"for the 2.00 req/s that came it predicts {expected.goodput_rps:.2f}" in measured.line()


def test_with_a_longer_measure_s_the_prediction_is_made_at_the_steadier_rate_and_checked_over_as_long(redis_client):
    """measure_s 90 s, window 30 s: the window that sets the decision off has 3 req/s, the 60 s
    before it 1 req/s (about 2 req/s over the 90 s). The decision predicts its split at 2 req/s, with
    the window's lengths; it is measured over the 90 s after it."""
    cluster, now = Cluster(), [time.time()]
    publish_workers(redis_client, cluster)
    start = int(now[0]) - 90
    record_traffic(redis_client, start, 60, 1, prompt=1024, output=16)
    record_traffic(redis_client, start + 60, 30, 3, prompt=1024, output=16)
    live = planner(redis_client, cluster, lambda: now[0], measure_s=90.0)
    live.look()
    now[0] += 1
    decision = live.look()
    assert (decision.acted, decision.proposed) == (True, "2P+1D")
    window = observe(GoodputReader(redis_client, CLUSTER), 30.0, now[0])
    steady = observe(GoodputReader(redis_client, CLUSTER), 90.0, now[0])
    assert window.rate_rps > 1.3 * steady.rate_rps  # the window's 3 req/s against the 90 s's ~2
    spec_for, config = live._simulation()
    expected = predict_settled(replace(window, rate_rps=steady.rate_rps), Split(2, 1), spec_for, config,
                               class_objectives(live.spec.router), 32000)
    assert decision.predicted_goodput_rps == pytest.approx(expected.goodput_rps)
    assert decision.predicted_goodput_rps < Journal(redis_client, CLUSTER).latest()["predictions"]["2P+1D"]
    assert decision.observed.endswith(f"predicted at {steady.rate_rps:.2f} req/s (last 90 s)")
    assert "; a 1024-token prompt's prefill 0.52 s; a decode step of one sequence at 1040 tokens 22 ms; predicted" in (
        decision.observed)  # the fits the decision was simulated with, kept with it
    record_traffic(redis_client, int(decision.at) + 1, 90, 2, prompt=1024, output=16)
    publish_workers(redis_client, cluster)
    now[0] = decision.at + 60.5
    live.look()
    first = {d.number: d for d in Journal(redis_client, CLUSTER).decisions()}[1]
    assert first.measured_goodput_rps is None  # 90 s have not passed
    now[0] = decision.at + 90.5
    live.look()
    measured = {d.number: d for d in Journal(redis_client, CLUSTER).decisions()}[1]
    assert measured.measured_goodput_rps == pytest.approx(180 / 90) and measured.measured_rate_rps == pytest.approx(2.0)


def test_advise_only_says_and_a_failed_resize_is_kept_as_not_done(redis_client):
    cluster, now = Cluster(), [time.time()]
    publish_workers(redis_client, cluster)
    record_traffic(redis_client, now[0] - 30, 30, 3, prompt=1024, output=16)
    live = planner(redis_client, cluster, lambda: now[0], mode="advise")
    live.look()
    now[0] += 1
    advice = live.look()
    assert cluster.resized == [] and (advice.acted, advice.proposed) == (False, "2P+1D")
    spec_for, config = live._simulation()
    seen = observe(GoodputReader(redis_client, CLUSTER), 30.0, now[0])
    stays = predict_settled(seen, Split(1, 1), spec_for, config, class_objectives(live.spec.router), 32000)
    assert advice.predicted_goodput_rps == pytest.approx(stays.goodput_rps)  # what stays, over DECISION_SEEDS seeds
    # the look compared the splits on one seed: the first of those the decision averages
    latest = Journal(redis_client, CLUSTER).latest()
    assert latest["predictions"]["1P+1D"] == pytest.approx(
        predict(seen, Split(1, 1), spec_for, config, class_objectives(live.spec.router), 32000).goodput_rps, abs=1e-3)
    failing = Cluster(fail=True)
    live = planner(redis_client, failing, lambda: now[0])
    live.look()
    now[0] += 1
    failed = live.look()
    assert (failed.number, failed.acted, failed.detail) == (2, False, "resize failed: no node has room for a prefill worker")
    assert failing.split == Split(1, 1)


def test_no_traffic_no_proposal(redis_client):
    cluster = Cluster()
    publish_workers(redis_client, cluster)
    live = planner(redis_client, cluster, time.time)
    assert live.look() is None
    latest = Journal(redis_client, CLUSTER).latest()
    assert latest["proposal"] == "nothing to size for" and latest["observed"] == "no traffic in the last 30 s"


def test_cpu_workers_of_one_node_share_its_cores_in_the_predictions(redis_client, monkeypatch):
    """The same traffic and steps, the workers on one 2-core node instead of their own: each
    split's steps slow each other, so every prediction is lower and the extra prefill worker
    gains less."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # 2 cores, and 2 torch threads a worker (null threads)
    predictions = {}
    for nodes in ("apart", "one"):
        cluster, now = Cluster(), [time.time()]
        for i, name in enumerate(cluster.workers()):
            steps = PREFILL_STEPS if name.startswith("prefill") else DECODE_STEPS
            node = "node-a" if nodes == "one" else f"node-{i}"
            publish_load(redis_client, CLUSTER, WorkerLoad(name, name.rsplit("-", 1)[0], 0, 0, 0, 0, 0, 2000, 2000, 16,
                                                           512, 32, steps, node_id=node), ttl_s=300)
        record_traffic(redis_client, now[0] - 30, 30, 3, prompt=1024, output=16)
        live = planner(redis_client, cluster, lambda: now[0], mode="advise")
        live.look()
        predictions[nodes] = Journal(redis_client, CLUSTER).latest()["predictions"]
        redis_client.flushdb()
    assert set(predictions["one"]) == set(predictions["apart"]) == {"1P+1D", "1P+2D", "2P+1D"}
    assert all(predictions["one"][s] < predictions["apart"][s] for s in predictions["one"])
