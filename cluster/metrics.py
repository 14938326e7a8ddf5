"""Prometheus metrics through Ray's metrics API (exported by each node's metrics agent).

Names start with ``tandem_``; every metric carries the ``cluster`` tag. Each ingress replica
records requests (by outcome, SLO class and API) and TTFT and TPOT histograms; the router counts
its decisions by policy, action and path, and keeps the queue length and goodput and SLO
attainment per class (read from the registry every few seconds); each worker records its KV
blocks and prefix-cache hit rate, and decode workers the KV bytes and seconds they receive.
"""

from __future__ import annotations

from ray.util import metrics

LATENCY_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TOKEN_BOUNDARIES_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


class IngressMetrics:
    """Each ingress replica's: requests by outcome, SLO class and API, TTFT and TPOT as the
    caller saw them (from the call's arrival)."""

    def __init__(self, cluster: str):
        self.tags = {"cluster": cluster}
        self.requests = metrics.Counter("tandem_requests", "finished requests by outcome, SLO class and API",
                                        tag_keys=("cluster", "outcome", "slo_class", "api"))
        self.ttft = metrics.Histogram("tandem_ttft_seconds", "time to first token", LATENCY_BOUNDARIES_S,
                                      tag_keys=("cluster", "slo_class", "api"))
        self.tpot = metrics.Histogram("tandem_tpot_seconds", "time per output token after the first",
                                      TOKEN_BOUNDARIES_S, tag_keys=("cluster", "slo_class", "api"))

    def finished(self, outcome: str, slo_class: str, ttft_s: float | None, tpot_s: float | None, api: str) -> None:
        tags = {**self.tags, "slo_class": slo_class, "api": api}
        self.requests.inc(1, {**tags, "outcome": outcome})
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, tags)


class SloMetrics:
    """The router's gauges: requests waiting for placement, and goodput and attainment per
    class over the last minute (as the registry computes them)."""

    def __init__(self, cluster: str):
        self.tags = {"cluster": cluster}
        self.queue = metrics.Gauge("tandem_queue_length", "requests waiting for placement", tag_keys=("cluster",))
        self.goodput = metrics.Gauge("tandem_goodput_rps", "requests per second that met both objectives, last "
                                     "minute", tag_keys=("cluster", "slo_class"))
        self.attainment = metrics.Gauge("tandem_slo_attainment", "share of requests that met both objectives, "
                                        "last minute", tag_keys=("cluster", "slo_class"))

    def queue_length(self, n: int) -> None:
        self.queue.set(n, self.tags)

    def slo(self, summary: dict | None) -> None:
        if not summary:
            return
        for name, window in summary["last_minute"]["classes"].items():
            tags = {**self.tags, "slo_class": name}
            self.goodput.set(window["goodput_rps"], tags)
            self.attainment.set(window["attainment"], tags)


class WorkerMetrics:
    def __init__(self, cluster: str, worker: str, role: str):
        self.tags = {"cluster": cluster, "worker": worker, "role": role}
        keys = ("cluster", "worker", "role")
        self.used = metrics.Gauge("tandem_kv_blocks_used", "KV blocks in use", tag_keys=keys)
        self.free = metrics.Gauge("tandem_kv_blocks_free", "KV blocks free (cached blocks count as free)",
                                  tag_keys=keys)
        self.hit_rate = metrics.Gauge("tandem_prefix_cache_hit_rate", "prompt tokens served from the prefix cache",
                                      tag_keys=keys)
        self.kv_bytes = metrics.Counter("tandem_kv_transfer_bytes", "KV bytes received", tag_keys=keys)
        self.kv_seconds = metrics.Counter("tandem_kv_transfer_seconds", "seconds spent receiving KV", tag_keys=keys)

    def blocks(self, used: int, free: int, hit_rate: float) -> None:
        self.used.set(used, self.tags)
        self.free.set(free, self.tags)
        self.hit_rate.set(hit_rate, self.tags)

    def received(self, nbytes: int, seconds: float) -> None:
        self.kv_bytes.inc(nbytes, self.tags)
        self.kv_seconds.inc(seconds, self.tags)


class RouterMetrics:
    def __init__(self, cluster: str, policy: str):
        self.tags = {"cluster": cluster, "policy": policy}
        self.decisions = metrics.Counter("tandem_router_decisions", "placements by policy and action",
                                         tag_keys=("cluster", "policy", "action", "path"))

    def decided(self, decision) -> None:
        path = "load_only" if decision.load_only else ("local" if decision.prefill is None and decision.decode
                                                      else "remote")
        self.decisions.inc(1, {**self.tags, "action": decision.action, "path": path})
