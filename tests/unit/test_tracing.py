"""A request's journey becomes one trace: the request span and, under it, admission, placement
(with the decision and its predictions), prefill, KV transfer and decode, at the times the
journey recorded; a migrated request has a set per attempt, the failed one marked as an error;
a caller's traceparent makes the request a child of the caller's trace; tracing off costs nothing."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from cluster.ingress.request_path import Attempt, Journey  # noqa: E402
from cluster.protocol.messages import PullReport, TransferReport  # noqa: E402
from cluster.topology import TracingSpec  # noqa: E402
from cluster.ingress.tracing import memory_exporter, request_tracer  # noqa: E402
from router.router import Decision  # noqa: E402

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0


@pytest.fixture
def spans():
    exporter = memory_exporter()
    exporter.clear()
    tracer = request_tracer(TracingSpec(exporter="memory"), "c1")

    def record(journey: Journey, traceparent: str | None = None):
        tracer.record(journey, "grpc", traceparent, journey.finished_at + 0.001)
        return {s.name: s for s in exporter.get_finished_spans()}, list(exporter.get_finished_spans())

    yield record
    exporter.clear()


def decision(prefill: str | None, decode: str = "decode-0") -> Decision:
    return Decision("place", "r1", prefill, decode, "standard", 5.0, 0.25, predicted_ttft_s=0.12,
                    predicted_tpot_s=0.02, prefill_hit_blocks=1, decode_hit_blocks=0, waited_s=0.003)


def served_journey() -> Journey:
    journey = Journey("r1", T0, 40, "standard", checked_at=T0 + 0.001, first_token_at=T0 + 0.2,
                      finished_at=T0 + 0.5, tokens=list(range(8)), outcome="length")
    transfer = TransferReport(prefill="prefill-0", blocks_sent=3, bytes=4096, blocks_cached_on_decode=0,
                              prefill_cached_tokens=16, prefill_span=(T0 + 0.02, T0 + 0.15),
                              receive_span=(T0 + 0.02, T0 + 0.16), admitted_at=T0 + 0.17, draft_bytes=1024)
    journey.attempts.append(Attempt(T0 + 0.002, T0 + 0.01, decision("prefill-0"), transfer, T0 + 0.2, 8, T0 + 0.5,
                                    proposed_tokens=12, accepted_tokens=5))
    return journey


def test_one_trace_with_every_phase(spans):
    by_name, every = spans(served_journey())
    assert set(by_name) == {"tandem.request", "admission", "placement", "prefill", "kv_transfer", "decode"}
    root = by_name["tandem.request"]
    assert root.parent is None and len({s.context.trace_id for s in every}) == 1
    assert all(s.parent.span_id == root.context.span_id for s in every if s is not root)
    assert root.attributes["tandem.request_id"] == "r1" and root.attributes["tandem.outcome"] == "length"
    assert root.attributes["tandem.completion_tokens"] == 8 and root.attributes["tandem.ttft_ms"] == pytest.approx(200)
    placement = by_name["placement"].attributes
    assert (placement["tandem.placement.prefill"], placement["tandem.placement.decode"]) == ("prefill-0", "decode-0")
    assert placement["tandem.placement.predicted_ttft_ms"] == pytest.approx(120)
    assert placement["tandem.placement.path"] == "remote" and placement["tandem.placement.waited_ms"] == pytest.approx(3)
    assert by_name["kv_transfer"].attributes["tandem.kv.bytes"] == 4096
    assert by_name["kv_transfer"].attributes["tandem.kv.draft_bytes"] == 1024  # the draft's KV of the prompt, sent too
    assert by_name["prefill"].attributes["tandem.prefill.cached_tokens"] == 16
    decode = by_name["decode"].attributes  # speculation: guesses checked and kept for this request
    assert (decode["tandem.decode.tokens"], decode["tandem.decode.proposed_tokens"],
            decode["tandem.decode.accepted_tokens"]) == (8, 12, 5)
    ns = 1e9
    assert by_name["prefill"].start_time == pytest.approx((T0 + 0.02) * ns, abs=1e3)
    assert by_name["decode"].start_time == pytest.approx((T0 + 0.17) * ns, abs=1e3)
    assert by_name["decode"].end_time == pytest.approx((T0 + 0.5) * ns, abs=1e3)
    assert by_name["admission"].end_time <= by_name["placement"].start_time
    assert all(s.status.is_ok for s in every)


def test_a_local_prefill_and_a_migration(spans):
    journey = Journey("r2", T0, 40, "standard", checked_at=T0 + 0.001, first_token_at=T0 + 0.3, finished_at=T0 + 1,
                      tokens=list(range(4)), outcome="length", attempt=1)
    journey.attempts = [
        Attempt(T0 + 0.01, T0 + 0.02, decision(None, "decode-0"), None, T0 + 0.3, 2, T0 + 0.4,
                "decode worker decode-0 died"),
        Attempt(T0 + 0.41, T0 + 0.42, decision(None, "decode-1"), None, T0 + 0.6, 2, T0 + 1),
    ]
    _, every = spans(journey)
    names = [(s.name, s.attributes.get("tandem.attempt"), s.status.is_ok) for s in every if s.name != "admission"]
    assert ("decode", 0, False) in names and ("decode", 1, True) in names
    assert ("prefill", 0, True) in names and ("prefill", 1, True) in names
    assert not any(name == "kv_transfer" for name, _, _ in names)
    locals_ = [s for s in every if s.name == "prefill"]
    assert all(s.attributes["tandem.prefill.local"] for s in locals_)
    root = next(s for s in every if s.name == "tandem.request")
    assert root.attributes["tandem.migrations"] == 1


def test_a_pull_of_a_peers_prefix_and_one_that_failed(spans):
    """A local prefill that pulled a peer's cached prefix first has a kv_pull span with the
    blocks asked, held and pulled; a pull that failed (then recomputed) is an error span, and
    the request is not."""
    journey = Journey("r4", T0, 80, "standard", checked_at=T0 + 0.001, first_token_at=T0 + 0.3, finished_at=T0 + 1,
                      tokens=list(range(4)), outcome="length", attempt=1)
    pulled = PullReport("decode-0", 5, 2, 3, 3 * 4096, (T0 + 0.03, T0 + 0.08))
    failed = PullReport("decode-0", 5, 0, 0, 0, (T0 + 0.43, T0 + 0.55), "decode-0 did not answer within 0.1s")
    journey.attempts = [
        Attempt(T0 + 0.01, T0 + 0.02, decision(None, "decode-1"), None, T0 + 0.3, 2, T0 + 0.4,
                "decode worker decode-1 died", pull=pulled),
        Attempt(T0 + 0.41, T0 + 0.42, decision(None, "decode-2"), None, T0 + 0.6, 2, T0 + 1, pull=failed),
    ]
    _, every = spans(journey)
    pulls = [s for s in every if s.name == "kv_pull"]
    assert [(s.attributes["tandem.attempt"], s.attributes["tandem.kv.from"], s.attributes["tandem.kv.to"],
             s.attributes["tandem.kv.blocks_asked"], s.attributes["tandem.kv.blocks_cached_on_decode"],
             s.attributes["tandem.kv.blocks_pulled"], s.attributes["tandem.kv.bytes"], s.status.is_ok)
            for s in pulls] == [(0, "decode-0", "decode-1", 5, 2, 3, 3 * 4096, True),
                                (1, "decode-0", "decode-2", 5, 0, 0, 0, False)]
    assert pulls[1].status.description == "decode-0 did not answer within 0.1s"
    assert pulls[0].start_time == pytest.approx((T0 + 0.03) * 1e9, abs=1e3)
    assert pulls[0].end_time == pytest.approx((T0 + 0.08) * 1e9, abs=1e3)
    root = next(s for s in every if s.name == "tandem.request")
    assert root.status.is_ok


def test_a_rejected_request_and_the_callers_trace(spans):
    journey = Journey("r3", T0, 10, "interactive", checked_at=T0 + 0.001, finished_at=T0 + 0.01, outcome="rejected")
    journey.attempts = [Attempt(T0 + 0.002, T0 + 0.004, Decision("reject", "r3", reason="too slow"))]
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    by_name, every = spans(journey, caller)
    assert set(by_name) == {"tandem.request", "admission", "placement"}
    root = by_name["tandem.request"]
    assert format(root.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(root.parent.span_id, "016x") == "b7ad6b7169203331"
    assert not root.status.is_ok and not by_name["placement"].status.is_ok


def test_tracing_off_is_no_tracer():
    assert request_tracer(TracingSpec(), "c1") is None


def test_a_moved_request_teaches_no_tpot():
    """The router learns its TPOT scale only from requests that streamed from one placement: a
    moved one's TPOT spans its worker's failure."""
    kept = Journey("r4", T0, 10, "standard", first_token_at=T0 + 0.1, finished_at=T0 + 0.5, tokens=list(range(5)))
    assert kept.steady_tpot_s() == kept.tpot_s() == pytest.approx(0.1)
    kept.attempt = 1
    assert kept.tpot_s() == pytest.approx(0.1) and kept.steady_tpot_s() is None


def test_a_failed_pull_teaches_no_ttft_correction():
    """The router's TTFT correction is learned from the time after placement, but not where a
    pull of a peer's prefix failed: its request waited for the peer up to kv.pull_timeout_s."""
    from cluster.ingress.request_path import _service_ttft

    journey = Journey("r5", T0, 10, "standard", first_token_at=T0 + 3.2, finished_at=T0 + 3.5)
    attempt = Attempt(T0, T0 + 0.001, Decision("place", "r5", decode="d1"), placed_at=T0 + 0.002)
    attempt.pull = PullReport("d0", 4, 2, 2, 4096, (T0 + 0.003, T0 + 0.01))
    assert _service_ttft(journey, attempt) == pytest.approx(3.198)
    attempt.pull = PullReport("d0", 4, 2, 0, 0, (T0 + 0.003, T0 + 3.1), "d0 did not answer within 3s")
    assert _service_ttft(journey, attempt) is None
