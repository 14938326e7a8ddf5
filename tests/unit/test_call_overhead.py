"""A decode worker's estimate of its calls to prefill workers beyond their work."""

from __future__ import annotations

import pytest

from decode_worker.call_overhead import CallOverhead

pytestmark = pytest.mark.unit


def test_the_hop_is_the_median_of_the_latest_calls():
    calls = CallOverhead(kept=3)
    assert calls.seconds == 0.0  # nothing measured yet
    for seconds in (0.004, 0.250, 0.003):  # one call slowed by a pause does not move it
        calls.add(seconds)
    assert calls.seconds == 0.004
    calls.add(0.002)  # the oldest (0.004) leaves the window
    assert calls.seconds == 0.003
    calls.add(-0.001)  # a call answered sooner than its reported work (clocks' grain) counts as no hop
    assert calls.seconds == 0.002
