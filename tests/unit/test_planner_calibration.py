"""The live planner's calibration: the step-time scale at which the split in force, simulated
at the traffic just seen, serves the attainment measured over it; and the decision made and
checked at that scale."""

from __future__ import annotations

import pytest

from cluster.bench.metrics import Objectives
from cluster.plan.live.calibrate import SCALE_RANGE, calibrate, scaled, scaled_specs
from cluster.plan.live.observe import Observation
from cluster.plan.live.propose import Split, predict
from cluster.plan.simulator import SimConfig, WorkerSpec
from router.config import RouterConfig
from router.cost_model import StepTimeModel

pytestmark = pytest.mark.unit

# prefill: 5 ms + 0.5 ms a token; decode: 10 ms + 12 ms a sequence
WORKER = WorkerSpec(StepTimeModel(prefill=(0.005, 0.0005, 1e-8), decode=(0.010, 0.012, 1e-7), transfer_s_per_block=0.001,
                                  max_num_batched_tokens=512, draft_s_per_token=0.0002), 2000, max_num_seqs=32)
OBJECTIVES = {c.name: Objectives(c.ttft_s, c.tpot_s) for c in RouterConfig().slo_classes}
CONFIG = SimConfig(router=RouterConfig(), duration_s=20.0)
P1D1, P2D1 = Split(1, 1), Split(2, 1)


def seen(rate: float, attainment: float, requests: int = 40) -> Observation:
    return Observation(0.0, 20.0, requests, rate, rate * attainment, attainment, 1024, 16)


def simulated(split: Split, rate: float, scale: float) -> float:
    return predict(seen(rate, 0.0), split, scaled_specs(lambda role: WORKER, scale), CONFIG, OBJECTIVES, 32000).attainment


def test_a_scale_multiplies_every_time_of_the_step_model():
    model = scaled(WORKER, 1.5).model
    assert model.prefill == pytest.approx((0.0075, 0.00075, 1.5e-8))
    assert model.decode == pytest.approx((0.015, 0.018, 1.5e-7))
    assert (model.transfer_s_per_block, model.draft_s_per_token) == pytest.approx((0.0015, 0.0003))
    assert model.host_load_s_per_block == pytest.approx(1.5 * WORKER.model.host_load_s_per_block)
    assert model.max_num_batched_tokens == 512 and scaled(WORKER, 1.0) is WORKER


def test_the_scale_found_reproduces_the_measured_attainment_and_predicts_the_other_split():
    """A cluster whose requests take 1.4x its fitted steps: 1P+1D at 2.5 req/s of 1,024-token
    prompts measures what the simulation gives at 1.4x. The calibration finds a scale giving
    that attainment, and at it 2P+1D comes out as it does at 1.4x (the fits alone are further off)."""
    measured = simulated(P1D1, 2.5, 1.4)
    unscaled = simulated(P1D1, 2.5, 1.0)
    assert measured < unscaled - 0.1  # slower than the fits: it measured less
    found = calibrate(seen(2.5, measured), P1D1, lambda role: WORKER, CONFIG, OBJECTIVES, 32000)
    assert found.measured_attainment == measured and found.unscaled_attainment == unscaled
    assert abs(found.simulated_attainment - measured) <= 2 / 60  # 60 requests judged: a step is 1/60
    assert 1.25 <= found.scale <= 1.55
    truth, calibrated, fits = (simulated(P2D1, 3.2, s) for s in (1.4, found.scale, 1.0))
    assert abs(calibrated - truth) <= 0.05 < abs(fits - truth)


def test_a_cluster_faster_than_its_fits_is_scaled_down():
    measured = simulated(P1D1, 2.5, 0.7)
    found = calibrate(seen(2.5, measured), P1D1, lambda role: WORKER, CONFIG, OBJECTIVES, 32000)
    assert found.scale < 1.0 and abs(found.simulated_attainment - measured) <= 2 / 60


def test_nothing_to_learn_where_the_fits_give_what_was_measured():
    light = simulated(P1D1, 0.2, 1.0)
    assert light == 1.0
    found = calibrate(seen(0.2, 1.0), P1D1, lambda role: WORKER, CONFIG, OBJECTIVES, 32000)
    assert (found.scale, found.simulated_attainment) == (1.0, 1.0)


def test_a_gap_beyond_the_range_is_held_at_its_end_and_a_thin_window_says_nothing():
    found = calibrate(seen(2.5, 0.0), P1D1, lambda role: WORKER, CONFIG, OBJECTIVES, 32000)
    assert found.scale == SCALE_RANGE[1] and found.simulated_attainment > 0.0
    assert calibrate(seen(2.5, 0.5, requests=7), P1D1, lambda role: WORKER, CONFIG, OBJECTIVES, 32000) is None
    assert "steps x3.00: the current split measured 0% attainment" in found.describe()
