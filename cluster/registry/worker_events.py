"""What happened to the cluster's workers: each one lost (its actor died, alone or with its
node), each one started again in its place, each node of a lost worker that left the
cluster, and each resize step (a worker waiting for a node, added or not, draining, removed),
with the node and when. The
deployment that watches its workers (``cluster/deployment/supervisor.py``) and resizes its pools
(``cluster/deployment/scaling.py``) writes them; ``tandem status`` shows
them (through an ingress replica, which reads them here).

One Redis list of JSON records, newest first, capped at ``EVENTS_KEPT``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import redis

from cluster.registry.keys import Keys

EVENTS_KEPT = 200
LOST, RESTARTED, NODE_LOST = "lost", "restarted", "node_lost"
ADDED, DRAINING, REMOVED = "added", "draining", "removed"
WAITING, NOT_ADDED = "waiting", "not_added"  # an added worker waiting for a node; an add given up


@dataclass(frozen=True)
class WorkerEvent:
    worker: str  # "" for NODE_LOST
    role: str
    event: str  # LOST, RESTARTED, NODE_LOST, ADDED, DRAINING, REMOVED, WAITING or NOT_ADDED
    node_id: str  # lost: the node it ran on; restarted: the node it runs on now; node_lost: the node ("": none yet)
    node_address: str
    at: float = field(default_factory=time.time)
    detail: str = ""  # why it was lost, as Ray said; waiting: the node it waits for; not_added: why

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "WorkerEvent":
        return cls(**json.loads(raw))

    def line(self) -> str:
        """One line for ``tandem status``."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at))
        node = f"node {self.node_id[:12]} ({self.node_address})" if self.node_id else "an unknown node"
        if self.event == NODE_LOST:
            return f"{when}: {node} left the cluster"
        if self.event == LOST:
            return f"{when}: {self.worker} lost on {node}" + (f": {self.detail}" if self.detail else "")
        if self.event == RESTARTED:
            return f"{when}: {self.worker} started again on {node}"
        if self.event == WAITING:
            return f"{when}: {self.role} worker {self.worker} waiting for a node with {self.detail}"
        if self.event == NOT_ADDED:
            return f"{when}: {self.role} worker {self.worker} not added: {self.detail}"
        done = {ADDED: "added", DRAINING: "draining", REMOVED: "removed"}[self.event]
        return f"{when}: {self.role} worker {self.worker} {done} on {node}" + (f" ({self.detail})" if self.detail else "")


def record_event(client: redis.Redis, cluster: str, event: WorkerEvent) -> None:
    key = Keys(cluster).worker_events
    pipe = client.pipeline(transaction=True)
    pipe.lpush(key, event.to_json())
    pipe.ltrim(key, 0, EVENTS_KEPT - 1)
    pipe.execute()


def read_events(client: redis.Redis, cluster: str, limit: int = 20) -> list[WorkerEvent]:
    """The latest ``limit`` events, newest first."""
    return [WorkerEvent.from_json(raw) for raw in client.lrange(Keys(cluster).worker_events, 0, limit - 1)]
