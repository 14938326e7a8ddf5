"""The router as a Ray actor: one per cluster, named ``router`` in the cluster's namespace.

It owns a :class:`~router.router.Router` over the Redis registry, tokenizes text prompts with
the model's tokenizer, records every finished (or rejected) request's goodput record in the
registry, and sweeps expired workers' blocks out of it now and then. Goodput records made
while Redis is down wait in a bounded buffer and are written when it returns.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import redis

from cluster.engine.tokenizer import Tokenizer, TokenizerError
from cluster.metrics import RouterMetrics
from cluster.registry.goodput import GoodputReader, GoodputRecorder, RequestRecord
from cluster.registry.reporter import connect
from router.config import RouterConfig
from router.registry_view import RedisRegistryView
from router.router import Decision, RouteRequest, Router, Topology

SWEEP_EVERY_S = 2.0
GOODPUT_BUFFER = 10_000


class RouterActor:
    def __init__(self, cluster: str, registry_url: str, topology: Topology, config: RouterConfig | None = None,
                 model_dir: str | None = None):
        self.cluster = cluster
        self.client = connect(registry_url)
        self.view = RedisRegistryView(self.client, cluster)
        self.router = Router(topology, self.view, config or RouterConfig())
        self.recorder = GoodputRecorder(self.client, cluster)
        self.pending_records: deque[RequestRecord] = deque(maxlen=GOODPUT_BUFFER)
        self.tokenizer = None
        if model_dir is not None:
            try:
                self.tokenizer = Tokenizer(Path(model_dir))
            except TokenizerError:
                pass
        self._last_sweep = 0.0
        self.metrics = RouterMetrics(cluster, self.router.config.policy)

    def route(self, request_id: str, prompt: str | Sequence[int], max_tokens: int = 16,
              slo_class: str | None = None, cache_salt: str | None = None, ttft_s: float | None = None,
              tpot_s: float | None = None) -> Decision:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return Decision("reject", request_id, reason="this model has no tokenizer; send token ids")
            prompt = self.tokenizer.encode(prompt)
        now = time.time()
        if now - self._last_sweep > SWEEP_EVERY_S:
            self._last_sweep = now
            self.view.sweep()
        decision = self.router.route(
            RouteRequest(request_id, prompt, max_tokens, slo_class, cache_salt, ttft_s, tpot_s), now)
        self.metrics.decided(decision)
        if decision.action == "reject":
            self._record(RequestRecord(request_id, decision.slo_class, None, None, None, None,
                                       decision.ttft_objective_s, decision.tpot_objective_s, failed=True))
        return decision

    def forget(self, request_id: str) -> None:
        self.router.forget(request_id)

    def finished(self, request_id: str, ttft_s: float | None, tpot_s: float | None, failed: bool = False) -> None:
        decision = self.router.finished(request_id, ttft_s)
        if decision is None:
            return
        self._record(RequestRecord(request_id, decision.slo_class, decision.prefill, decision.decode, ttft_s, tpot_s,
                                   decision.ttft_objective_s, decision.tpot_objective_s, failed=failed))

    def worker_failed(self, worker: str) -> None:
        self.router.worker_failed(worker)

    def _record(self, record: RequestRecord) -> None:
        if not record.finished_at:
            record = replace(record, finished_at=time.time())
        self.pending_records.append(record)
        try:
            while self.pending_records:
                self.recorder.record(self.pending_records[0])
                self.pending_records.popleft()
        except redis.RedisError:
            pass

    def goodput(self) -> dict | None:
        """Goodput and SLO attainment per cluster, worker and class, last minute and last hour."""
        try:
            return GoodputReader(self.client, self.cluster).summary()
        except redis.RedisError:
            return None

    def status(self) -> dict:
        status = self.router.status()
        status["goodput_records_waiting"] = len(self.pending_records)
        return status
