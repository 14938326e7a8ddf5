"""Request traces with OpenTelemetry: one trace per request, a span for each phase, so that an
operator can see where a slow request spent its time.

    tandem.request        arrival at the API to its last message (outcome, tokens, TTFT, TPOT)
    ├── admission         checking and tokenizing the request
    ├── placement         the router's answer: the chosen pair, its predicted TTFT and TPOT, the
    │                     objectives, prefix hits, time waited in the router's queue
    ├── prefill           on the prefill worker (or on the decode worker itself: ``local``)
    ├── kv_transfer       the KV landing in the decode worker's blocks (overlaps the prefill
    │                     when layers stream)
    ├── kv_pull           a local prefill's pull of the prefix a peer decode worker caches: from
    │                     the ask to the last layer received; the blocks pulled (error: none, and
    │                     the prefix was computed instead)
    └── decode            the decode worker's batch, from admission to the last token; its
                          tokens, and the speculative guesses checked and kept for them

A request that moved after a worker failed has a placement, prefill, KV transfer and decode
span per attempt (``tandem.attempt``), the failed ones with an error status.

The ingress records the whole trace when the request ends, from its journey: the decode worker
reports when its prefill call, its KV receive and the admission into its batch happened (in the
first item it streams), so spans measured in several processes leave through one exporter, the
ingress's, and no worker node needs a route to the collector. Times measured on other machines
carry their clock's skew. A caller's W3C ``traceparent`` (gRPC metadata) makes the request's
trace a child of the caller's.

The topology's ``observability.tracing`` picks the exporter: ``none`` (the default: nothing is
recorded), ``console`` (spans printed as JSON to the replica's stdout), ``otlp`` (OTLP over
gRPC to ``endpoint``; needs ``pip install 'tandem[tracing]'``) or ``memory`` (kept in the
process, for tests: :func:`memory_exporter`). OpenTelemetry's SDK is optional: without it,
tracing is off and says so once.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.ingress.request_path import Journey
    from cluster.topology import TracingSpec

log = logging.getLogger(__name__)

ERROR_OUTCOMES = ("invalid", "not_found", "rejected", "unavailable", "error")
_memory = None


def memory_exporter():
    """The in-process exporter of ``exporter: memory`` (created on first use)."""
    global _memory
    if _memory is None:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        _memory = InMemorySpanExporter()
    return _memory


def request_tracer(spec: "TracingSpec", cluster: str) -> "RequestTracer | None":
    """The tracer the topology asks for, or None (tracing off, or OpenTelemetry missing)."""
    if spec.exporter == "none":
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
    except ImportError:
        print("[tandem] observability.tracing: OpenTelemetry's SDK is not installed (pip install "
              "'tandem[tracing]'); requests are not traced", file=sys.stderr, flush=True)
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": spec.service_name, "tandem.cluster": cluster}),
                              sampler=ParentBasedTraceIdRatio(spec.sample_ratio))
    if spec.exporter == "memory":
        provider.add_span_processor(SimpleSpanProcessor(memory_exporter()))
    elif spec.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            print("[tandem] observability.tracing.exporter: otlp needs opentelemetry-exporter-otlp-proto-grpc "
                  "(pip install 'tandem[tracing]'); requests are not traced", file=sys.stderr, flush=True)
            return None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=spec.endpoint)
                                                       if spec.endpoint else OTLPSpanExporter()))
    return RequestTracer(provider)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Turns a finished request's journey into its spans (see the module's docstring)."""

    def __init__(self, provider):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("tandem")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()

    def record(self, journey: "Journey", api: str, traceparent: str | None = None, ended_at: float | None = None) -> None:
        trace = self._trace
        parent = self._propagator.extract({"traceparent": traceparent}) if traceparent else None
        end = ended_at or journey.finished_at or journey.arrival
        root = self.tracer.start_span("tandem.request", context=parent, kind=trace.SpanKind.SERVER,
                                      start_time=_ns(journey.arrival), attributes={
                                          "tandem.request_id": journey.request_id, "tandem.api": api,
                                          "tandem.slo_class": journey.slo_class,
                                          "tandem.prompt_tokens": journey.prompt_tokens,
                                          "tandem.cached_tokens": journey.cached_tokens,
                                          "tandem.completion_tokens": len(journey.tokens),
                                          "tandem.outcome": journey.outcome, "tandem.migrations": journey.attempt})
        for name, value in (("tandem.ttft_ms", journey.ttft_s()), ("tandem.tpot_ms", journey.tpot_s())):
            if value is not None:
                root.set_attribute(name, value * 1000)
        inside = trace.set_span_in_context(root)

        def span(name: str, start: float, stop: float, attributes: dict, error: str | None = None):
            child = self.tracer.start_span(name, context=inside, start_time=_ns(start),
                                           attributes={k: v for k, v in attributes.items() if v is not None})
            if error:
                child.set_status(trace.Status(trace.StatusCode.ERROR, error))
            child.end(end_time=_ns(max(start, stop)))

        if journey.checked_at is not None:
            span("admission", journey.arrival, journey.checked_at, {"tandem.prompt_tokens": journey.prompt_tokens})
        for number, attempt in enumerate(journey.attempts):
            self._attempt(span, number, attempt, journey, end)
        if journey.outcome in ERROR_OUTCOMES:
            root.set_status(trace.Status(trace.StatusCode.ERROR, journey.outcome))
        root.end(end_time=_ns(max(journey.arrival, end)))

    @staticmethod
    def _attempt(span, number: int, attempt, journey: "Journey", end: float) -> None:
        d = attempt.decision
        ms = (lambda s: None if s is None else s * 1000)
        span("placement", attempt.requested_at, attempt.decided_at, {
            "tandem.attempt": number, "tandem.placement.action": d.action, "tandem.placement.prefill": d.prefill or "",
            "tandem.placement.decode": d.decode or "", "tandem.placement.path": "local" if d.prefill is None else "remote",
            "tandem.placement.predicted_ttft_ms": ms(d.predicted_ttft_s),
            "tandem.placement.predicted_tpot_ms": ms(d.predicted_tpot_s),
            "tandem.placement.ttft_objective_ms": ms(d.ttft_objective_s),
            "tandem.placement.tpot_objective_ms": ms(d.tpot_objective_s),
            "tandem.placement.prefill_hit_blocks": d.prefill_hit_blocks,
            "tandem.placement.decode_hit_blocks": d.decode_hit_blocks,
            "tandem.placement.load_only": d.load_only, "tandem.placement.waited_ms": ms(d.waited_s),
            "tandem.placement.reason": d.reason or None}, d.reason if d.action == "reject" else None)
        if d.action != "place":
            return
        stop = attempt.ended_at or end
        failure = attempt.failure
        transfer = attempt.transfer
        first = attempt.first_token_at
        if d.prefill is None and attempt.pull is not None:  # it pulled a peer's cached prefix first
            pull = attempt.pull
            span("kv_pull", *pull.span, {
                "tandem.attempt": number, "tandem.kv.from": pull.source, "tandem.kv.to": d.decode,
                "tandem.kv.blocks_asked": pull.blocks_asked, "tandem.kv.blocks_cached_on_decode": pull.blocks_held,
                "tandem.kv.blocks_pulled": pull.blocks_pulled, "tandem.kv.bytes": pull.bytes}, pull.error)
        if d.prefill is None:  # the decode worker prefilled it itself, up to its first token
            span("prefill", attempt.decided_at, first or stop, {"tandem.attempt": number, "tandem.worker": d.decode,
                                                                "tandem.prefill.local": True},
                 failure if first is None else None)
            started_decode = first
        elif transfer is not None:
            span("prefill", *transfer.prefill_span, {"tandem.attempt": number, "tandem.worker": d.prefill,
                                                     "tandem.prefill.local": False,
                                                     "tandem.prefill.cached_tokens": transfer.prefill_cached_tokens})
            span("kv_transfer", *transfer.receive_span, {
                "tandem.attempt": number, "tandem.kv.from": d.prefill, "tandem.kv.to": d.decode,
                "tandem.kv.blocks_sent": transfer.blocks_sent, "tandem.kv.bytes": transfer.bytes,
                "tandem.kv.draft_bytes": transfer.draft_bytes,  # of those, the draft model's KV of the prompt
                "tandem.kv.blocks_cached_on_decode": transfer.blocks_cached_on_decode})
            started_decode = transfer.admitted_at
        else:  # it failed before the KV landed: one span for the whole hand-off
            span("prefill", attempt.decided_at, stop, {"tandem.attempt": number, "tandem.worker": d.prefill,
                                                       "tandem.prefill.local": False}, failure or "no KV arrived")
            return
        if started_decode is not None:
            span("decode", started_decode, stop, {"tandem.attempt": number, "tandem.worker": d.decode,
                                                  "tandem.decode.tokens": attempt.tokens,
                                                  "tandem.decode.proposed_tokens": attempt.proposed_tokens,
                                                  "tandem.decode.accepted_tokens": attempt.accepted_tokens}, failure)

    def shutdown(self) -> None:
        self.provider.shutdown()
