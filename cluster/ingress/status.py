"""The cluster's status as an ingress replica reads it for the ``GetStatus`` call of the gRPC
API: its workers, its own router, and the status every other replica's router publishes in
the registry. ``tandem status`` and ``tandem top`` show it (``cluster/cli/status.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import redis

from cluster.registry.planner_decisions import Journal
from cluster.registry.worker_events import WorkerEvent, read_events
from tandem.v1 import tandem_pb2

async def read_status(monitor) -> tandem_pb2.ClusterStatus:
    """The cluster as this replica sees it now (``monitor``: its :class:`~cluster.ingress.health.HealthMonitor`)."""
    info, router = monitor.info, monitor.path.router
    topology = router.topology  # the deployment's workers now (it resizes), with those draining
    loop = asyncio.get_running_loop()
    routers, workers, goodput, events, planner = await asyncio.gather(
        router.statuses(), monitor.worker_statuses(topology.workers), loop.run_in_executor(None, router.goodput),
        loop.run_in_executor(None, _worker_events, router.client, info.cluster),
        loop.run_in_executor(None, _planner, router.client, info.cluster))
    message = tandem_pb2.ClusterStatus(cluster=info.cluster, model=info.model_name,
                                       serving=bool(monitor.serving), health=monitor.reason)
    for name in topology.workers:
        drain = "draining" if name in topology.draining else "serving"
        message.workers.add(**_fields(tandem_pb2.WorkerStatus, {**workers[name], "drain": drain}))
    for name, status in sorted(routers.items()):
        router = message.routers.add(**_fields(tandem_pb2.RouterStatus, {**status, "name": name}))
        if status.get("ttft_prediction_error") is None:
            router.ClearField("ttft_prediction_error")
    if goodput:
        for window in ("last_minute", "last_hour"):
            _goodput_view(getattr(message, window), goodput[window])
    for event in events:
        message.worker_events.add(**_fields(tandem_pb2.WorkerEvent, asdict(event)))
    if planner is not None:
        latest, decisions = planner
        message.planner.CopyFrom(tandem_pb2.PlannerStatus(
            mode=latest.get("mode", ""), latest_at=latest.get("at", 0.0), observed=latest.get("observed", ""),
            proposal=latest.get("proposal", ""), waiting=latest.get("waiting", "")))
        for decision in decisions[-PLANNER_DECISIONS_SHOWN:]:
            message.planner.decisions.add(**_fields(tandem_pb2.PlannerDecision, asdict(decision)))
    return message


PLANNER_DECISIONS_SHOWN = 20


def _planner(client, cluster: str):
    """(On a thread.) The live planner's latest look and decisions; None when it never looked
    (it is off) or the registry is unreachable."""
    try:
        journal = Journal(client, cluster)
        latest = journal.latest()
        return (latest, journal.decisions()) if latest is not None else None
    except redis.RedisError:
        return None


def _worker_events(client, cluster: str) -> list[WorkerEvent]:
    """(On a thread.) The latest workers lost and started again; none while the registry is unreachable."""
    try:
        return read_events(client, cluster)
    except redis.RedisError:
        return []


def _fields(message_type, values: dict) -> dict:
    """The entries of ``values`` that ``message_type`` has fields for (None left out)."""
    names = message_type.DESCRIPTOR.fields_by_name
    return {k: v for k, v in values.items() if k in names and v is not None}


def _goodput_view(view: tandem_pb2.GoodputView, scopes: dict) -> None:
    def fill(window: tandem_pb2.SloWindow, values: dict) -> None:
        window.CopyFrom(tandem_pb2.SloWindow(**_fields(tandem_pb2.SloWindow, values)))

    fill(view.cluster, scopes["cluster"])
    for name, values in scopes["classes"].items():
        fill(view.classes[name], values)
    for name, values in scopes["workers"].items():
        fill(view.workers[name], values)
