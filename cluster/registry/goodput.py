"""Goodput: how many requests per second the cluster serves within their latency objectives.

Throughput alone rewards a cluster that answers fast on average while many requests miss their
objectives; goodput (as in DistServe) counts only requests that did not fail and met both
their time-to-first-token (TTFT) and time-per-output-token (TPOT) objectives. A missing
objective counts as met, and so does the TPOT objective of a request with fewer than two output
tokens (it has no TPOT).

Records are kept as integer counters in time buckets, so a window costs a bounded number of
keys whatever the request rate:

    tandem:<c>:goodput:s:<second>     HASH  1-second bucket, second = int(finished_at); TTL 130 s
    tandem:<c>:goodput:m:<minute>     HASH  60-second bucket, minute = int(finished_at) // 60; TTL 3720 s
    tandem:<c>:goodput:since          STR   finished_at of the cluster's first record; no TTL

A bucket's fields are ``<scope>|<counter>``. The scopes are ``cluster``, ``worker:<name>`` (the
prefill and the decode worker, once each, or once when they are the same) and
``class:<slo_class>``. The counters are ``n``, ``met``, ``ttft_met``, ``tpot_met``, ``failed``,
and the sums ``ttft_us``/``tpot_us`` (microseconds) with their counts ``ttft_n``/``tpot_n``, and
``prompt_tokens``/``output_tokens`` with their count ``tokens_n`` (the workload's shape, which the
live planner sizes the pools for).

A window of up to 120 s reads the 1-second buckets of its last ``window_s`` seconds. A longer
one (up to an hour) reads the minute buckets covering it; the oldest of those is included
whole, so such a window can reach up to 59 s further back than ``window_s``.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: the engine's command line (tandem run) imports this without Redis
    import redis

from cluster.registry.keys import Keys

SECOND_BUCKET_TTL_S = 130
MINUTE_BUCKET_TTL_S = 3720
SECOND_BUCKETS_UP_TO_S = 120
MAX_WINDOW_S = 3600

CLUSTER_SCOPE = "cluster"
WORKER_SCOPE = "worker:"
CLASS_SCOPE = "class:"

Counts = dict[str, int]


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    slo_class: str
    prefill_worker: str | None      # None when the decode worker prefilled it itself
    decode_worker: str | None       # None when it failed before placement
    ttft_s: float | None            # None when no token came (failed)
    tpot_s: float | None            # None with fewer than 2 output tokens
    ttft_objective_s: float | None  # None: no objective
    tpot_objective_s: float | None
    failed: bool = False
    finished_at: float = 0.0        # wall clock (time.time()); 0 means "now" when recorded
    prompt_tokens: int = 0          # of a placed request (0: not known, as for a refusal) ...
    output_tokens: int = 0          # ... and the tokens it generated

    @property
    def met_ttft(self) -> bool:
        if self.ttft_objective_s is None:
            return True
        return self.ttft_s is not None and self.ttft_s <= self.ttft_objective_s

    @property
    def met_tpot(self) -> bool:
        if self.tpot_objective_s is None or self.tpot_s is None:
            return True
        return self.tpot_s <= self.tpot_objective_s

    @property
    def met(self) -> bool:
        return not self.failed and self.met_ttft and self.met_tpot


@dataclass(frozen=True)
class GoodputWindow:
    window_s: float
    requests: int
    met: int
    ttft_met: int
    tpot_met: int
    failed: int
    mean_ttft_s: float | None
    mean_tpot_s: float | None
    goodput_rps: float      # met / span, span = min(window_s, now - first record of the cluster), at least 1 s
    attainment: float       # met / requests; 0.0 with no requests
    mean_prompt_tokens: float | None = None  # of the placed requests that ended in the window
    mean_output_tokens: float | None = None
    rate_rps: float = 0.0   # requests / span: what was offered, refused ones included

    def to_dict(self) -> dict:
        return asdict(self)


class _GoodputKeys:
    def __init__(self, cluster: str):
        self.prefix = Keys(cluster).prefix + "goodput:"

    @property
    def since(self) -> str:
        return self.prefix + "since"

    def second(self, second: int) -> str:
        return f"{self.prefix}s:{second}"

    def minute(self, minute: int) -> str:
        return f"{self.prefix}m:{minute}"


class GoodputRecorder:
    def __init__(self, client: redis.Redis, cluster: str):
        self.client, self.keys = client, _GoodputKeys(cluster)

    def record(self, record: RequestRecord) -> None:
        finished_at = record.finished_at or time.time()
        counts = _counts(record)
        scopes = [CLUSTER_SCOPE, CLASS_SCOPE + record.slo_class]
        scopes += [WORKER_SCOPE + w for w in dict.fromkeys((record.prefill_worker, record.decode_worker)) if w]
        second = int(finished_at)
        pipe = self.client.pipeline(transaction=True)
        for key, ttl in ((self.keys.second(second), SECOND_BUCKET_TTL_S),
                         (self.keys.minute(second // 60), MINUTE_BUCKET_TTL_S)):
            for scope in scopes:
                for counter, value in counts.items():
                    pipe.hincrby(key, f"{scope}|{counter}", value)
            pipe.expire(key, ttl)
        pipe.set(self.keys.since, repr(float(finished_at)), nx=True)
        pipe.execute()


def _counts(record: RequestRecord) -> Counts:
    """The counters the record adds to, less those it leaves at zero."""
    counts = {"n": 1, "met": int(record.met), "ttft_met": int(record.met_ttft),
              "tpot_met": int(record.met_tpot), "failed": int(record.failed)}
    if record.ttft_s is not None:
        counts.update(ttft_us=round(record.ttft_s * 1e6), ttft_n=1)
    if record.tpot_s is not None:
        counts.update(tpot_us=round(record.tpot_s * 1e6), tpot_n=1)
    if record.prompt_tokens:
        counts.update(prompt_tokens=record.prompt_tokens, output_tokens=record.output_tokens, tokens_n=1)
    return {counter: value for counter, value in counts.items() if value}


class GoodputReader:
    WINDOWS = {"last_minute": 60, "last_hour": 3600}

    def __init__(self, client: redis.Redis, cluster: str):
        self.client, self.keys = client, _GoodputKeys(cluster)

    def window(self, window_s: float, worker: str | None = None, slo_class: str | None = None,
               now: float | None = None) -> GoodputWindow:
        """The cluster's goodput over the window, or one worker's, or one SLO class's."""
        if worker is not None and slo_class is not None:
            raise ValueError("give a worker or an SLO class, not both")
        now = time.time() if now is None else now
        scope = (WORKER_SCOPE + worker if worker is not None
                 else CLASS_SCOPE + slo_class if slo_class is not None else CLUSTER_SCOPE)
        [scopes], since = self._read([self._bucket_keys(window_s, now)])
        return _window(window_s, scopes.get(scope, {}), since, now)

    def window_and_class_requests(self, window_s: float, now: float | None = None
                                  ) -> tuple[GoodputWindow, dict[str, int]]:
        """The cluster's window, and the requests that ended in it per SLO class (one round trip)."""
        now = time.time() if now is None else now
        [scopes], since = self._read([self._bucket_keys(window_s, now)])
        classes = {scope[len(CLASS_SCOPE):]: counts.get("n", 0) for scope, counts in sorted(scopes.items())
                   if scope.startswith(CLASS_SCOPE) and counts.get("n", 0)}
        return _window(window_s, scopes.get(CLUSTER_SCOPE, {}), since, now), classes

    def summary(self, now: float | None = None) -> dict:
        """Each of WINDOWS for the cluster, every worker and every SLO class seen in it."""
        now = time.time() if now is None else now
        per_window, since = self._read([self._bucket_keys(w, now) for w in self.WINDOWS.values()])
        return {name: _scopes_view(window_s, scopes, since, now)
                for (name, window_s), scopes in zip(self.WINDOWS.items(), per_window)}

    def _bucket_keys(self, window_s: float, now: float) -> list[str]:
        if not 0 < window_s <= MAX_WINDOW_S:
            raise ValueError(f"window_s must be in (0, {MAX_WINDOW_S}], got {window_s}")
        last = int(now)
        first = last - math.ceil(window_s) + 1
        if window_s <= SECOND_BUCKETS_UP_TO_S:
            return [self.keys.second(s) for s in range(first, last + 1)]
        return [self.keys.minute(m) for m in range(first // 60, last // 60 + 1)]

    def _read(self, key_lists: list[list[str]]) -> tuple[list[dict[str, Counts]], float | None]:
        """One round trip: the summed counters per scope of each key list, and the cluster's start."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys.since)
        for keys in key_lists:
            for key in keys:
                pipe.hgetall(key)
        results = pipe.execute()
        since = float(results[0]) if results[0] is not None else None
        buckets = iter(results[1:])
        totals = []
        for keys in key_lists:
            scopes: dict[str, Counts] = defaultdict(lambda: defaultdict(int))
            for _ in keys:
                for field, value in next(buckets).items():
                    scope, _, counter = _text(field).rpartition("|")
                    scopes[scope][counter] += int(value)
            totals.append({scope: dict(counts) for scope, counts in scopes.items()})
        return totals, since


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _scopes_view(window_s: float, scopes: dict[str, Counts], since: float | None, now: float) -> dict:
    def view(scope: str) -> dict:
        return _window(window_s, scopes.get(scope, {}), since, now).to_dict()

    return {
        "cluster": view(CLUSTER_SCOPE),
        "workers": {s[len(WORKER_SCOPE):]: view(s) for s in sorted(scopes) if s.startswith(WORKER_SCOPE)},
        "classes": {s[len(CLASS_SCOPE):]: view(s) for s in sorted(scopes) if s.startswith(CLASS_SCOPE)},
    }


def _window(window_s: float, counts: Counts, since: float | None, now: float) -> GoodputWindow:
    requests, met = counts.get("n", 0), counts.get("met", 0)
    span = window_s if since is None else min(window_s, now - since)
    return GoodputWindow(
        window_s=window_s,
        requests=requests,
        met=met,
        ttft_met=counts.get("ttft_met", 0),
        tpot_met=counts.get("tpot_met", 0),
        failed=counts.get("failed", 0),
        mean_ttft_s=_mean_s(counts, "ttft"),
        mean_tpot_s=_mean_s(counts, "tpot"),
        goodput_rps=met / max(1.0, span),
        attainment=met / requests if requests else 0.0,
        mean_prompt_tokens=counts["prompt_tokens"] / counts["tokens_n"] if counts.get("tokens_n") else None,
        mean_output_tokens=counts.get("output_tokens", 0) / counts["tokens_n"] if counts.get("tokens_n") else None,
        rate_rps=requests / max(1.0, span),
    )


def _mean_s(counts: Counts, name: str) -> float | None:
    n = counts.get(f"{name}_n", 0)
    return counts[f"{name}_us"] / n / 1e6 if n else None
