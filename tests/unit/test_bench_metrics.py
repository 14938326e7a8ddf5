"""Metric arithmetic of ``tandem bench`` on hand-made timings; goodput is DistServe's (the
registry's own RequestRecord rule)."""

import pytest

from cluster.bench.metrics import (Objectives, RequestResult, goodput, parse_objectives, percentile, summarize,
                                   sweep_goodput)
from cluster.registry.goodput import RequestRecord

pytestmark = pytest.mark.unit


def hand_made() -> list[RequestResult]:
    r1 = RequestResult("r1", None, 100, 0.0, 0.2, 0.5, [(0.2, 1), (0.3, 1), (0.5, 2)], 4, cached_tokens=32)
    r2 = RequestResult("r2", None, 50, 1.0, 1.6, 1.9, [(1.6, 1), (1.9, 1)], 2, cached_tokens=0)
    r3 = RequestResult("r3", None, 70, 2.0, error="RESOURCE_EXHAUSTED: no pair can meet")
    r4 = RequestResult("r4", None, 10, 2.5, 2.6, 2.6, [(2.6, 1)], 1, cached_tokens=0)
    return [r1, r2, r3, r4]


def test_per_request_figures():
    r1, r2, r3, r4 = hand_made()
    assert r1.ttft_s == pytest.approx(0.2) and r1.tpot_s == pytest.approx(0.1) and r1.e2e_s == pytest.approx(0.5)
    assert r1.itl_s() == pytest.approx([0.1, 0.1, 0.1])  # the 2-token message counts two gaps of 0.1
    assert r2.tpot_s == pytest.approx(0.3)
    assert r3.ttft_s is None and r3.e2e_s is None and not r3.ok
    assert r4.tpot_s is None  # one token: no TPOT


def test_summary_on_hand_made_timings():
    s = summarize(hand_made(), Objectives(ttft_s=0.5, tpot_s=0.2))
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["duration_s"] == pytest.approx(2.6)
    assert s["request_throughput_rps"] == pytest.approx(3 / 2.6)
    assert s["output_token_throughput"] == pytest.approx(7 / 2.6)
    assert s["prefix_cache_hit_rate"] == pytest.approx(32 / 160)
    ttft = s["ttft"]  # 0.2, 0.6, 0.1
    assert ttft["mean_ms"] == pytest.approx(300.0)
    assert ttft["p50_ms"] == pytest.approx(200.0) and ttft["p90_ms"] == pytest.approx(520.0)
    assert s["tpot"]["mean_ms"] == pytest.approx(200.0)  # 0.1 and 0.3
    assert s["e2e"]["p99_ms"] == pytest.approx(1000 * (0.5 + 0.98 * 0.4))  # 0.1, 0.5, 0.9: rank 1.98
    g = s["goodput"]
    # r1 meets both; r2 misses both (TTFT 0.6, TPOT 0.3); r3 failed; r4 meets TTFT and has no TPOT
    assert (g["met"], g["ttft_met"], g["tpot_met"], g["failed"]) == (2, 2, 2, 1)
    assert g["attainment"] == pytest.approx(0.5) and g["goodput_rps"] == pytest.approx(2 / 2.6)


def test_goodput_is_the_registry_rule():
    results = hand_made()
    objectives = Objectives(ttft_s=0.61, tpot_s=0.31)  # r2 (0.6, 0.3) now meets both
    g = goodput(results, lambda r: objectives, duration_s=4.0)
    records = [RequestRecord(r.request_id, "", None, None, r.ttft_s, r.tpot_s, 0.61, 0.31, failed=not r.ok)
               for r in results]
    assert g["met"] == sum(rec.met for rec in records) == 3
    assert g["goodput_rps"] == pytest.approx(3 / 4.0)


def test_class_objectives_apply_per_class_and_command_line_objectives_override():
    results = hand_made()
    results[0].slo_class = results[1].slo_class = "interactive"
    classes = {"interactive": Objectives(0.5, 0.2)}
    s = summarize(results, None, classes)
    assert s["classes"]["interactive"]["met"] == 1 and s["classes"]["(none)"]["met"] == 1
    assert summarize(results, Objectives(ttft_s=1.0))["goodput"]["met"] == 3


def test_a_request_sent_without_a_class_is_judged_as_the_default_class():
    """The server gives a request of no class its router's default class: the bench judges it by
    that class's objectives and counts it there (it met everything before: a run at twice a
    prefill worker's capacity showed 100% of its kept requests on time with a TTFT p90 of 7.9 s
    against the 5 s objective)."""
    results = hand_made()  # r1: TTFT 0.2 s; r2: 0.6 s; r4: 0.1 s; r3 failed
    classes = {"standard": Objectives(ttft_s=0.5)}
    s = summarize(results, None, classes, default_class="standard")
    assert s["goodput"]["met"] == 2 and set(s["classes"]) == {"standard"}
    assert summarize(results, None, classes)["goodput"]["met"] == 3  # no default known: no objective


def test_parse_objectives_names_the_flag():
    assert parse_objectives(["ttft_ms:500", "tpot_ms:50"]) == Objectives(0.5, 0.05)
    for bad in (["ttft:5"], ["ttft_ms:x"], ["tpot_ms:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_objectives(bad)


def test_percentile_interpolates_and_sweep_goodput_is_the_highest_rate_meeting_the_goal():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 90) is None
    points = [(1.0, {"goodput": {"attainment": 1.0}}), (2.0, {"goodput": {"attainment": 0.93}}),
              (4.0, {"goodput": {"attainment": 0.6}})]
    assert sweep_goodput(points) == 2.0


def test_a_refusal_is_counted_as_rejected_not_failed():
    r1, r2, r3, r4 = hand_made()
    refused = RequestResult("r5", None, 70, 3.0, finished_at=3.004, error="HTTP 429: busy", rejected=True,
                            retry_after_s=1.25)
    s = summarize([r1, r2, r3, r4, refused], Objectives(ttft_s=0.5, tpot_s=0.2))
    assert (s["completed"], s["rejected"], s["failed"]) == (3, 1, 1)
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1}  # r3 has no rejected mark: a failure
    assert s["time_to_reject"]["p50_ms"] == pytest.approx(4.0)
    assert s["retry_after"]["p50_ms"] == pytest.approx(1250.0)
    g = s["goodput"]
    assert (g["met"], g["rejected"], g["failed"], g["requests"]) == (2, 1, 1, 5)  # not met, counted apart
    assert g["attainment"] == pytest.approx(2 / 5)
