"""A worker's Prometheus counters of speculative decoding (exported from 0 on workers that
decode) and of its KV host tier: grown by what the engine's totals added since the last report."""

from __future__ import annotations

import pytest

from cluster.observability import metrics

pytestmark = pytest.mark.unit


class Recorded:
    """Stands for Ray's metric classes: keeps what each metric was given."""

    def __init__(self, name: str, description: str = "", boundaries=None, tag_keys=()):
        self.name, self.tag_keys, self.values = name, tag_keys, []

    def inc(self, value, tags):
        self.values.append((value, tags["worker"]))

    _record = set = observe = inc


@pytest.fixture
def recorded(monkeypatch):
    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics.metrics, kind, Recorded)


def counts(worker: metrics.WorkerMetrics) -> dict[str, list]:
    return {c.name: c.values for c in (worker.spec_proposed, worker.spec_accepted, worker.spec_verifies)}


def test_speculation_counters_grow_by_the_engines_new_guesses(recorded):
    worker = metrics.WorkerMetrics("c", "decode-0", "decode", generates=True)
    assert counts(worker) == {"tandem_spec_proposed_tokens": [(0.0, "decode-0")],
                              "tandem_spec_accepted_tokens": [(0.0, "decode-0")],
                              "tandem_spec_verify_steps": [(0.0, "decode-0")]}
    worker.speculation(10, 4, 3)
    worker.speculation(10, 4, 3)  # nothing new: nothing counted
    worker.speculation(16, 4, 5)
    assert counts(worker) == {"tandem_spec_proposed_tokens": [(0.0, "decode-0"), (10, "decode-0"), (6, "decode-0")],
                              "tandem_spec_accepted_tokens": [(0.0, "decode-0"), (4, "decode-0")],
                              "tandem_spec_verify_steps": [(0.0, "decode-0"), (3, "decode-0"), (2, "decode-0")]}


def test_a_prefill_worker_exports_no_speculation(recorded):
    worker = metrics.WorkerMetrics("c", "prefill-0", "prefill")
    worker.speculation(0, 0, 0)
    assert all(values == [] for values in counts(worker).values())


def test_host_tier_counters_grow_by_the_engines_new_copies_and_the_gauge_holds_its_blocks(recorded):
    worker = metrics.WorkerMetrics("c", "decode-0", "decode", generates=True)
    worker.host_tier(5, 0, 5)
    worker.host_tier(5, 0, 5)  # nothing new: nothing counted
    worker.host_tier(9, 3, 7)
    worker.host_tier(2, 1, 2)  # the totals started again (a start-up profile resets them): counted from there
    worker.host_tier(4, 1, 4)
    assert worker.host_offloaded.values == [(0.0, "decode-0"), (5, "decode-0"), (4, "decode-0"), (2, "decode-0")]
    assert worker.host_loaded.values == [(0.0, "decode-0"), (3, "decode-0")]
    assert worker.host_used.values == [(5, "decode-0"), (5, "decode-0"), (7, "decode-0"), (2, "decode-0"),
                                       (4, "decode-0")]
