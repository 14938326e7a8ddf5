"""The live planner's choices: which split it proposes for the traffic seen (simulated with the
router's own code), which it prefers, and when the hysteresis lets it act."""

from __future__ import annotations

import pytest

from cluster.bench.metrics import Objectives
from cluster.plan.live.hysteresis import Hysteresis
from cluster.plan.live.observe import Observation
from cluster.plan.live.propose import Bounds, Prediction, Proposal, Split, chosen, propose
from cluster.plan.simulator import SimConfig, WorkerSpec
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
