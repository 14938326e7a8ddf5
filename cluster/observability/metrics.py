"""Prometheus metrics through Ray's metrics API (exported by each node's metrics agent).

Names start with ``tandem_`` (Prometheus sees them as ``ray_tandem_...``); every metric carries
the ``cluster`` tag. Each ingress replica records requests (by outcome, SLO class and API), TTFT
and TPOT histograms, the migrations and worker failures its requests met, and whether it is
serving; the router counts its decisions by policy, action and path, and keeps the queue length,
requests in flight, and goodput and SLO attainment per class; each worker records its KV
blocks, prefix-cache hit rate and requests, decode workers the KV bytes and seconds they
receive, and decode and colocated workers the guessed tokens of speculative decoding.

Ray exports a gauge only while it is set again within two report intervals: every gauge here is
set on a timer, busy or idle (the router's every ``GAUGES_EVERY_S``, the workers' with each
registry report, the ingress's with each health check), never only as a side effect of serving.
The dashboard that reads these metrics is ``helm/tandem/dashboards/tandem.json``.
"""

from __future__ import annotations

from ray.util import metrics

MIGRATION_REASONS = ("worker_failed", "retry")
LATENCY_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TOKEN_BOUNDARIES_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


class IngressMetrics:
    """Each ingress replica's: requests by outcome, SLO class and API, TTFT and TPOT as the
    caller saw them (from the call's arrival)."""

    def __init__(self, cluster: str, workers: tuple[str, ...] = ()):
        self.tags = {"cluster": cluster}
        self.requests = metrics.Counter("tandem_requests", "finished requests by outcome, SLO class and API",
                                        tag_keys=("cluster", "outcome", "slo_class", "api"))
        self.ttft = metrics.Histogram("tandem_ttft_seconds", "time to first token", LATENCY_BOUNDARIES_S,
                                      tag_keys=("cluster", "slo_class", "api"))
        self.tpot = metrics.Histogram("tandem_tpot_seconds", "time per output token after the first",
                                      TOKEN_BOUNDARIES_S, tag_keys=("cluster", "slo_class", "api"))

        self.migrations = metrics.Counter("tandem_migrations", "placements after the first (a worker failed "
                                          "under the request, or its KV transfer did)", tag_keys=("cluster", "reason"))
        self.failures = metrics.Counter("tandem_worker_failures", "requests that found a worker dead under them",
                                        tag_keys=("cluster", "worker", "role"))
        self.serving_gauge = metrics.Gauge("tandem_serving", "1 while this ingress replica can serve (a router "
                                           "and a generating worker answer), else 0", tag_keys=("cluster",))
        for reason in MIGRATION_REASONS:
            _start_at_zero(self.migrations, {**self.tags, "reason": reason})
        for worker in workers:
            _start_at_zero(self.failures, {**self.tags, "worker": worker, "role": worker.rpartition("-")[0]})

    def finished(self, outcome: str, slo_class: str, ttft_s: float | None, tpot_s: float | None, api: str) -> None:
        tags = {**self.tags, "slo_class": slo_class, "api": api}
        self.requests.inc(1, {**tags, "outcome": outcome})
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, tags)

    def worker_failed(self, worker: str) -> None:
        self.failures.inc(1, {**self.tags, "worker": worker, "role": worker.rpartition("-")[0]})

    def migrated(self, reason: str) -> None:
        self.migrations.inc(1, {**self.tags, "reason": reason})

    def serving(self, serving: bool) -> None:
        self.serving_gauge.set(1.0 if serving else 0.0, self.tags)


class SloMetrics:
    """A router's gauges: requests waiting for placement and in flight, and per SLO class the
    last minute's goodput, attainment and requests, as the registry computes them (the values
    ``tandem status`` shows). Every class the router knows is set, with or without requests;
    each router sets them (tag ``router``), so dashboards take the max over routers."""

    def __init__(self, cluster: str, router: str, classes: tuple[str, ...] = ()):
        self.tags = {"cluster": cluster, "router": router}
        self.classes = classes
        keys, class_keys = ("cluster", "router"), ("cluster", "router", "slo_class")
        self.queue = metrics.Gauge("tandem_queue_length", "requests waiting for placement", tag_keys=keys)
        self.in_flight = metrics.Gauge("tandem_in_flight", "requests placed and not finished", tag_keys=keys)
        self.goodput = metrics.Gauge("tandem_goodput_rps", "requests per second that met both objectives, last "
                                     "minute", tag_keys=class_keys)
        self.attainment = metrics.Gauge("tandem_slo_attainment", "share of requests that met both objectives, "
                                        "last minute (0 without requests: see tandem_slo_requests)",
                                        tag_keys=class_keys)
        self.requests = metrics.Gauge("tandem_slo_requests", "requests finished in the last minute",
                                      tag_keys=class_keys)
        self.planner_workers = metrics.Gauge("tandem_planner_workers", "the live planner's latest look: workers per "
                                             "role now (split=current) and as it proposes (split=proposed)",
                                             tag_keys=("cluster", "router", "split", "role"))
        self.planner_goodput = metrics.Gauge("tandem_planner_predicted_goodput_rps", "the live planner's latest look: "
                                             "predicted goodput of each split it simulated",
                                             tag_keys=("cluster", "router", "split"))

    def queue_length(self, waiting: int, in_flight: int) -> None:
        self.queue.set(waiting, self.tags)
        self.in_flight.set(in_flight, self.tags)

    def planner(self, latest: dict | None) -> None:
        """The live planner's latest look (``cluster/plan/live/``); None (off, or no look yet) sets nothing."""
        if not latest or "workers" not in latest:
            return
        for split, roles in latest["workers"].items():
            for role, count in roles.items():
                self.planner_workers.set(count, {**self.tags, "split": split, "role": role})
        for split, goodput in latest.get("predictions", {}).items():
            self.planner_goodput.set(goodput, {**self.tags, "split": split})

    def slo(self, summary: dict | None) -> None:
        """Sets every class's gauges from a registry summary; None (the registry unreachable)
        sets nothing, so the gauges age out rather than show stale numbers."""
        if not summary:
            return
        seen = summary["last_minute"]["classes"]
        for name in sorted(set(self.classes) | set(seen)):
            window = seen.get(name, {"goodput_rps": 0.0, "attainment": 0.0, "requests": 0})
            tags = {**self.tags, "slo_class": name}
            self.goodput.set(window["goodput_rps"], tags)
            self.attainment.set(window["attainment"], tags)
            self.requests.set(window["requests"], tags)


class WorkerMetrics:
    """A worker's: its KV blocks, prefix-cache hit rate and requests; a decode worker's KV received
    and transfer groups rebuilt; and a generating worker's speculative decoding (guessed tokens
    proposed and accepted, and the request-steps that checked them: acceptance rate =
    accepted / proposed, tokens per verify = 1 + accepted / verify steps). ``generates``: the
    worker decodes (decode or colocated), so its speculation counters are exported from 0, as
    0 where it does not speculate."""

    def __init__(self, cluster: str, worker: str, role: str, generates: bool = False):
        self.tags = {"cluster": cluster, "worker": worker, "role": role}
        keys = ("cluster", "worker", "role")
        self.used = metrics.Gauge("tandem_kv_blocks_used", "KV blocks in use", tag_keys=keys)
        self.free = metrics.Gauge("tandem_kv_blocks_free", "KV blocks free (cached blocks count as free)",
                                  tag_keys=keys)
        self.hit_rate = metrics.Gauge("tandem_prefix_cache_hit_rate", "prompt tokens served from the prefix cache",
                                      tag_keys=keys)
        self.kv_bytes = metrics.Counter("tandem_kv_transfer_bytes", "KV bytes received", tag_keys=keys)
        self.kv_seconds = metrics.Counter("tandem_kv_transfer_seconds", "seconds spent receiving KV", tag_keys=keys)
        self.kv_transfers = metrics.Counter("tandem_kv_transfers", "KV transfers received", tag_keys=keys)
        self.requests = metrics.Gauge("tandem_worker_requests", "requests on the worker by state: waiting (its "
                                      "queue), running (its batch), receiving (KV landing)",
                                      tag_keys=(*keys, "state"))
        self.pair_rebuilds = metrics.Counter("tandem_kv_pair_rebuilds", "KV transfer groups a decode worker "
                                             "rebuilt (or tried to) after one failed", tag_keys=(*keys, "prefill"))
        self.spec_proposed = metrics.Counter("tandem_spec_proposed_tokens", "speculative decoding: guessed tokens "
                                             "checked", tag_keys=keys)
        self.spec_accepted = metrics.Counter("tandem_spec_accepted_tokens", "speculative decoding: guessed tokens "
                                             "kept (equal to the model's own)", tag_keys=keys)
        self.spec_verifies = metrics.Counter("tandem_spec_verify_steps", "speculative decoding: request-steps that "
                                             "checked guesses", tag_keys=keys)
        self._spec_totals = (0, 0, 0)
        self.host_offloaded = metrics.Counter("tandem_kv_host_offloaded_blocks", "KV blocks copied to the host tier "
                                              "as the device cache evicted them (kv.host_cache)", tag_keys=keys)
        self.host_loaded = metrics.Counter("tandem_kv_host_loaded_blocks", "KV blocks loaded back from the host "
                                           "tier as prefix hits", tag_keys=keys)
        self.host_used = metrics.Gauge("tandem_kv_host_blocks_used", "KV blocks the host tier holds", tag_keys=keys)
        self._host_totals = (0, 0)
        for counter in (self.host_offloaded, self.host_loaded):  # 0 on a worker without a host tier
            _start_at_zero(counter, self.tags)
        self.pulls = metrics.Counter("tandem_kv_pulls", "prefix pulls from a peer decode worker (kv.peer_pull) by "
                                     "outcome: pulled, or recomputed (nothing arrived)", tag_keys=(*keys, "outcome"))
        self.pulled_blocks = metrics.Counter("tandem_kv_pulled_blocks", "KV blocks pulled from peers", tag_keys=keys)
        if generates:
            for counter in (self.spec_proposed, self.spec_accepted, self.spec_verifies):
                _start_at_zero(counter, self.tags)

    def blocks(self, used: int, free: int, hit_rate: float, waiting: int = 0, running: int = 0,
               receiving: int = 0) -> None:
        self.used.set(used, self.tags)
        self.free.set(free, self.tags)
        self.hit_rate.set(hit_rate, self.tags)
        for state, n in (("waiting", waiting), ("running", running), ("receiving", receiving)):
            self.requests.set(n, {**self.tags, "state": state})

    def speculation(self, proposed: int, accepted: int, verify_steps: int) -> None:
        """The engine's speculation totals now: each counter grows by what was added since the last call."""
        totals = (proposed, accepted, verify_steps)
        for counter, now, before in zip((self.spec_proposed, self.spec_accepted, self.spec_verifies), totals,
                                        self._spec_totals):
            if now > before:
                counter.inc(now - before, self.tags)
        self._spec_totals = totals

    def host_tier(self, offloaded: int, loaded: int, used: int) -> None:
        """The engine's host-tier totals now (counters grow by what was added since the last call)
        and the blocks it holds."""
        for counter, now, before in zip((self.host_offloaded, self.host_loaded), (offloaded, loaded),
                                        self._host_totals):
            if now > before:
                counter.inc(now - before, self.tags)
        self._host_totals = (offloaded, loaded)
        self.host_used.set(used, self.tags)

    def pulled(self, blocks: int, arrived: bool) -> None:
        self.pulls.inc(1, {**self.tags, "outcome": "pulled" if arrived else "recomputed"})
        if blocks:
            self.pulled_blocks.inc(blocks, self.tags)

    def pair_rebuilt(self, prefill: str) -> None:
        self.pair_rebuilds.inc(1, {**self.tags, "prefill": prefill})

    def received(self, nbytes: int, seconds: float) -> None:
        self.kv_transfers.inc(1, self.tags)
        if nbytes:
            self.kv_bytes.inc(nbytes, self.tags)
        if seconds > 0:
            self.kv_seconds.inc(seconds, self.tags)


class RouterMetrics:
    def __init__(self, cluster: str, policy: str):
        self.tags = {"cluster": cluster, "policy": policy}
        self.decisions = metrics.Counter("tandem_router_decisions", "placements by policy and action",
                                         tag_keys=("cluster", "policy", "action", "path"))
        self.rejections = metrics.Counter("tandem_router_rejections", "requests refused (HTTP 429, gRPC "
                                          "RESOURCE_EXHAUSTED) by SLO class", tag_keys=("cluster", "slo_class"))
        self.warm_up = metrics.Gauge("tandem_router_warm_up_seconds", "how long the router took, when it "
                                     "started, to rebuild its view from the registry", tag_keys=("cluster", "policy"))

    def warmed_up(self, seconds: float | None) -> None:
        """Set with the other gauges, on their timer (Ray drops a gauge not set again)."""
        if seconds is not None:
            self.warm_up.set(seconds, self.tags)

    def decided(self, decision) -> None:
        path = "load_only" if decision.load_only else ("local" if decision.prefill is None and decision.decode
                                                      else "remote")
        self.decisions.inc(1, {**self.tags, "action": decision.action, "path": path})
        if decision.action == "reject":
            self.rejections.inc(1, {"cluster": self.tags["cluster"], "slo_class": decision.slo_class or "-"})


def _start_at_zero(counter: metrics.Counter, tags: dict[str, str]) -> None:
    """Exports a counter's series at 0 before its first event (Ray's ``inc`` takes only
    positive values), so that it is on the scrape from the start and a first failure shows as
    an increase rather than as a series appearing."""
    counter._record(0.0, tags=tags)
