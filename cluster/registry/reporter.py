"""A worker's link to the registry: a background thread that publishes the block manager's KV
events, a heartbeat and a load report every ``interval_s``.

A report that would say what the last one said (no KV events, the load unchanged but for its
time) is not sent again until ``quiet_resend_s`` has passed (a third of the heartbeat's life at
most), then sent whole with its new time: an idle worker does not rewrite Redis ten times a
second. Each report took ~1.1 ms of the worker's CPU (the JSON of its steps, four Redis commands);
an idle quick-start cluster's two workers spent 22 ms a second on them, and that CPU is taken from
a decode step on another worker of the machine.

Redis being down never reaches the worker's serving path: a failed publish is logged once,
the events stay folded into the publisher's view, and the first publish after Redis returns
sends the worker's whole state (the sequence number shows the gap).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
from typing import Callable

import redis

from cluster.engine.block_manager import KVEvent
from cluster.registry.kv_index import KVIndexPublisher
from cluster.registry.load import WorkerLoad, publish_load

# The worker's KV events since the last call and its load now; None when its state is as last
# reported (an engine step in progress): the reporter then renews that report and the heartbeat.
Snapshot = Callable[[], tuple[list[KVEvent], WorkerLoad] | None]


def connect(url: str, timeout_s: float = 1.0) -> redis.Redis:
    """A client whose calls fail within ``timeout_s`` when Redis is unreachable (the URL may
    carry a password, ``rediss://`` for TLS, and a database number)."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


class WorkerReporter:
    def __init__(self, url: str, cluster: str, worker: str, snapshot: Snapshot, interval_s: float = 0.1,
                 heartbeat_ttl_s: float = 3.0, quiet_resend_s: float = 1.0):
        self.client = connect(url)
        self.cluster, self.worker = cluster, worker
        self.snapshot = snapshot
        self.interval_s, self.heartbeat_ttl_s = interval_s, heartbeat_ttl_s
        self.quiet_resend_s = min(quiet_resend_s, heartbeat_ttl_s / 3)
        self.publisher = KVIndexPublisher(self.client, cluster, worker, heartbeat_ttl_s)
        self.connected = True
        self.resyncs = 0
        self.renewals = 0  # reports renewed unchanged while the worker's engine was busy
        self.unsent = 0  # reports not sent: the same as the last one, which was fresh enough
        self._last_load: WorkerLoad | None = None
        self._sent_at = 0.0  # monotonic time of the last write of the load and the heartbeat
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: publish now, not at the next interval
        self._thread = threading.Thread(target=self._run, name=f"registry-{worker}", daemon=True)
        self._thread.start()

    def report_now(self) -> bool:
        """One publish; True if Redis took it."""
        snapshot = self.snapshot()
        try:
            if snapshot is None:
                self._renew()
            else:
                events, load = snapshot
                if not events and self._repeats(load):
                    self.unsent += 1
                    return True
                if self.publisher.publish(events):
                    self.resyncs += 1
                publish_load(self.client, self.cluster, load, self.heartbeat_ttl_s)
                self._last_load, self._sent_at = load, time.monotonic()
        except redis.RedisError as exc:
            if self.connected:
                print(f"[tandem] {self.worker}: registry unreachable ({exc}); serving on, will re-publish",
                      file=sys.stderr, flush=True)
            self.connected = False
            return False
        if not self.connected:
            print(f"[tandem] {self.worker}: registry back; state re-published", file=sys.stderr, flush=True)
        self.connected = True
        return True

    def _repeats(self, load: WorkerLoad) -> bool:
        """Whether ``load`` says what the last report said, sent less than ``quiet_resend_s`` ago
        (and Redis took it)."""
        last = self._last_load
        return (self.connected and last is not None and time.monotonic() - self._sent_at < self.quiet_resend_s
                and replace(load, updated_at=last.updated_at) == last)

    def _renew(self) -> None:
        """The heartbeat, and the last load report as it was (its ``updated_at`` unchanged: it
        describes the worker as of then), given a new lifetime."""
        self.publisher.heartbeat()
        if self._last_load is not None:
            publish_load(self.client, self.cluster, self._last_load, self.heartbeat_ttl_s)
        self._sent_at = time.monotonic()
        self.renewals += 1

    def report_soon(self) -> None:
        """Publishes from the reporter's thread now rather than at the next interval (a change
        routers should see at once, such as a pair going out of use or back)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.report_now()

    def stop(self) -> None:
        """Stops beating and removes this worker's liveness key (its blocks go with the next sweep)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        try:
            self.client.delete(self.publisher.keys.alive(self.worker), self.publisher.keys.load(self.worker))
        except redis.RedisError:
            pass
        self.client.close()
