"""Resizing a running deployment without losing a request: a worker added to a pool, one drained and
removed, one moved from one role to the other (``deployment.scale``; ``tandem scale`` asks the
``tandem up`` process for the same through ``cluster/deployment/control.py``).

**Add**: a placement group for a new worker (a name never used before in the pool), placed once
a node has room for it (on a Ray cluster it waits up to ``ray.node_wait_s`` for one, e.g. a node
KubeRay's autoscaler starts for the pending group, saying so in the worker events; past that the
group is removed and the add fails in one line, recorded too), the worker started in it, paired
with its KV transfer peers (a decode worker with every prefill worker, and with ``kv.peer_pull``
with every other decode worker each way; a prefill worker with every decode worker), its first
load report awaited; then the membership
record that names it is written and every router's word awaited, so that when ``add`` returns
routers place on it.

**Remove** (a drain, ``cluster/deployment/drain.py``): the record names the worker draining, and
routers stop placing on it; its requests in flight finish (a prefill worker's: their KV sent);
then its decode workers forget it (a prefill worker), it stops, its placement group goes, its
registry entries (heartbeat, load, KV blocks) go, and the record without it is written. A
request still in flight past the drain's timeout moves when the worker stops, as from a worker
that died: its stream resumes elsewhere without repeating or losing a token. The last worker
that can generate, and the last prefill worker of decode workers, are not removed.

**Move**: add a worker of the other role, then remove the one moved, when the resources for both
are free now (the pool never runs short, and a failed add changes nothing); otherwise remove,
then add one in the room it left. An add that fails after the remove says in one line which pool
is one short and what to run.

One resize at a time; each step is written to the registry's worker events (``tandem status``).
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Callable

import redis

from cluster.deployment.drain import Drain, DrainLook
from cluster.deployment.pools import pair_name
from cluster.deployment.supervisor import first_line, log, write_registry
from cluster.engine.request_limits import quote
from cluster.registry.kv_index import KVIndexReader
from cluster.registry.load import read_loads
from cluster.registry.reporter import connect
from cluster.registry.worker_events import ADDED, DRAINING, NOT_ADDED, REMOVED, WAITING, WorkerEvent, record_event
from cluster.runtime.startup import ClusterStartError
from cluster.topology import ROLES
from router.service import published_statuses

LOOK_EVERY_S = 0.2  # between looks at a draining worker and the routers
ROUTER_WAIT_S = 10.0  # for every router to place by a new membership record
REPORT_WAIT_S = 60.0  # for an added worker's first load report
PAIR_TIMEOUT_S = 120.0  # for an added worker's KV transfer groups to be built
DRAIN_TIMEOUT_S = 60.0  # for a draining worker's requests to finish (then they move)
ROOM_WAIT_S = 5.0  # for a move's new worker to be placed beside the one it replaces (else: room made first)

Say = Callable[[str], None]


class ScaleError(RuntimeError):
    """A resize that cannot be done: one line, naming what to change."""


class Scaler:
    def __init__(self, deployment):
        self.deployment = deployment
        self._lock = threading.RLock()  # one resize at a time (a move holds it across its two steps)

    # -- adding ------------------------------------------------------------------------------

    def add(self, role: str, say: Say = log, within_s: float | None = None) -> str | None:
        """Adds a worker to the pool ``role``; returns its name once routers place on it. With
        ``within_s``: None, and nothing changed, when its placement is not made within that long
        (no free resources for it now)."""
        d = self.deployment
        with self._lock:
            if role not in ROLES:
                raise ScaleError(f"role: {quote(role)} is not a role; choose one of {', '.join(ROLES)}")
            if role not in d.pools:
                raise ScaleError(f"role: the topology declares no {role} pool (its replicas are 0); "
                                 f"add to one of {', '.join(sorted(d.pools))}")
            name = f"{role}-{d.next_index[role]}"
            d.next_index[role] += 1
            started = time.monotonic()
            say(f"placing {name}")
            try:
                placed = self._start(name, say, within_s)
            except ClusterStartError as exc:
                self._event(WorkerEvent(name, role, NOT_ADDED, "", "", detail=str(exc)))
                raise ScaleError(str(exc)) from None
            if not placed:
                d.next_index[role] -= 1  # never used: the name is free again
                say(f"no free resources for {name} now")
                return None
            if d.supervisor is not None:
                d.supervisor.watch(name)
            self._announce(d.publish_membership().version, say)
            node = d.nodes[name]
            self._event(WorkerEvent(name, role, ADDED, node.node_id, node.address))
            say(f"{name} added on node {node} in {time.monotonic() - started:.1f}s; routers place on it")
            return name

    def _start(self, name: str, say: Say = log, within_s: float | None = None) -> bool:
        """Places, starts and pairs ``name``, and waits for its first report; undoes it all if
        any step fails. False when it could not be placed ``within_s`` (nothing was started)."""
        d, role = self.deployment, name.rpartition("-")[0]
        pairing = d.supervisor.pairing if d.supervisor is not None else nullcontext()
        try:
            def waiting(node: str, wait_s: float) -> None:
                say(f"{name} waiting for a node with {node} (up to {wait_s:g}s)")
                self._event(WorkerEvent(name, role, WAITING, "", "", detail=node))

            group = d.reserve(name, within_s, waiting)
            if group is None:
                return False
            with pairing:
                d.members[role].append(name)
                share, note = d.added_kv_share(name)
                if note:
                    say(note)
                d.configs[name] = d.engine_config(name, share)
                worker = d.launch(name, group)
                d._await_workers([(name, worker.started.remote())])
                restarting = d.supervisor.restarting if d.supervisor is not None else set()
                pairs = [(p, w) for p, w in d.pairs(name) if p not in restarting and w not in restarting]
                peers = [(a, b) for a, b in d.peer_pairs(name) if a not in restarting and b not in restarting]
                for (p, w), (_, ref) in zip(pairs + peers, d.pair_calls(pairs) + d.peer_pair_calls(peers)):
                    try:
                        d._ray.get(ref, timeout=PAIR_TIMEOUT_S)
                    except Exception as exc:  # noqa: BLE001 - a group that did not build: the add fails
                        raise ClusterStartError(f"{name}: its KV transfer group with "
                                                f"{p if w == name else w} was not built: {first_line(exc)}") from None
            self._await_report(name)
            return True
        except BaseException:
            if name in d.workers:
                self._unpair(name, role)  # the peers that built a group with it leave it
            if name in d.members.get(role, []):
                d.members[role].remove(name)
            self._stop(name)
            raise

    def _await_report(self, name: str) -> None:
        d = self.deployment
        client = connect(d.registry_url)
        deadline = time.monotonic() + REPORT_WAIT_S
        try:
            while not read_loads(client, d.cluster_name, [name]):
                if time.monotonic() > deadline:
                    raise ClusterStartError(f"{name} started but sent no load report to the registry within "
                                            f"{REPORT_WAIT_S:.0f}s")
                time.sleep(0.05)
        finally:
            client.close()

    # -- removing ----------------------------------------------------------------------------

    def remove(self, worker: str, timeout_s: float = DRAIN_TIMEOUT_S, say: Say = log) -> Drain:
        """Drains ``worker`` (no new placements; its requests in flight finish, or after
        ``timeout_s`` move) and removes it; returns the drain, done."""
        d = self.deployment
        with self._lock:
            role = self._removable(worker)
            started = time.monotonic()
            if d.supervisor is not None:
                d.supervisor.retire(worker)
            d.draining.add(worker)
            drain = Drain(worker, d.publish_membership().version, started, timeout_s, ROUTER_WAIT_S)
            node = d.nodes[worker]
            self._event(WorkerEvent(worker, role, DRAINING, node.node_id, node.address))
            say(f"{worker} draining: routers place on it no more")
            phase = drain.phase
            while not drain.done:
                time.sleep(LOOK_EVERY_S)
                drain.step(DrainLook(time.monotonic(), self._router_versions(), self._in_flight(worker)))
                if drain.phase != phase:
                    phase = drain.phase
                    say(f"{worker} {phase}" + (" (every router places by the new membership)"
                                                if phase == "emptying" else ""))
            self._unpair(worker, role)
            self._stop(worker)
            d.members[role].remove(worker)
            d.draining.discard(worker)
            self._forget(worker)
            d.publish_membership()
            moved = f"; {drain.left_in_flight} request(s) still in flight moved" if drain.left_in_flight else ""
            took = time.monotonic() - started
            self._event(WorkerEvent(worker, role, REMOVED, node.node_id, node.address,
                                    detail=f"drained in {took:.1f}s{moved}"))
            say(f"{worker} removed after {took:.1f}s{moved}; its placement group freed")
            return drain

    def _unpair(self, worker: str, role: str) -> None:
        """Its KV transfer peers leave their groups with it: a prefill worker's decode workers
        take KV from it no more; a decode worker's prefill workers close their groups (and
        their rendezvous ports). A peer that does not answer is left to its own restart."""
        d = self.deployment
        if role == "prefill":
            calls = [lambda peer=peer: d.workers[peer].drop_peer.remote(worker) for peer in d.members.get("decode", [])]
        elif role == "decode":
            calls = [lambda peer=peer: d.workers[peer].leave_pair.remote(pair_name(peer, worker))
                     for peer in d.members.get("prefill", [])]
            calls += [lambda peer=peer: d.workers[peer].drop_peer.remote(worker)  # its decode peers (kv.peer_pull)
                      for sender, peer in d.peer_pairs(worker) if sender == worker and peer in d.workers]
        else:
            calls = []
        for call in calls:
            try:
                d._ray.get(call(), timeout=30)
            except Exception:  # noqa: BLE001 - dead, or restarting
                pass

    def _removable(self, worker: str) -> str:
        """The role of ``worker``, one that can be removed now; ScaleError otherwise."""
        d = self.deployment
        role = next((r for r, members in d.members.items() if worker in members), None)
        if role is None:
            every = ", ".join(n for members in d.members.values() for n in members)
            raise ScaleError(f"worker: {quote(worker)} is not a worker of this cluster; its workers: {every}")
        if worker in d.draining:
            raise ScaleError(f"worker: {worker} is draining already")
        serving = {r: [n for n in members if n not in d.draining and n != worker] for r, members in d.members.items()}
        if role in ("decode", "colocated") and not serving.get("decode") and not serving.get("colocated"):
            raise ScaleError(f"worker: {worker} is the last worker that generates; add another first "
                             "(`tandem scale add decode`)")
        if role == "prefill" and serving.get("decode") and not serving.get("prefill"):
            raise ScaleError(f"worker: {worker} is the last prefill worker of the decode workers; add another first "
                             "(`tandem scale add prefill`)")
        return role

    def _in_flight(self, worker: str) -> int:
        """Requests ``worker`` holds (0 once it is dead: its requests moved)."""
        d = self.deployment
        try:
            return int(d._ray.get(d.workers[worker].in_flight.remote(), timeout=10))
        except Exception:  # noqa: BLE001 - dead, or not answering: nothing more finishes there
            return 0

    def _stop(self, worker: str) -> None:
        """Stops ``worker`` (its streams close: requests still on them move) and frees its
        placement group."""
        from ray.util.placement_group import remove_placement_group

        d = self.deployment
        handle = d.workers.pop(worker, None)
        if handle is not None:
            try:
                d._ray.get(handle.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - dead already
                pass
            d._ray.kill(handle, no_restart=True)
        group = d.placement_groups.pop(worker, None)
        if group is not None:
            remove_placement_group(group)
        d.configs.pop(worker, None)
        d.nodes.pop(worker, None)

    # -- moving ------------------------------------------------------------------------------

    def move(self, worker: str, role: str, timeout_s: float = DRAIN_TIMEOUT_S, say: Say = log) -> str:
        """Moves ``worker`` to the pool ``role``: a worker of ``role`` added, then ``worker``
        drained and removed, when both fit now; else removed first and the new one added in the
        room it left. Returns the new worker's name."""
        d = self.deployment
        with self._lock:
            current = self._removable(worker)
            if role == current:
                raise ScaleError(f"role: {worker} is a {role} worker already")
            if role not in d.pools:
                raise ScaleError(f"role: the topology declares no {quote(role)} pool; move to one of "
                                 f"{', '.join(sorted(r for r in d.pools if r != current))}")
            try:
                added = self.add(role, say, within_s=ROOM_WAIT_S)
            except ScaleError as exc:
                raise ScaleError(f"no {role} worker could be added, so {worker} was not removed (the pools are as "
                                 f"they were): {first_line(exc)}") from None
            if added is not None:
                self.remove(worker, timeout_s, say)
                return added
            say(f"making room: {worker} is removed first")
            self.remove(worker, timeout_s, say)
            try:
                return self.add(role, say)
            except ScaleError as exc:
                raise ScaleError(f"{worker} was removed from the {current} pool, but no {role} worker could be added "
                                 f"in its place ({first_line(exc)}): the {role} pool is one short of the move; run "
                                 f"`tandem scale add {role}` once there is room, or `tandem scale add {current}` to "
                                 "undo it") from None

    # -- the registry ------------------------------------------------------------------------

    def _announce(self, version: int, say: Say) -> None:
        """Waits (up to ``ROUTER_WAIT_S``) until every live router places by ``version``."""
        deadline = time.monotonic() + ROUTER_WAIT_S
        while any(v < version for v in self._router_versions()):
            if time.monotonic() > deadline:
                say(f"not every router placed by membership version {version} within {ROUTER_WAIT_S:.0f}s; "
                    "they will once they read the registry")
                return
            time.sleep(LOOK_EVERY_S / 4)

    def _router_versions(self) -> list[int]:
        """The membership version each live router places by (none while the registry is away)."""
        d = self.deployment
        try:
            client = connect(d.registry_url)
            try:
                statuses, _ = published_statuses(client, d.cluster_name)
            finally:
                client.close()
        except redis.RedisError:
            return []
        return [int(s.get("topology_version", 0)) for s in statuses.values()]

    def _forget(self, worker: str) -> None:
        """The worker's heartbeat, load report and KV blocks out of the registry at once."""
        self._registry(lambda client: KVIndexReader(client, self.deployment.cluster_name).forget(worker))

    def _event(self, event: WorkerEvent) -> None:
        self._registry(lambda client: record_event(client, self.deployment.cluster_name, event))

    def _registry(self, write) -> None:
        write_registry(self.deployment.registry_url, write)
