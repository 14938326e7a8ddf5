"""Goodput records and windows against a real redis-server (one on loopback for the session,
from tests/conftest.py).

Every record has an explicit ``finished_at`` and every read an explicit ``now``, so nothing
depends on the machine's clock or speed.
"""

from __future__ import annotations

import time

from dataclasses import replace

import pytest

from cluster.registry.goodput import GoodputReader, GoodputRecorder, GoodputWindow, RequestRecord

pytestmark = pytest.mark.integration

T0 = 60 * 28_333_334  # 1_700_000_040, the start of a minute
NOW = T0 + 30


def req(request_id="r", slo_class="chat", prefill="p0", decode="d0", ttft=0.1, tpot=0.02,
        ttft_objective=0.2, tpot_objective=0.05, failed=False, at=T0) -> RequestRecord:
    return RequestRecord(request_id, slo_class, prefill, decode, ttft, tpot, ttft_objective,
                         tpot_objective, failed=failed, finished_at=at)


def hand_made_set() -> list[RequestRecord]:
    return [
        req("met", at=T0 + 1),
        req("ttft-miss", prefill=None, ttft=0.3, at=T0 + 2),
        req("tpot-miss", "batch", decode="d1", ttft=0.5, tpot=0.08, ttft_objective=1.0, at=T0 + 3),
        req("failed", "batch", decode=None, ttft=None, tpot=None, ttft_objective=1.0, failed=True, at=T0 + 4),
        req("one-token", prefill="d1", decode="d1", tpot=None, at=T0 + 5),
    ]


def record_all(redis_client, cluster, records):
    recorder = GoodputRecorder(redis_client, cluster)
    for r in records:
        recorder.record(r)


@pytest.mark.parametrize("record, met_ttft, met_tpot, met", [
    (req(), True, True, True),
    (req(ttft=0.3), False, True, False),
    (req(tpot=0.06), True, False, False),
    (req(ttft=0.2, tpot=0.05), True, True, True),
    (req(failed=True), True, True, False),
    (req(ttft=None, tpot=None, failed=True), False, True, False),
    (req(ttft=9.0, tpot=9.0, ttft_objective=None, tpot_objective=None), True, True, True),
    (req(tpot=None), True, True, True),
    (req(tpot=None, ttft=0.3), False, True, False),
])
def test_classification(record, met_ttft, met_tpot, met):
    assert (record.met_ttft, record.met_tpot, record.met) == (met_ttft, met_tpot, met)


def test_cluster_worker_and_class_counts(redis_client):
    record_all(redis_client, "c", hand_made_set())
    reader = GoodputReader(redis_client, "c")
    cluster = reader.window(60, now=NOW)
    assert cluster == GoodputWindow(
        window_s=60, requests=5, met=2, ttft_met=3, tpot_met=4, failed=1,
        mean_ttft_s=pytest.approx(0.25), mean_tpot_s=pytest.approx(0.04),
        goodput_rps=pytest.approx(2 / 29), attainment=0.4,  # first record at T0 + 1: a 29 s span
        rate_rps=pytest.approx(5 / 29))  # the hand-made records carry no token counts: no means
    expected = {  # (requests, met, ttft_met, tpot_met, failed, mean_ttft_s, mean_tpot_s)
        ("worker", "p0"): (3, 1, 2, 2, 1, 0.3, 0.05),
        ("worker", "d0"): (2, 1, 1, 2, 0, 0.2, 0.02),
        ("worker", "d1"): (2, 1, 2, 1, 0, 0.3, 0.08),  # prefilled and decoded "one-token": counted once
        ("class", "chat"): (3, 2, 2, 3, 0, 0.5 / 3, 0.02),
        ("class", "batch"): (2, 0, 1, 1, 1, 0.5, 0.08),
    }
    for (kind, name), (n, met, ttft_met, tpot_met, failed, ttft, tpot) in expected.items():
        w = reader.window(60, now=NOW, **({"worker": name} if kind == "worker" else {"slo_class": name}))
        assert (w.requests, w.met, w.ttft_met, w.tpot_met, w.failed) == (n, met, ttft_met, tpot_met, failed), name
        assert (w.mean_ttft_s, w.mean_tpot_s) == (pytest.approx(ttft), pytest.approx(tpot)), name
        assert w.attainment == pytest.approx(met / n)
        assert w.goodput_rps == pytest.approx(met / 29)
    unknown = reader.window(60, worker="nobody", now=NOW)
    assert (unknown.requests, unknown.mean_ttft_s, unknown.attainment, unknown.goodput_rps) == (0, None, 0.0, 0.0)
    with pytest.raises(ValueError):
        reader.window(60, worker="p0", slo_class="chat", now=NOW)


def test_minute_and_hour_windows(redis_client):
    record_all(redis_client, "c", [
        req("hour-old-bucket", at=T0 - 3600),  # 3630 s ago, but its minute bucket overlaps the hour
        req("too-old", at=T0 - 3601),          # in the minute bucket before: outside the hour
        req("edge-of-minute", at=NOW - 59),
        req("just-past-minute", at=NOW - 60),
        req("recent", at=NOW),
    ])
    reader = GoodputReader(redis_client, "c")
    assert reader.window(60, now=NOW).requests == 2
    assert reader.window(120, now=NOW).requests == 3
    assert reader.window(3600, now=NOW).requests == 4
    assert reader.window(60, now=NOW + 3600).requests == 0
    with pytest.raises(ValueError):
        reader.window(3601, now=NOW)


def test_goodput_rate_uses_the_span_since_the_first_record(redis_client):
    record_all(redis_client, "young", [req(at=T0 + i) for i in range(4)])
    reader = GoodputReader(redis_client, "young")
    assert reader.window(60, now=T0 + 20).goodput_rps == pytest.approx(4 / 20)
    assert reader.window(3600, now=T0 + 20).goodput_rps == pytest.approx(4 / 20)
    assert reader.window(60, now=T0 + 0.5).goodput_rps == 1.0  # a span of at least 1 s

    record_all(redis_client, "old", [req(at=T0 - 1000), req(at=T0 + 1), req(at=T0 + 2)])
    reader = GoodputReader(redis_client, "old")
    assert reader.window(60, now=T0 + 20).goodput_rps == pytest.approx(2 / 60)
    assert reader.window(3600, now=T0 + 20).goodput_rps == pytest.approx(3 / 1020)


def test_a_record_without_finished_at_is_recorded_now(redis_client):
    GoodputRecorder(redis_client, "c").record(req(at=0.0))
    assert GoodputReader(redis_client, "c").window(60).requests == 1
    assert abs(float(redis_client.get("tandem:c:goodput:since")) - time.time()) < 60


def test_clusters_do_not_see_each_other(redis_client):
    record_all(redis_client, "one", hand_made_set())
    assert GoodputReader(redis_client, "two").window(60, now=NOW).requests == 0
    assert GoodputReader(redis_client, "two").window(3600, now=NOW).requests == 0
    assert GoodputReader(redis_client, "one").window(60, now=NOW).requests == 5
    assert all(key.startswith(b"tandem:one:goodput:") for key in redis_client.keys("*"))


def test_bucket_keys_and_ttls(redis_client):
    record_all(redis_client, "c", [req(at=T0 + 5.7)])
    second, minute = f"tandem:c:goodput:s:{T0 + 5}", f"tandem:c:goodput:m:{T0 // 60}"
    assert set(redis_client.keys("*")) == {second.encode(), minute.encode(), b"tandem:c:goodput:since"}
    assert 0 < redis_client.ttl(second) <= 130
    assert 3600 < redis_client.ttl(minute) <= 3720
    assert redis_client.ttl("tandem:c:goodput:since") == -1
    assert float(redis_client.get("tandem:c:goodput:since")) == T0 + 5.7
    fields = redis_client.hgetall(second)
    assert (fields[b"cluster|n"], fields[b"worker:p0|met"], fields[b"class:chat|ttft_us"]) == (b"1", b"1", b"100000")
    assert redis_client.hgetall(minute) == fields


def test_one_round_trip_to_record_and_one_to_summarise(redis_client):
    calls = []
    original = redis_client.pipeline

    def counting_pipeline(*args, **kwargs):
        calls.append(kwargs.get("transaction", True))
        return original(*args, **kwargs)

    redis_client.pipeline = counting_pipeline
    GoodputRecorder(redis_client, "c").record(req())
    assert calls == [True], "one MULTI/EXEC pipeline"
    calls.clear()
    GoodputReader(redis_client, "c").summary(now=NOW)
    assert len(calls) == 1


def test_summary(redis_client):
    record_all(redis_client, "c", [req("older", "bulk", prefill=None, decode="old-w", ttft=2.0, tpot=None,
                                 ttft_objective=None, tpot_objective=None, at=NOW - 90)]
               + hand_made_set())
    summary = GoodputReader(redis_client, "c").summary(now=NOW)
    assert list(summary) == ["last_minute", "last_hour"]
    minute, hour = summary["last_minute"], summary["last_hour"]
    assert set(minute) == set(hour) == {"cluster", "workers", "classes"}
    assert set(minute["workers"]) == {"p0", "d0", "d1"}
    assert set(minute["classes"]) == {"chat", "batch"}
    assert set(hour["workers"]) == {"p0", "d0", "d1", "old-w"}
    assert set(hour["classes"]) == {"chat", "batch", "bulk"}
    assert minute["cluster"] == {
        "window_s": 60, "requests": 5, "met": 2, "ttft_met": 3, "tpot_met": 4, "failed": 1,
        "mean_ttft_s": pytest.approx(0.25), "mean_tpot_s": pytest.approx(0.04),
        "goodput_rps": pytest.approx(2 / 60), "attainment": 0.4,  # first record 90 s ago: a full window
        "mean_prompt_tokens": None, "mean_output_tokens": None, "rate_rps": pytest.approx(5 / 60)}
    assert hour["cluster"] == {
        "window_s": 3600, "requests": 6, "met": 3, "ttft_met": 4, "tpot_met": 5, "failed": 1,
        "mean_ttft_s": pytest.approx(3.0 / 5), "mean_tpot_s": pytest.approx(0.04),
        "goodput_rps": pytest.approx(3 / 90), "attainment": 0.5,
        "mean_prompt_tokens": None, "mean_output_tokens": None, "rate_rps": pytest.approx(6 / 90)}
    assert hour["workers"]["old-w"] == GoodputReader(redis_client, "c").window(3600, worker="old-w", now=NOW).to_dict()
    assert hour["workers"]["old-w"]["requests"] == 1 and hour["workers"]["old-w"]["mean_tpot_s"] is None
    assert minute["classes"]["batch"] == GoodputReader(redis_client, "c").window(60, slo_class="batch", now=NOW).to_dict()


def test_summary_of_an_empty_cluster(redis_client):
    summary = GoodputReader(redis_client, "empty").summary(now=NOW)
    for name, window_s in GoodputReader.WINDOWS.items():
        assert summary[name]["workers"] == summary[name]["classes"] == {}
        assert summary[name]["cluster"] == GoodputWindow(window_s, 0, 0, 0, 0, 0, None, None, 0.0, 0.0).to_dict()


def test_the_workload_s_shape_and_offered_rate(redis_client):
    """Placed requests carry their prompt and output tokens; a refusal (no tokens known) counts
    in the offered rate but not in the means: (100 + 300) / 2 prompt, (20 + 60) / 2 output."""
    records = [replace(req("a", at=T0 + 1), prompt_tokens=100, output_tokens=20),
               replace(req("b", at=T0 + 2), prompt_tokens=300, output_tokens=60),
               req("refused", decode=None, prefill=None, ttft=None, tpot=None, failed=True, at=T0 + 3)]
    record_all(redis_client, "shape", records)
    w = GoodputReader(redis_client, "shape").window(60, now=NOW)
    assert (w.mean_prompt_tokens, w.mean_output_tokens) == (200, 40)
    assert w.rate_rps == pytest.approx(3 / 29)
