"""A deployment's watch over its workers: a worker that dies is recorded lost and cut from
placement at once, and (``ray.restart_workers``, on by default) started again in its place,
without restarting the cluster.

Each worker has a ``lifetime()`` call kept pending: it returns when the worker is shut down, and
fails as soon as Ray finds the worker dead (its process killed, or its node gone with
everything on it). For a dead worker the supervisor

1. kills what is left of it (fencing: a worker only cut off must not come back beside the one
   started in its place; Ray frees its name then), records it lost in the registry
   (``cluster/registry/worker_events.py``: the worker, its node, when) and drops its heartbeat
   and KV blocks there at once, its load report marked ``lost`` (``cluster/registry/load.py``), so
   routers cut it from placement and ``tandem status`` sees it gone without waiting for its
   heartbeat; a prefill worker's decode workers (a decode worker's peers) stop taking KV from its name;
   once Ray finds its node dead (if it is), that is recorded too;
   with restarts off that is all: the worker stays dead (it counts among ``restarting``, the dead
   workers not up again, so a resize does not pair with it);
2. removes its placement group (freeing what it held on a node that lives on) and asks for a
   new one, which Ray places once some node has room (a node that came back, or a new one);
   meanwhile the worker stays dead, and is not placed on;
3. starts the worker under its name, with its settings, in the new group, and pairs it with its
   KV transfer peers through new groups (each decode worker builds its pairs: ``pair_with``, and
   with ``kv.peer_pull`` each receiving decode worker its pairs with the others: ``pair_with_peer``);
4. records it started again. Routers place on it once it reports: a worker they found dead
   comes back when its report shows another incarnation (``router/router.py``).

A worker its deployment drains and removes (``cluster/deployment/scaling.py``) is ``retire``d first:
if it dies while draining, its requests move as from any dead worker, and it is not started again.

Each restart runs on a thread of its own (one may wait long for a node); restarts pair under
one lock, so two workers lost together (a prefill and a decode worker of one node) are paired
with each other by whichever comes up last.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time

from cluster.registry.kv_index import KVIndexReader
from cluster.registry.load import mark_lost, read_loads
from cluster.registry.reporter import connect
from cluster.registry.worker_events import LOST, NODE_LOST, RESTARTED, WorkerEvent, record_event
from cluster.runtime.ray_node import NodePlace

POLL_S = 0.5  # how often the pending lifetime calls are looked at
START_TIMEOUT_S = 300.0  # a worker started again that is not up by then is started once more
RETRY_S = (1.0, 2.0, 5.0, 10.0)  # between attempts to start a worker again, the last repeated
NAME_WAIT_S = 60.0  # for Ray to free a dead worker's name
NODE_WAIT_S = 120.0  # for Ray to find the node of a lost worker dead, if it is
PAIR_TRIES = 4  # builds of a transfer group whose two workers both live


class Supervisor:
    def __init__(self, deployment, restart: bool = True):
        self.deployment, self.restart = deployment, restart
        self.ray = deployment._ray
        self.restarts = 0  # workers started again since the deployment started
        self.restarting: set[str] = set()  # dead workers not yet up again
        self.retired: set[str] = set()  # workers being removed: never started again
        self._generations = itertools.count(1)  # names new transfer groups, unique for the deployment's life
        self._nodes_watched: set[str] = set()  # nodes of lost workers, watched once each
        self._watches: dict[object, str] = {}  # pending lifetime() call -> worker name
        self._lock = threading.Lock()  # the watches and the restarting set
        self.pairing = threading.Lock()  # held while a worker is paired (a restart's, or one added to a pool)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._run, name="tandem-supervisor", daemon=True)

    def start(self) -> "Supervisor":
        for name in self.deployment.workers:
            self.watch(name)
        self._thread.start()
        return self

    def retire(self, name: str) -> None:
        """``name`` is being removed: not started again if it dies (nor once it is stopped)."""
        with self._lock:
            self.retired.add(name)

    def stop(self) -> None:
        """Stops watching (the deployment is stopping its workers) and abandons restarts in progress."""
        self._stop.set()
        for thread in [self._thread, *self._threads]:
            if thread.is_alive():
                thread.join(timeout=30)

    def watch(self, name: str) -> None:
        """Watches ``name`` (a worker started, or added to a pool), to start it again if it dies."""
        with self._lock:
            self._watches[self.deployment.workers[name].lifetime.remote()] = name

    def _run(self) -> None:
        ray = self.ray
        while not self._stop.is_set():
            with self._lock:
                pending = list(self._watches)
            if not pending:
                self._stop.wait(POLL_S)
                continue
            ended, _ = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in ended:
                with self._lock:
                    name = self._watches.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    if not self._stop.is_set() and name not in self.retired:
                        self._lost(name, exc)
                # A lifetime call that returned: the worker was shut down on purpose.

    # -- one worker lost -------------------------------------------------------------------------

    def _lost(self, name: str, error: Exception) -> None:
        deployment, ray = self.deployment, self.ray
        try:  # fenced: one only unreachable must not come back beside the worker started in its place
            ray.kill(deployment.workers[name], no_restart=True)  # (and Ray frees its name only once it is killed)
        except Exception:  # noqa: BLE001 - gone already
            pass
        node = deployment.nodes.get(name, NodePlace())
        event = WorkerEvent(name, deployment.pool_of(name).role, LOST, node.node_id, node.address,
                            detail=first_line(error))
        self._registry(lambda client: self._forget_lost(client, name, event))
        # Its decode workers (a prefill worker's), or its peers (a decode worker's, with kv.peer_pull)
        # take no KV from its name until it is paired again.
        takers = [d for _, d in deployment.pairs(name)] if event.role == "prefill" else []
        takers += [receiver for sender, receiver in deployment.peer_pairs(name) if sender == name]
        for taker in takers:
            try:
                ray.get(deployment.workers[taker].unpair.remote(name), timeout=10)
            except ray.exceptions.RayError:
                pass  # dead too, or too busy: a transfer to the new one fails, and the pair is rebuilt
        log(f"{name} lost on node {node}; " + ("starting it again once a node has room for it" if self.restart
                                                 else "not started again (ray.restart_workers is off)"))
        with self._lock:
            self.restarting.add(name)
            watch_node = node.node_id and node.node_id not in self._nodes_watched
            self._nodes_watched.add(node.node_id)
        if self.restart:
            self._spawn(self._restart, name)
        if watch_node:
            self._spawn(self._node_gone, node)

    def _forget_lost(self, client, name: str, event: WorkerEvent) -> None:
        """Its heartbeat and KV blocks out of the registry, its report marked lost (routers stop
        placing on it at once, not when a lapsed report's grace ends), the event recorded."""
        cluster = self.deployment.cluster_name
        last = read_loads(client, cluster, [name]).get(name)
        KVIndexReader(client, cluster).forget(name)
        mark_lost(client, cluster, name, event.role, last)
        record_event(client, cluster, event)

    def _spawn(self, target, arg) -> None:
        thread = threading.Thread(target=target, args=(arg,), name=f"supervisor-{target.__name__}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _node_gone(self, node: NodePlace) -> None:
        """Records the node of a lost worker as gone if Ray finds it dead within ``NODE_WAIT_S``
        (its health checks take a while); a node that lives on is left unsaid."""
        deadline = time.monotonic() + NODE_WAIT_S
        while not self._stop.wait(1.0) and time.monotonic() < deadline:
            if not any(n["NodeID"] == node.node_id and n["Alive"] for n in self.ray.nodes()):
                log(f"node {node} left the cluster")
                self._registry(lambda client: record_event(client, self.deployment.cluster_name, WorkerEvent(
                    "", "", NODE_LOST, node.node_id, node.address)))
                return

    def _restart(self, name: str) -> None:
        """Places, starts and pairs the worker again, trying until it is up or the deployment stops."""
        deployment, ray = self.deployment, self.ray
        started = time.monotonic()
        for attempt in itertools.count():
            group = self._placed_group(name)
            if group is None:
                return
            try:
                worker = self._launch(name, group)
                ray.get(worker.started.remote(), timeout=START_TIMEOUT_S)
            except ray.exceptions.RayError as exc:  # it died again (its node too, perhaps), or never came up
                log(f"{name} did not start again: {first_line(exc)}; trying again")
                try:
                    ray.kill(deployment.workers[name], no_restart=True)
                except Exception:  # noqa: BLE001 - it is gone already
                    pass
                if self._stop.wait(RETRY_S[min(attempt, len(RETRY_S) - 1)]):
                    return
                continue
            if self._stop.is_set():
                return
            self._pair(name)
            break
        node = deployment.nodes[name]
        self.restarts += 1
        self._registry(lambda client: record_event(client, deployment.cluster_name, WorkerEvent(
            name, deployment.pool_of(name).role, RESTARTED, node.node_id, node.address)))
        log(f"{name} started again on node {node} after {time.monotonic() - started:.1f}s")
        self.watch(name)

    def _placed_group(self, name: str):
        """A new placement group for the worker in place of its old one, once Ray placed it
        (None if the deployment stops first)."""
        from ray.util.placement_group import remove_placement_group

        deployment = self.deployment
        old = deployment.placement_groups.pop(name, None)
        if old is not None:
            remove_placement_group(old)
        group = deployment.placement_groups[name] = deployment.placement_group(name)
        while not group.wait(POLL_S):
            if self._stop.is_set():
                return None
        return group

    def _launch(self, name: str, group):
        """The worker started in ``group``, once Ray has freed its name (a dead actor's name is
        released a moment after its death is known)."""
        deadline = time.monotonic() + NAME_WAIT_S
        while True:
            try:
                return self.deployment.launch(name, group)
            except ValueError:  # "The name ... is already taken"
                if time.monotonic() > deadline or self._stop.wait(0.2):
                    raise self.ray.exceptions.RayError(f"the name {name} was not freed") from None

    def _pair(self, name: str) -> None:
        """Pairs a worker started again with each of its peers that is up (a peer still
        restarting pairs with it when its own turn comes). A pair whose peer died meanwhile is
        left to that peer's restart; one whose group failed to build with both sides alive (a
        rendezvous that timed out on a busy node) is built again, in a new group, up to
        ``PAIR_TRIES`` times: left unpaired, the decode worker would prefill every prompt itself."""
        deployment, ray = self.deployment, self.ray
        with self.pairing:
            with self._lock:
                self.restarting.discard(name)
                pairs = [(p, d) for p, d in deployment.pairs(name)
                         if p not in self.restarting and d not in self.restarting]
                peers = [(a, b) for a, b in deployment.peer_pairs(name)
                         if a not in self.restarting and b not in self.restarting]
            for attempt in range(PAIR_TRIES):
                failed = []
                generation = next(self._generations)
                calls = deployment.pair_calls(pairs, generation) + deployment.peer_pair_calls(peers, generation)
                for (p, d), (_, ref) in zip(pairs + peers, calls):
                    try:
                        ray.get(ref, timeout=120)
                    except ray.exceptions.RayActorError as exc:
                        log(f"the KV transfer group of {p} and {d} was not built ({first_line(exc)})")
                    except (ray.exceptions.RayError, ValueError) as exc:
                        again = attempt + 1 < PAIR_TRIES
                        log(f"the KV transfer group of {p} and {d} was not built ({first_line(exc)})"
                             + ("; building it again" if again else ""))
                        failed.append((p, d))
                if not failed or attempt + 1 == PAIR_TRIES or self._stop.wait(RETRY_S[min(attempt, len(RETRY_S) - 1)]):
                    return
                with self._lock:
                    again = [(p, d) for p, d in failed if p not in self.restarting and d not in self.restarting]
                pairs, peers = [x for x in again if x in pairs], [x for x in again if x in peers]

    def _registry(self, write) -> None:
        write_registry(self.deployment.registry_url, write)


def write_registry(url: str, write) -> None:
    """``write(client)`` on a client of the registry at ``url``; a registry that is down is
    logged, never raised (it never stops a restart or a resize)."""
    try:
        client = connect(url)
        try:
            write(client)
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - the registry being down
        log(f"could not write to the registry: {first_line(exc)}")


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def log(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)
