"""The router as a Ray actor: one per cluster, named ``router`` in the cluster's namespace.

It owns a :class:`~router.router.Router` over the Redis registry, tokenizes text prompts with
the model's tokenizer, records every finished (or rejected) request's goodput record in the
registry, and sweeps expired workers' blocks out of it now and then. Goodput records made
while Redis is down wait in a bounded buffer and are written when it returns.

It is an asyncio actor: ``place`` answers at once when it can place or reject, and otherwise
holds the call until the request can be placed. Held requests are offered again when
something changes: a request finished (told by ``finished``) or the load reports refreshed
(every ``load_refresh_s`` while anything waits). A caller that goes away cancels its call,
which drops the request from the queue.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import redis

from cluster.engine.tokenizer import Tokenizer, TokenizerError
from cluster.metrics import RouterMetrics, SloMetrics
from cluster.registry.goodput import GoodputReader, GoodputRecorder, RequestRecord
from cluster.registry.reporter import connect
from router.config import RouterConfig
from router.registry_view import RedisRegistryView
from router.router import Decision, RouteRequest, Router, Topology

SWEEP_EVERY_S = 2.0
GOODPUT_BUFFER = 10_000
GAUGES_EVERY_S = 2.0  # goodput, attainment and queue gauges: refreshed on a timer, busy or idle


class RouterActor:
    def __init__(self, cluster: str, registry_url: str, topology: Topology, config: RouterConfig | None = None,
                 model_dir: str | None = None, name: str = "router-0"):
        self.cluster = cluster
        self.name = name
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
        self.slo_metrics = SloMetrics(cluster, name, tuple(c.name for c in self.router.config.slo_classes))
        self._gauges: asyncio.Task | None = None
        self._housekeeping: asyncio.Task | None = None
        self._records_waiting: asyncio.Event | None = None
        self._flushing = threading.Lock()  # the housekeeping thread and a goodput() call may both flush
        self._waiters: dict[str, asyncio.Future] = {}
        self._changed: asyncio.Event | None = None
        self._retrier: asyncio.Task | None = None

    async def place(self, request_id: str, prompt: str | Sequence[int], max_tokens: int = 16,
                    slo_class: str | None = None, cache_salt: str | None = None, ttft_s: float | None = None,
                    tpot_s: float | None = None, priority: int = 0, arrival: float | None = None,
                    avoid: tuple[tuple[str, str], ...] = ()) -> Decision:
        """``place`` or ``reject``, answered once the request can be placed. ``arrival`` is the
        wall-clock time the call reached the API, from which its TTFT objective counts; ``avoid``
        the (prefill, decode) pairs whose KV transfer failed under this request."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return Decision("reject", request_id, reason="this model has no tokenizer; send token ids")
            prompt = self.tokenizer.encode(prompt)
        now = time.time()
        request = RouteRequest(request_id, prompt, max_tokens, slo_class, cache_salt, ttft_s, tpot_s, priority,
                               arrival, tuple(map(tuple, avoid)))
        decision = self.router.submit(request, now)
        self.metrics.decided(decision)
        if decision.action != "queue":
            return self._answered(decision)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        self._start_retrier()
        try:
            return await waiter
        except asyncio.CancelledError:
            self.router.cancel(request_id)
            if waiter.done() and not waiter.cancelled() and waiter.result().action == "place":
                self.router.forget(request_id)  # placed just as its caller went away
            raise
        finally:
            self._waiters.pop(request_id, None)

    async def ready(self) -> bool:
        """True once the router runs (and from then on keeps its gauges fresh, writes goodput
        records and sweeps dead workers' blocks off the critical path)."""
        loop = asyncio.get_running_loop()
        if self._gauges is None or self._gauges.done():
            self._gauges = loop.create_task(self._export_gauges())
        if self._housekeeping is None or self._housekeeping.done():
            self._records_waiting = asyncio.Event()
            self._housekeeping = loop.create_task(self._keep_house())
        return True

    async def _keep_house(self) -> None:
        """Writes goodput records soon after they are made (never while a caller waits for a
        placement) and sweeps expired workers' blocks out of the registry every few seconds."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self._records_waiting.wait(), SWEEP_EVERY_S)
            except asyncio.TimeoutError:
                pass
            self._records_waiting.clear()
            await loop.run_in_executor(None, self._flush_records)
            if time.time() - self._last_sweep > SWEEP_EVERY_S:
                self._last_sweep = time.time()
                await loop.run_in_executor(None, self.view.sweep)

    async def _export_gauges(self) -> None:
        while True:
            self.slo_metrics.queue_length(len(self.router.waiting), len(self.router.inflight))
            self.slo_metrics.slo(await asyncio.get_running_loop().run_in_executor(None, self.goodput))
            await asyncio.sleep(GAUGES_EVERY_S)

    def _answered(self, decision: Decision) -> Decision:
        if decision.action == "reject":
            self._record(RequestRecord(decision.request_id, decision.slo_class, None, None, None, None,
                                       decision.ttft_objective_s, decision.tpot_objective_s, failed=True))
        return decision

    def _start_retrier(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        if self._retrier is None or self._retrier.done():
            self._retrier = asyncio.get_running_loop().create_task(self._retry_waiting())

    async def _retry_waiting(self) -> None:
        """While requests wait: offer them again whenever told something changed, or when the
        load reports are due for a refresh."""
        while len(self.router.waiting):
            try:
                await asyncio.wait_for(self._changed.wait(), self.router.config.load_refresh_s)
            except asyncio.TimeoutError:
                pass
            self._changed.clear()
            for decision in self.router.retry_waiting(time.time()):
                self.metrics.decided(decision)
                waiter = self._waiters.get(decision.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(self._answered(decision))
                elif decision.action == "place":  # its caller is gone
                    self.router.forget(decision.request_id)

    def cancel(self, request_id: str) -> None:
        """Drops a waiting request (its caller went away)."""
        self.router.cancel(request_id)
        waiter = self._waiters.get(request_id)
        if waiter is not None and not waiter.done():
            waiter.cancel()

    def forget(self, request_id: str) -> None:
        self.router.forget(request_id)
        self._told()

    def finished(self, request_id: str, ttft_s: float | None, tpot_s: float | None, failed: bool = False,
                 service_ttft_s: float | None = None) -> None:
        """A placed request ended: ``ttft_s`` counts from its arrival at the API (its goodput
        record), ``service_ttft_s`` from its placement (what the router learns from)."""
        decision = self.router.finished(request_id, service_ttft_s)
        self._told()
        if decision is None:
            return
        self._record(RequestRecord(request_id, decision.slo_class, decision.prefill, decision.decode, ttft_s, tpot_s,
                                   decision.ttft_objective_s, decision.tpot_objective_s, failed=failed))

    def _told(self) -> None:
        if self._changed is not None and len(self.router.waiting):
            self._changed.set()

    def worker_failed(self, worker: str) -> None:
        self.router.worker_failed(worker)

    def worker_returned(self, worker: str) -> None:
        """A worker marked failed answers again (started anew under its name): place on it again."""
        self.router.worker_returned(worker)

    def _record(self, record: RequestRecord) -> None:
        if not record.finished_at:
            record = replace(record, finished_at=time.time())
        self.pending_records.append(record)
        if self._records_waiting is not None:
            self._records_waiting.set()  # written by the housekeeping task
        else:
            self._flush_records()

    def _flush_records(self) -> None:
        """Writes the waiting goodput records (they keep waiting while Redis is away)."""
        with self._flushing:
            try:
                while self.pending_records:
                    self.recorder.record(self.pending_records[0])
                    self.pending_records.popleft()
            except redis.RedisError:
                pass

    def goodput(self) -> dict | None:
        """Goodput and SLO attainment per cluster, worker and class, last minute and last hour
        (the records still waiting to be written go first)."""
        self._flush_records()
        try:
            return GoodputReader(self.client, self.cluster).summary()
        except redis.RedisError:
            return None

    def status(self) -> dict:
        status = self.router.status()
        status["name"] = self.name
        status["goodput_records_waiting"] = len(self.pending_records)
        return status
