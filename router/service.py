"""The router as each ingress replica runs it: in the replica's process, on the event loop
that serves its API calls, so a placement is a function call, not a hop (``tandem run
--disaggregated`` runs one the same way).

It owns a :class:`~router.router.Router` over the Redis registry, records every finished (or
rejected) request's goodput record in the registry, publishes its status there for ``tandem
status`` (every ingress replica's router is shown, whichever replica answers), and sweeps
expired workers' blocks out of the registry now and then. Goodput records made while Redis is
down wait in a bounded buffer and are written when it returns.

Each ingress replica is one router replica (``server.replicas`` of them): its router counts the
placements it made since each worker's last load report, and the reports carry every replica's
requests, so replicas share the workers without talking to each other. Its state is soft: a
replica that restarts rebuilds it from the registry as it starts (``Router.warm_up``: the load
reports and the models fitted to them; the prefix index is the registry's own), before its
first placement, and exports how long that took (``tandem_router_warm_up_seconds``).

``place`` answers at once when it can place or reject, and otherwise holds the call until the
request can be placed. Held requests are offered again when something changes: a request
finished (told by ``finished``) or the load reports refreshed (every ``load_refresh_s`` while
anything waits). A caller that goes away cancels its call, which drops the request from the
queue.

The workers it places on are the deployment's membership record (``cluster/registry/membership.py``),
read every ``MEMBERSHIP_POLL_S`` off the placement path: a worker added is placed on once the
record names it, a draining one is placed on no more, and the router publishes the record's
version it now places by at once (the deployment waits for every router's word before it counts
a draining worker's requests as the last).

Registry reads on the placement path are single round trips to Redis, made on the event loop
itself (a thread hop would cost more than the read); writes (goodput records, the status, the
sweep) run on a thread, off the critical path. A registry that stops answering is found by
one placement's read (refused at once, or after the client's 1 s timeout); from then on
placements go by load only without touching Redis, while a probe on a thread asks it every
``registry_retry_s`` and hands it back to the router once it answers, so an outage never
stalls the replica's loop again.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from dataclasses import replace

import redis

from cluster.observability.metrics import RouterMetrics, SloMetrics
from cluster.registry.planner_decisions import Journal
from cluster.registry.goodput import GoodputReader, GoodputRecorder, RequestRecord
from cluster.registry.keys import Keys
from cluster.registry.membership import read_membership
from cluster.registry.reporter import connect
from router.config import RouterConfig
from router.registry_view import RedisRegistryView
from router.router import Decision, RouteRequest, Router, Topology

SWEEP_EVERY_S = 2.0
GOODPUT_BUFFER = 10_000
GAUGES_EVERY_S = 2.0  # goodput, attainment and queue gauges, and the published status: busy or idle
STATUS_KEPT_S = 15.0  # a published status not rewritten for this long is a router that is gone
MEMBERSHIP_POLL_S = 0.2  # how often the deployment's membership record is read
# A placement's deferred refits wait this long: past its request's first step, which on a machine
# whose cores the worker's threads fill would share them with the refit (``_refit_after``).
REFIT_DELAY_S = 0.03


class RouterService:
    def __init__(self, cluster: str, registry_url: str, topology: Topology, config: RouterConfig | None = None,
                 name: str = "router-0"):
        self.cluster = cluster
        self.name = name
        self.client = connect(registry_url)
        self.view = RedisRegistryView(self.client, cluster)
        self.router = Router(topology, self.view, config or RouterConfig(), probe_elsewhere=True, defer_refits=True)
        self.recorder = GoodputRecorder(self.client, cluster)
        self.pending_records: deque[RequestRecord] = deque(maxlen=GOODPUT_BUFFER)
        self._last_sweep = 0.0
        self.metrics = RouterMetrics(cluster, self.router.config.policy)
        self.slo_metrics = SloMetrics(cluster, name, tuple(c.name for c in self.router.config.slo_classes))
        self._gauges: asyncio.Task | None = None
        self._housekeeping: asyncio.Task | None = None
        self._probe: asyncio.Task | None = None
        self._membership: asyncio.Task | None = None
        self._records_waiting: asyncio.Event | None = None
        self._flushing = threading.Lock()  # the housekeeping thread and a goodput() call may both flush
        self._waiters: dict[str, asyncio.Future] = {}
        self._changed: asyncio.Event | None = None
        self._retrier: asyncio.Task | None = None
        self._refit_timer: asyncio.TimerHandle | None = None

    async def place(self, request: RouteRequest) -> Decision:
        """``place`` or ``reject``, answered once the request can be placed. ``request.arrival``
        is the wall-clock time the call reached the API, from which its TTFT objective counts;
        ``request.avoid`` the (prefill, decode) pairs whose KV transfer failed under it."""
        now = time.time()
        request_id = request.request_id
        decision = self.router.submit(request, now)
        self._refit_after()
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

    async def start(self) -> None:
        """Starts, on the running loop (the one placements run on), what the router does off
        the critical path: its gauges and published status, writing goodput records, and
        sweeping dead workers' blocks."""
        loop = asyncio.get_running_loop()
        if self.router.warm_up_s is None:  # a fresh router (its replica started, or started again): warm at once
            self.router.warm_up()
        if self._gauges is None or self._gauges.done():
            self._gauges = loop.create_task(self._export_gauges())
        if self._housekeeping is None or self._housekeeping.done():
            self._records_waiting = asyncio.Event()
            self._housekeeping = loop.create_task(self._keep_house())
        if self._probe is None or self._probe.done():
            self._probe = loop.create_task(self._probe_registry())
        if self._membership is None or self._membership.done():
            self._membership = loop.create_task(self._follow_membership())

    async def _follow_membership(self) -> None:
        """Reads the deployment's membership record (on a thread) every ``MEMBERSHIP_POLL_S``;
        a newer one is placed by at once, and this router's status, naming its version, is
        published at once."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                membership = await loop.run_in_executor(None, read_membership, self.client, self.cluster)
            except redis.RedisError:
                membership = None
            if membership is not None and self.router.set_membership(membership):
                await loop.run_in_executor(None, self._publish_status, self.status())
                self._told()
            await asyncio.sleep(MEMBERSHIP_POLL_S)

    @property
    def topology(self) -> Topology:
        """The workers it places on now (with those draining)."""
        return self.router.topology

    async def _probe_registry(self) -> None:
        """While the router finds the registry down: asks it, on a thread, every
        ``registry_retry_s``, and tells the router once it answers."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.router.config.registry_retry_s)
            if not self.router.registry_down:
                continue
            try:
                await loop.run_in_executor(None, self.client.ping)
            except redis.RedisError:
                continue
            self.router.registry_answers()
            self._told()

    async def stop(self) -> None:
        """Stops its tasks, writes the records still waiting and takes its status off the registry."""
        for task in (self._gauges, self._housekeeping, self._retrier, self._probe, self._membership):
            if task is not None:
                task.cancel()
        if self._refit_timer is not None:
            self._refit_timer.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self._leave)

    def _leave(self) -> None:
        self._flush_records()
        try:
            self.client.hdel(Keys(self.cluster).routers, self.name)
        except redis.RedisError:
            pass

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
        loop = asyncio.get_running_loop()
        while True:
            self.slo_metrics.queue_length(len(self.router.waiting), len(self.router.inflight))
            self.metrics.warmed_up(self.router.warm_up_s)
            await loop.run_in_executor(None, self._publish_status, self.status())
            self.slo_metrics.slo(await loop.run_in_executor(None, self.goodput))
            self.slo_metrics.planner(await loop.run_in_executor(None, self._planner_look))
            await asyncio.sleep(GAUGES_EVERY_S)

    def _planner_look(self) -> dict | None:
        """(On a thread.) The live planner's latest look, for the gauges; None when it is off."""
        try:
            return Journal(self.client, self.cluster).latest()
        except redis.RedisError:
            return None

    def _publish_status(self, status: dict) -> None:
        """(On a thread.) Publishes this router's status for ``tandem status``."""
        try:
            self.client.hset(Keys(self.cluster).routers, self.name, json.dumps({**status, "at": time.time()}))
        except redis.RedisError:
            pass

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
            decisions = self.router.retry_waiting(time.time())
            self._refit_after()
            for decision in decisions:
                self.metrics.decided(decision)
                waiter = self._waiters.get(decision.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(self._answered(decision))
                elif decision.action == "place":  # its caller is gone
                    self.router.forget(decision.request_id)

    def forget(self, request_id: str) -> None:
        self.router.forget(request_id)
        self._told()

    def finished(self, request_id: str, ttft_s: float | None, tpot_s: float | None, failed: bool = False,
                 service_ttft_s: float | None = None, output_tokens: int | None = None) -> None:
        """A placed request ended: ``ttft_s`` counts from its arrival at the API (its goodput
        record), ``service_ttft_s`` from its placement (what the router learns from, with the
        ``output_tokens`` it generated there)."""
        placed = self.router.inflight.get(request_id)
        decision = self.router.finished(request_id, service_ttft_s, output_tokens=output_tokens, tpot_s=tpot_s)
        self._told()
        if decision is None:
            return
        self._record(RequestRecord(request_id=request_id, slo_class=decision.slo_class,
                                   prefill_worker=decision.prefill, decode_worker=decision.decode, ttft_s=ttft_s,
                                   tpot_s=tpot_s, ttft_objective_s=decision.ttft_objective_s,
                                   tpot_objective_s=decision.tpot_objective_s, failed=failed,
                                   prompt_tokens=placed.prompt_tokens if placed is not None else 0,
                                   output_tokens=output_tokens or 0))

    def _refit_after(self) -> None:
        """The step-time models a placement found out of date are refitted ``REFIT_DELAY_S``
        later, not while the request waits (``Router.defer_refits``), nor while its first step
        runs."""
        if self.router.refits_due and self._refit_timer is None:
            self._refit_timer = asyncio.get_running_loop().call_later(REFIT_DELAY_S, self._refit_now)

    def _refit_now(self) -> None:
        self._refit_timer = None
        self.router.refit_deferred()

    def _told(self) -> None:
        if self._changed is not None and len(self.router.waiting):
            self._changed.set()

    @property
    def failed_workers(self) -> frozenset[str]:
        """Workers found dead under a request (placed on again once they answer)."""
        return frozenset(self.router.failed)

    def worker_failed(self, worker: str) -> None:
        self.router.worker_failed(worker)

    def incarnation(self, worker: str) -> str:
        return self.router.incarnation(worker)

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

    async def statuses(self) -> dict[str, dict]:
        """Every router's status by name: this one's now, the others' as they last published
        it (those not heard from for ``STATUS_KEPT_S`` are gone, and dropped)."""
        own = self.status()
        others = await asyncio.get_running_loop().run_in_executor(None, self._published)
        others.pop(self.name, None)
        return {**others, self.name: own}

    def _published(self) -> dict[str, dict]:
        try:
            out, stale = published_statuses(self.client, self.cluster)
        except redis.RedisError:
            return {}
        if stale:
            try:
                self.client.hdel(Keys(self.cluster).routers, *stale)
            except redis.RedisError:
                pass
        return out


def published_statuses(client: redis.Redis, cluster: str) -> tuple[dict[str, dict], list[str]]:
    """The statuses every live router last published, by name, and the names of those gone
    (not heard from for ``STATUS_KEPT_S``)."""
    out, stale, now = {}, [], time.time()
    for name, raw in client.hgetall(Keys(cluster).routers).items():
        name = name.decode() if isinstance(name, bytes) else name
        try:
            status = json.loads(raw)
        except ValueError:
            continue
        if now - status.pop("at", 0.0) > STATUS_KEPT_S:
            stale.append(name)
        else:
            out[name] = status
    return out, stale
