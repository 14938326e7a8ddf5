"""Per-request timings and the figures made of them: TTFT, TPOT, ITL and end-to-end latency
(mean, p50, p90, p99), request and token throughput, prefix-cache hit rate, and goodput and
SLO attainment.

Definitions (the same for a measured run and a simulated one):

- TTFT: from sending the request to the first token (at the client);
- TPOT: (end - first token) / (output tokens - 1), for requests of at least two tokens;
- ITL: the gaps between successive messages that carry tokens; a message carrying k tokens
  counts k gaps of gap / k, so the mean ITL of a request is its TPOT;
- goodput: DistServe's, requests per second that did not fail and met both their TTFT and
  TPOT objectives (a missing objective counts as met, and so does TPOT for a one-token
  answer): ``cluster.registry.goodput.RequestRecord.met``, the registry's own rule;
  attainment is the fraction of requests that did; rates are over the run's span (first
  request sent to last one ended);
- rejected: refused by the server's admission control (HTTP 429, gRPC RESOURCE_EXHAUSTED), at
  once and with a ``Retry-After``: not a failure, but not met either.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from cluster.registry.goodput import RequestRecord

PERCENTILES = (50, 90, 99)
ATTAINMENT_GOAL = 0.9


@dataclass
class RequestResult:
    request_id: str
    slo_class: str | None
    prompt_tokens: int
    sent_at: float  # seconds on the run's clock
    first_token_at: float | None = None
    finished_at: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) of each token message
    completion_tokens: int = 0
    cached_tokens: int | None = None  # from the server's usage, when it reports it
    error: str | None = None  # a status name (RESOURCE_EXHAUSTED, ...) or a short reason
    output_token_ids: list[int] = field(default_factory=list)
    placement: tuple[str, str] | None = None
    retried: int = 0  # sent again on a new connection: a kept-alive one failed before any answer
    rejected: bool = False  # refused by admission control (429 / RESOURCE_EXHAUSTED); finished_at: when
    retry_after_s: float | None = None  # what the refusal said (retry-after-ms, else Retry-After)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished_at is not None

    @property
    def failed(self) -> bool:
        return not self.ok and not self.rejected

    @property
    def ttft_s(self) -> float | None:
        return self.first_token_at - self.sent_at if self.first_token_at is not None else None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.completion_tokens < 2 or self.first_token_at is None:
            return None
        return (self.finished_at - self.first_token_at) / (self.completion_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return self.finished_at - self.sent_at if self.ok else None

    def itl_s(self) -> list[float]:
        gaps = []
        for (before, _), (at, tokens) in zip(self.chunks, self.chunks[1:]):
            if tokens > 0:
                gaps += [(at - before) / tokens] * tokens
        return gaps

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("output_token_ids")
        return data


@dataclass(frozen=True)
class Objectives:
    """TTFT and TPOT objectives in seconds (None: none)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def describe(self) -> str:
        parts = [f"{name} <= {value * 1000:g} ms" for name, value in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s))
                 if value is not None]
        return ", ".join(parts) or "none"


def class_objectives(router_config) -> dict[str, Objectives]:
    """Each SLO class of a router configuration, by name, as the objectives it is judged by."""
    return {c.name: Objectives(c.ttft_s, c.tpot_s) for c in router_config.slo_classes}


def parse_objectives(items: Sequence[str]) -> Objectives:
    """``ttft_ms:500 tpot_ms:50`` (either or both); ValueError naming --goodput otherwise."""
    values: dict[str, float] = {}
    for item in items:
        name, _, number = str(item).partition(":")
        if name not in ("ttft_ms", "tpot_ms") or not number:
            raise ValueError(f"--goodput: expected ttft_ms:N and/or tpot_ms:N, got {str(item)[:100]!r}")
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"--goodput: {name} must be a number of milliseconds, got {number[:100]!r}") from None
        if not value > 0:
            raise ValueError(f"--goodput: {name} must be positive, got {number[:100]!r}")
        values[name[:4] + "_s"] = value / 1000.0
    return Objectives(**values)


def record_of(result: RequestResult, objectives: Objectives) -> RequestRecord:
    """The result as the registry's goodput record: the one definition of meeting an SLO."""
    return RequestRecord(result.request_id, result.slo_class or "", None, None, result.ttft_s, result.tpot_s,
                         objectives.ttft_s, objectives.tpot_s, failed=not result.ok)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict:
    """mean and p50/p90/p99 of seconds, in milliseconds (None for no values)."""
    values = [v for v in values if v is not None]

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1000.0

    out = {"mean_ms": ms(sum(values) / len(values)) if values else None}
    out.update({f"p{q}_ms": ms(percentile(values, q)) for q in PERCENTILES})
    out["count"] = len(values)
    return out


def span_s(results: Sequence[RequestResult]) -> float:
    """From the first request sent to the last one ended (or sent, for failures)."""
    if not results:
        return 0.0
    start = min(r.sent_at for r in results)
    end = max((r.finished_at if r.finished_at is not None else r.sent_at) for r in results)
    return max(end - start, 1e-9)


def goodput(results: Sequence[RequestResult], objectives_of, duration_s: float | None = None) -> dict:
    """Goodput (met requests per second), attainment and what was met, for results whose
    objectives ``objectives_of(result)`` gives."""
    records = [record_of(r, objectives_of(r)) for r in results]
    duration = duration_s if duration_s is not None else span_s(results)
    met = sum(rec.met for rec in records)
    return {
        "requests": len(records),
        "met": met,
        "ttft_met": sum(rec.met_ttft and not rec.failed for rec in records),
        "tpot_met": sum(rec.met_tpot and not rec.failed for rec in records),
        "failed": sum(r.failed for r in results),
        "rejected": sum(r.rejected for r in results),
        "goodput_rps": met / duration if duration > 0 else 0.0,
        "attainment": met / len(records) if records else 0.0,
    }


def summarize(results: Sequence[RequestResult], objectives: Objectives | None = None,
              class_objectives: Mapping[str, Objectives] | None = None, default_class: str | None = None) -> dict:
    """Every figure of a run. ``objectives`` (from the command line) apply to every request;
    without them each request is judged by its SLO class's (``class_objectives``): one sent
    without a class by ``default_class``'s, the class the server gives it (a Tandem router's
    ``default_class``; None where it is not known), and a request of no known class meets
    everything."""
    class_objectives = dict(class_objectives or {})

    def class_of(result: RequestResult) -> str:
        return result.slo_class or default_class or ""

    def objectives_of(result: RequestResult) -> Objectives:
        if objectives is not None:
            return objectives
        return class_objectives.get(class_of(result), Objectives())

    ok = [r for r in results if r.ok]
    duration = span_s(results)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    completion = sum(r.completion_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if r.failed:
            key = (r.error or "unfinished").split(":")[0][:60]
            errors[key] = errors.get(key, 0) + 1
    classes = sorted({class_of(r) for r in results})
    summary = {
        "requests": len(results),
        "completed": len(ok),
        "failed": sum(r.failed for r in results),
        "rejected": sum(r.rejected for r in results),
        "time_to_reject": distribution([r.finished_at - r.sent_at for r in results
                                        if r.rejected and r.finished_at is not None]),
        "retry_after": distribution([r.retry_after_s for r in results if r.rejected]),
        "errors": errors,
        "retried": sum(r.retried for r in results),
        "duration_s": duration,
        "request_throughput_rps": len(ok) / duration if duration else 0.0,
        "input_token_throughput": prompt / duration if duration else 0.0,
        "output_token_throughput": completion / duration if duration else 0.0,
        "prefix_cache_hit_rate": (sum(cached) / sum(r.prompt_tokens for r in ok if r.cached_tokens is not None)
                                  if cached and prompt else None),
        "ttft": distribution([r.ttft_s for r in ok]),
        "tpot": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl": distribution([gap for r in ok for gap in r.itl_s()]),
        "e2e": distribution([r.e2e_s for r in ok]),
        "objectives": (objectives.describe() if objectives is not None else
                       {name: o.describe() for name, o in class_objectives.items()}),
        "goodput": goodput(results, objectives_of, duration),
    }
    if len(classes) > 1 or (classes and classes[0]):
        summary["classes"] = {name or "(none)": goodput([r for r in results if class_of(r) == name],
                                                        objectives_of, duration) for name in classes}
    return summary


def sweep_goodput(points: Sequence[tuple[float, dict]], goal: float = ATTAINMENT_GOAL) -> float | None:
    """DistServe's goodput of a sweep: the highest offered rate whose attainment met ``goal``."""
    meeting = [rate for rate, summary in points if summary["goodput"]["attainment"] >= goal]
    return max(meeting) if meeting else None
