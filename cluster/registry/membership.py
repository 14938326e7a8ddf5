"""Which workers a deployment has now, by role, and which of them are draining: the record routers
place by, versioned so that the deployment knows when every router has seen a change.

A deployment that resizes (``cluster/deployment/scaling.py``) writes a new record, with the next
version, for each step: a worker added (once it is paired and has reported), a worker draining (it
takes no new placements; its requests in flight finish), a worker removed. Each ingress replica's
router reads it a few times a second (``router/service.py``), places on the pools it names less the
draining, and publishes the version it placed by in its status; ``tandem status`` shows each
worker's drain state from it.

One JSON string under ``tandem:<c>:membership`` (no expiry: it is the deployment's word, not a
heartbeat).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import redis

from cluster.registry.keys import Keys


@dataclass(frozen=True)
class Membership:
    version: int
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()  # members that take no new placements

    @property
    def workers(self) -> tuple[str, ...]:
        return self.prefill + self.decode + self.colocated

    def state_of(self, worker: str) -> str:
        """``draining``, ``serving``, or ``removed`` for a worker this record does not name."""
        if worker in self.draining:
            return "draining"
        return "serving" if worker in self.workers else "removed"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "Membership":
        data = json.loads(raw)
        return cls(data["version"], *(tuple(data.get(k, ())) for k in ("prefill", "decode", "colocated", "draining")))


def publish_membership(client: redis.Redis, cluster: str, membership: Membership) -> None:
    client.set(Keys(cluster).membership, membership.to_json())


def read_membership(client: redis.Redis, cluster: str) -> Membership | None:
    """The deployment's latest record (None before its first)."""
    raw = client.get(Keys(cluster).membership)
    return Membership.from_json(raw) if raw is not None else None
