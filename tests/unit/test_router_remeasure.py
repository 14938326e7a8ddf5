"""The prefill path not taken, measured again (router/remeasure.py): exact placements and predictions."""

from __future__ import annotations

import pytest

from cluster.registry.load import StepSample
from router.remeasure import REMEASURE_EVERY
from router.router import Router, Topology
from test_router import BS, DECODE_STEPS, NOW, PROMPT, FakeRegistry, config, load, route

pytestmark = pytest.mark.unit

ONE_PAIR = Topology(prefill=("p0",), decode=("d0",), block_size=BS, hash_keys=("m",))


def profiled_decode_worker(fixed_s: float) -> FakeRegistry:
    """d0's prefill fit as a start-up profile left it: ``fixed_s`` + 1 ms per token (p0's: 10 ms + 1 ms)."""
    prefill = tuple(StepSample(n, 0, 0, 0, fixed_s + 0.001 * n) for n in (16, 64, 256))
    return FakeRegistry({"d0": load("d0", steps=prefill + DECODE_STEPS)})


def placed_paths(router: Router, start: int, count: int, local_ttft_s: float, remote_ttft_s: float = 0.043) -> str:
    """``count`` requests one after another, each ended before the next (one stream): R or L each."""
    paths = ""
    for i in range(start, start + count):
        decision = route(router, f"r{i}")
        local = decision.prefill is None
        router.finished(f"r{i}", service_ttft_s=local_ttft_s if local else remote_ttft_s, now=NOW)
        paths += "L" if local else "R"
    return paths


def test_a_prefill_path_not_taken_is_measured_again_and_kept_while_it_measures_sooner():
    """The quick start's flip: a decode worker's prefill fit from its start-up profile put a short
    prompt's local prefill at 84 ms where it took about 12, and every prompt went to the prefill
    worker (predicted and measured 30), for good. Here local is predicted 93 ms against remote's
    43 and measured at 20."""
    router = Router(ONE_PAIR, profiled_decode_worker(0.060), config(local_prefill_max_tokens=64))
    assert placed_paths(router, 0, REMEASURE_EVERY, local_ttft_s=0.020) == "R" * 8  # as predicted: 43 ms
    remeasure = route(router, "m1")  # local, untaken for 8 placements, within 100 ms of the chosen
    assert (remeasure.prefill, remeasure.predicted_ttft_s) == (None, pytest.approx(0.093))
    assert remeasure.reason == ("re-measuring the local prefill path (not taken for a while): (local prefill) -> d0 "
                                "predicts TTFT 93 ms against 43 ms for p0 -> d0")
    router.finished("m1", service_ttft_s=0.020, now=NOW)  # sooner than remote's 43: taken again
    again = route(router, "m2")
    assert again.prefill is None and again.reason.startswith("re-measuring the local prefill path (measured sooner")
    assert again.predicted_ttft_s == pytest.approx(0.093 + 0.1 * (0.020 - 0.093))  # its own correction, learning
    router.finished("m2", service_ttft_s=0.020, now=NOW)
    assert placed_paths(router, 100, 6, local_ttft_s=0.020) == "L" * 6
    assert placed_paths(router, 200, 1, local_ttft_s=0.050) == "L"  # measured slower than remote's prediction ...
    assert placed_paths(router, 300, 9, local_ttft_s=0.020) == "R" * 8 + "L"  # ... left for 8 placements
    assert router.status(NOW)["prefill_path_remeasures"] == 10 and router.status(NOW)["local_prefills"] == 10


def test_a_path_predicted_far_slower_is_not_measured_again():
    """What a wrong re-measure may cost is bounded: a local prefill predicted more than 100 ms
    later than the chosen remote one (here 233 against 43 ms) is never tried."""
    router = Router(ONE_PAIR, profiled_decode_worker(0.200), config(local_prefill_max_tokens=64))
    assert placed_paths(router, 0, 3 * REMEASURE_EVERY, local_ttft_s=0.020) == "R" * 24


def test_the_path_not_taken_is_measured_again_either_way_and_left_when_slower():
    """A start whose first prediction favoured local prefill: remote is measured once in 9
    placements, slower (30 against 12 ms), and local kept."""
    router = Router(ONE_PAIR, profiled_decode_worker(0.000), config(local_prefill_max_tokens=64))  # local: 33 ms
    assert placed_paths(router, 0, 18, local_ttft_s=0.012, remote_ttft_s=0.030) == ("L" * 8 + "R") * 2


def test_a_prompt_too_long_to_prefill_locally_still_goes_to_the_prefill_worker_when_local_is_due():
    """Local is due a re-measure, but a prompt with more than ``local_prefill_max_tokens`` to
    compute has no local candidate: it goes to the prefill worker, and the next short one is
    the re-measure."""
    router = Router(ONE_PAIR, profiled_decode_worker(0.060), config(local_prefill_max_tokens=64))
    assert placed_paths(router, 0, REMEASURE_EVERY, local_ttft_s=0.020) == "R" * 8
    long = route(router, "long", prompt=list(range(1000, 1300)))  # 300 tokens, none cached
    assert (long.prefill, long.predicted_ttft_s, long.reason) == ("p0", pytest.approx(0.010 + 0.300), "")
    router.finished("long", service_ttft_s=0.310, now=NOW)
    assert route(router, "short").prefill is None
