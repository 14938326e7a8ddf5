"""The long-lived parts of a cluster: the workers of each pool, the KV transfer groups between
prefill and decode workers, and the registry. Requests never pass through here: each ingress
replica (``cluster/ingress/request_path.py``) asks its own router where each goes and streams it from
the chosen decode worker.

Pools (``Pool``): ``prefill`` and ``decode`` workers for disaggregated serving, and
``colocated`` workers that prefill and decode every request themselves. Each worker's TP ranks
take one placement group packed on one node (STRICT_PACK), so a TP group never spans nodes.
Every prefill worker is paired with every decode worker through a transfer group of its own
(ranks of both engines, ports from the cluster name, the rendezvous on the prefill worker's
node); each decode worker builds its pairs (``pair_with``), and fetches KV from the prefill
worker the router chose. Without a Redis URL a private redis-server runs on loopback and stops
with the deployment. A :class:`~cluster.deployment.supervisor.Supervisor` records a worker that
dies lost (routers cut it at once) and, with ``ray.restart_workers``, starts it again in its place.

The pools resize on a running deployment (``deployment.scale``: ``cluster/deployment/scaling.py``):
a worker added, one drained and removed, one moved to the other role. Which workers each pool has
now is ``members`` (names are never used twice: ``decode-2`` after ``decode-0`` and ``decode-1``
whatever became of them), published to the registry as a versioned membership record
(``cluster/registry/membership.py``) that routers place by.
"""

from __future__ import annotations

import itertools
import secrets
import sys
import time
from pathlib import Path
from typing import Callable

from cluster.deployment.kv_budget import added_worker_share, kv_memory_shares
from cluster.deployment.supervisor import Supervisor, first_line
from cluster.deployment.pools import (EngineOverrides, Pool, PoolResources, device_of, pair_name, peer_pair_name,
                                      pools_of, resolve_registry_url)
from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.host_memory import node_memory
from cluster.engine.models.read_config import load_model_config
from cluster.kv_transfer.agent import PairLayout
from cluster.kv_transfer.transport import TransportError
from cluster.kv_transfer.transports import check_transport
from cluster.parallel.group import GroupSpec
from cluster.parallel.tp_runner import check_tensor_parallel
from cluster.protocol.messages import ServingInfo
from cluster.runtime.ray_node import NodePlace, group_node, node_place
from cluster.runtime.ray_runtime import ensure_ray
from cluster.registry.load import read_loads
from cluster.registry.local_redis import LocalRedis
from cluster.registry.membership import Membership, publish_membership
from cluster.registry.reporter import connect
from cluster.runtime.startup import (TOPOLOGY_SETTINGS, SettingNames, guarded, no_node_joined, node_wanted,
                                     placement_failed, worker_failed)
from cluster.topology import ROLES, ClusterSpec
from router.router import Topology

__all__ = ["Deployment", "EngineOverrides", "Pool", "PoolResources", "check_registry", "kv_memory_shares",
           "worker_status"]

REGISTRY_WAIT_S = 30.0
WAITING_SAID_AFTER_S = 1.0  # an added worker not placed by then is said to wait for a node


class Deployment:
    """A topology's long-lived parts: described by ``Deployment(spec)`` (no Ray work), brought
    up by :meth:`start`, stopped by :meth:`shutdown`."""

    def __init__(self, spec: ClusterSpec, engine: EngineOverrides = EngineOverrides(), verbose: bool = True,
                 settings: SettingNames = TOPOLOGY_SETTINGS):
        """``engine`` holds the EngineConfig fields the topology does not; ``settings`` spells
        the settings that errors name (the topology's keys, or ``tandem run``'s flags)."""
        self.spec = spec
        self.engine = engine
        self.verbose = verbose
        self.settings = settings
        self.cluster_name = spec.name
        self.router_config = spec.router
        self.pools = {pool.role: pool for pool in pools_of(spec, engine) if pool.replicas}
        self.device = device_of(spec, engine)
        self.local_redis = None
        self.registry_url: str | None = None
        self.placement_groups: dict[str, object] = {}  # worker name -> its placement group
        self.workers: dict[str, object] = {}
        self.configs: dict[str, EngineConfig] = {}
        self.start_shares: dict[str, float] = {}  # pool role -> the least KV share its workers started with
        self.nodes: dict[str, NodePlace] = {}  # worker name -> the node its placement group is on
        self.supervisor: Supervisor | None = None
        self.planner = None  # the live planner (cluster/plan/live/controller.py), when planner.mode is not off
        self.members: dict[str, list[str]] = {role: pool.names() for role, pool in self.pools.items()}
        self.next_index: dict[str, int] = {role: pool.replicas for role, pool in self.pools.items()}
        self.draining: set[str] = set()
        self.membership = Membership(0)
        self._abandoned: list = []  # start-up calls left unread when another failed
        self._ray = None
        self._num_kv_heads = 0

    def start(self, described: Callable[[ServingInfo], None] | None = None) -> "Deployment":
        """Places and starts every worker, pairs prefill with decode workers and waits for their
        first reports. ``described`` is called with the serving info as soon as the workers are
        up, before they pair: ``tandem up`` starts the ingress replicas meanwhile (a request
        that comes before a pair is built is prefilled on its decode worker, or waits in the
        router for the workers' first reports). A worker that cannot be placed or started raises
        :class:`~cluster.runtime.startup.ClusterStartError`, one line naming it and the setting to
        change, after stopping everything started so far."""
        model_dir = self.spec.model_dir()
        registry_url = resolve_registry_url(self.spec)
        config = self._check(model_dir)
        self._ray = ensure_ray(self.cluster_name, self.spec.ray.address)
        self._start_registry(registry_url)
        started = time.perf_counter()
        try:
            self._start_workers(model_dir)
            self._await_workers([(name, w.started.remote()) for name, w in self.workers.items()])
            description = dict(zip(self.workers, self._await_workers(
                [(name, w.describe.remote()) for name, w in self.workers.items()])))
            self._num_kv_heads = config.num_kv_heads
            self.info = self._serving_info(model_dir, config, description)
            if described is not None:
                described(self.info)
            self._await_workers(self.pair_calls(self.pairs()) + self.peer_pair_calls(self.peer_pairs()))
            self._wait_for_registry()
            self.publish_membership()
            self.supervisor = Supervisor(self, restart=self.spec.ray.restart_workers).start()
            if self.spec.planner.mode != "off":
                self.planner = self._live_planner().start()
        except BaseException:
            self.shutdown()
            raise
        if self.verbose:
            self._say_ready(time.perf_counter() - started)
        return self

    def _check(self, model_dir: Path):
        """What can be checked before anything starts: the pools, the TP degrees against the
        model's shape, the KV transport. Returns the model's configuration."""
        if "decode" not in self.pools and "colocated" not in self.pools:
            raise EngineConfigError("the deployment needs decode or colocated workers")
        if "decode" in self.pools and "prefill" not in self.pools:
            raise EngineConfigError("decode workers need prefill workers (or declare a colocated pool)")
        config = load_model_config(model_dir, self.spec.model.dtype)
        for pool in self.pools.values():
            try:
                check_tensor_parallel(config, pool.tp)
            except ValueError as exc:
                raise EngineConfigError(f"{pool.role}: {exc}") from None
        try:
            check_transport(self.spec.kv.transport)
        except TransportError as exc:
            raise EngineConfigError(str(exc)) from None
        return config

    def _start_registry(self, url: str | None) -> None:
        """The registry at ``url`` once it answers, or a private redis-server."""
        if url is not None:
            check_registry(url)
        self.local_redis = LocalRedis() if url is None else None
        self.registry_url = url or self.local_redis.url

    def _serving_info(self, model_dir: Path, config, described: dict[str, dict]) -> ServingInfo:
        """What the ingress needs to serve: the workers by role and the KV shape of the
        generating worker with the fewest blocks."""
        generating = [d for n, d in described.items() if not n.startswith("prefill-")]
        smallest = min(generating, key=lambda d: d["num_blocks"])
        names = {role: tuple(self.members.get(role, ())) for role in ROLES}
        topology = Topology(names["prefill"], names["decode"], smallest["block_size"],
                            tuple(smallest["hash_keys"]), names["colocated"], self.spec.ray.restart_workers)
        kv = self.spec.kv
        return ServingInfo(
            self.cluster_name, str(model_dir), self.spec.model.name or model_dir.name, config.architecture,
            config.vocab_size, smallest["max_model_len"], smallest["block_size"], smallest["num_blocks"],
            names["prefill"], names["decode"], names["colocated"], self.registry_url, topology, self.router_config,
            kv.transfer_timeout_s, kv.stream_layers, secrets.token_hex(16), self.spec.model.tool_call_format,
            kv.pull_timeout_s)

    def _say_ready(self, seconds: float) -> None:
        pools = ", ".join(f"{p.replicas} {p.role} worker(s) TP {p.tp}" for p in self.pools.values())
        registry = "private redis-server on " + self.registry_url if self.local_redis else "Redis registry"
        print(f"[tandem] {pools}, router policy {self.router_config.policy}, {registry}"
              f"{self._kv_budget()}; ready in {seconds:.1f}s", file=sys.stderr, flush=True)

    def _kv_budget(self) -> str:
        """How the KV budget was split, for the ready line ("" when KV blocks are fixed)."""
        configs = list(self.configs.values())
        if any(c.num_kv_blocks is not None for c in configs):
            return ""
        fraction = configs[0].kv_cache_memory_fraction
        most = max(round(1 / c.kv_share) for c in configs)
        shared = f", shared by its CPU ranks (up to {most} on a node)" if most > 1 else ""
        return f"; KV cache {fraction:g} of each node's memory{shared}"

    # -- starting -----------------------------------------------------------------------------

    def _start_workers(self, model_dir: Path) -> None:
        """Places every worker's ranks first, so that each rank's share of its node's KV budget
        is known before any engine sizes its cache; then starts the workers (guarded: a
        constructor's failure is raised by ``started()``, not printed by Ray)."""
        self._model_dir = model_dir
        device = self.device
        self._gpus = itertools.count(int(device.partition(":")[2] or 0)) if device.startswith("cuda") else None
        workers = [(pool, name) for role in ROLES if (pool := self.pools.get(role)) for name in pool.names()]
        groups = [self.reserve(name) for _, name in workers]
        shares = kv_memory_shares([self._rank_place(name) for _, name in workers])
        for (pool, name), group, share in zip(workers, groups, shares):
            self.configs[name] = self.engine_config(name, share)
            self.start_shares[pool.role] = min(share, self.start_shares.get(pool.role, share))
            self.launch(name, group)

    def _rank_place(self, name: str) -> tuple[str, int, bool]:
        """(node id, ranks, on a CPU) of a placed worker, for its share of the node's KV budget."""
        pool = self.pool_of(name)
        on_cpu = not pool.resources.gpus_per_rank and not self.device.startswith("cuda")
        return group_node(self.placement_groups[name]), pool.tp, on_cpu

    def added_kv_share(self, name: str) -> tuple[float, str]:
        """The share of its node's KV budget of ``name``, placed and added to a running pool
        (``cluster/deployment/kv_budget.py``): its pool's workers' share at start where its
        node's memory holds it; and a line saying which."""
        names = [n for members in self.members.values() for n in members]
        counting_all = kv_memory_shares([self._rank_place(n) for n in names])[names.index(name)]
        pool, config = self.pool_of(name), self.engine_config(name, counting_all)
        started = self.start_shares.get(pool.role)
        if config.num_kv_blocks is not None or started is None or started <= counting_all:
            return counting_all, ""
        try:
            node_bytes, available = self._node_memory(name)
        except Exception as exc:  # noqa: BLE001 - a node that cannot be asked: the share that surely fits
            return counting_all, (f"{name}: its node's free memory could not be read ({first_line(exc)}); "
                                  f"KV cache {counting_all:.3g} of the node's budget, not its pool's {started:.3g}")
        share = added_worker_share(started, counting_all, pool.tp, config.kv_cache_memory_fraction, node_bytes,
                                   available)
        if share == started:
            return share, f"{name}: KV cache {share:.3g} of its node's budget, as its pool's workers started with"
        return share, (f"{name}: KV cache {share:.3g} of its node's budget, less than its pool's {started:.3g}: "
                       f"the node has {available / 2**30:.1f} GiB free")

    def _node_memory(self, name: str) -> tuple[int, int]:
        """(RAM, available RAM) of the node the placed worker ``name`` is on, asked there."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = self._ray.remote(num_cpus=0)(node_memory).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.placement_groups[name], placement_group_bundle_index=0))
        return tuple(self._ray.get(probe.remote(), timeout=60))

    def engine_config(self, name: str, kv_memory_share: float) -> EngineConfig:
        """The engine settings of the worker ``name``: its pool's, on its device."""
        pool = self.pool_of(name)
        common = dict(model=str(self._model_dir), cluster_name=self.cluster_name, ray_address=self.spec.ray.address)
        # With GPUs per rank, Ray assigns each rank its device (it sees only that one, as cuda:0).
        return EngineConfig(
            **{**common, **dict(pool.engine_args)}, tensor_parallel_size=pool.tp, engine_name=name,
            device="cuda:0" if pool.resources.gpus_per_rank else self._device_for(pool.tp),
            cpus_per_rank=pool.resources.cpus_per_rank, gpus_per_rank=pool.resources.gpus_per_rank,
            kv_memory_share=kv_memory_share)

    def _device_for(self, tp: int) -> str:
        """Without Ray-assigned GPUs, each worker's ranks take the next ``tp`` devices of this node."""
        if self._gpus is None:
            return self.device
        first = next(self._gpus)
        for _ in range(tp - 1):
            next(self._gpus)
        return f"cuda:{first}"

    def pool_of(self, name: str) -> Pool:
        return self.pools[name.rpartition("-")[0]]

    def launch(self, name: str, group) -> object:
        """Starts the worker ``name`` (its engine settings as at start) in its placed placement
        group; returns its handle (its ``started()`` says when it is up)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from decode_worker.colocated import ColocatedWorker
        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker

        classes = {"prefill": (PrefillWorker, 64), "decode": (DecodeWorker, 1000), "colocated": (ColocatedWorker, 1000)}
        pool = self.pool_of(name)
        cls, concurrency = classes[pool.role]
        self.placement_groups[name] = group
        self.nodes[name] = node_place(self._ray, group_node(group))
        worker = self.workers[name] = self._ray.remote(guarded(cls)).options(
            name=name, namespace=self.cluster_name, num_cpus=pool.resources.cpus_per_rank, num_gpus=pool.resources.gpus_per_rank,
            max_concurrency=concurrency, scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
        ).remote(self.configs[name], self.registry_url,
                 **({"prefill_peers": tuple(p for p, _ in self.pairs(name))} if pool.role == "decode" else {}))
        return worker

    def placement_group(self, name: str):
        """A new (not yet placed) placement group for the worker ``name``'s ranks: ``tp``
        bundles packed on one node (rank 0 goes in bundle 0, the other ranks are captured into
        the rest)."""
        from ray.util.placement_group import placement_group

        pool = self.pool_of(name)
        return placement_group([pool.resources.bundle()] * pool.tp, strategy="STRICT_PACK",
                               name=f"{self.cluster_name}-{name}")

    def reserve(self, name: str, within_s: float | None = None, waiting: Callable[[str, float], None] | None = None):
        """The worker's placement group, once Ray has placed it. On a local Ray a placement no
        node could ever hold fails at once; otherwise (nodes may yet join, or free up) after
        ``REGISTRY_WAIT_S``, or for an add to a running cluster (``waiting`` given) on a Ray
        cluster after ``ray.node_wait_s`` (an autoscaler may start a node for the pending
        group), having called ``waiting(the node it waits for, seconds)`` once it was not
        placed within ``WAITING_SAID_AFTER_S`` (on a local Ray no node joins: nothing is
        said). A group given up on is removed. With ``within_s``: None, and no group
        left, when it is not placed within that many seconds (the resources are not free now)."""
        from ray.util.placement_group import placement_group_table, remove_placement_group

        pool, local_ray = self.pool_of(name), self.spec.ray.address is None
        group = self.placement_groups[name] = self.placement_group(name)
        started = time.monotonic()
        node_wait_s = self.spec.ray.node_wait_s if waiting is not None and not local_ray else None
        deadline = started + (REGISTRY_WAIT_S if node_wait_s is None else node_wait_s)
        told = False
        while not group.wait(0.2):
            if within_s is not None and time.monotonic() - started > within_s:
                remove_placement_group(self.placement_groups.pop(name))
                return None
            infeasible = placement_group_table(group).get("stats", {}).get("scheduling_state") == "INFEASIBLE"
            if (infeasible and local_ray) or time.monotonic() > deadline:
                remove_placement_group(self.placement_groups.pop(name))
                if node_wait_s is not None:
                    raise no_node_joined(name, pool.tp, pool.resources.bundle(), node_wait_s)
                raise placement_failed(name, pool.role, pool.tp, pool.resources.bundle(), self.settings,
                                       never=infeasible)
            if node_wait_s is not None and within_s is None and not told and \
                    time.monotonic() - started >= WAITING_SAID_AFTER_S:
                told = True
                waiting(node_wanted(pool.tp, pool.resources.bundle()), deadline - started)
        return group

    def _await_workers(self, calls: list[tuple[str, object]]) -> list:
        """The results of start-up calls, in order; the first to fail (a worker whose engine
        raised, that died or was killed for memory) becomes a ClusterStartError naming it."""
        ray = self._ray
        results: dict[object, object] = {}
        names = {ref: name for name, ref in calls}
        pending = [ref for _, ref in calls]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                results[ready[0]] = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                self._abandoned += pending  # read at shutdown, so Ray reports none of them as unhandled
                config = self.configs[names[ready[0]]]
                raise worker_failed(names[ready[0]], exc, self.settings, config.kv_cache_memory_fraction,
                                    config.num_kv_blocks) from None
        return [results[ref] for _, ref in calls]

    def pairs(self, worker: str | None = None) -> list[tuple[str, str]]:
        """The (prefill, decode) pairs that KV travels between: every pair, or those of ``worker``."""
        return [(p, d) for p in self.members.get("prefill", ()) for d in self.members.get("decode", ())
                if worker in (None, p, d)]

    def pair_calls(self, pairs: list[tuple[str, str]], generation: int = 0) -> list[tuple[str, object]]:
        """Has each decode worker build its transfer group with each prefill worker of ``pairs``
        (ranks of both engines; the rendezvous on the prefill worker's node); returns the calls.
        ``generation`` > 0 names new groups for a worker started again (new ports, new store
        prefixes: the old groups' may still be held by the survivors)."""
        calls = []
        for p_name, d_name in pairs:
            pair = pair_name(p_name, d_name)
            layout = PairLayout(pair, self.pools["prefill"].tp, self.pools["decode"].tp, self._num_kv_heads,
                                self.spec.kv.transport)
            group = f"kv-{pair}" + (f".g{generation}" if generation else "")
            spec = GroupSpec(self.cluster_name, group, layout.size, master_addr=self.nodes[p_name].address or "127.0.0.1")
            calls.append((d_name, self.workers[d_name].pair_with.remote(p_name, layout, spec)))
        return calls

    def peer_pairs(self, worker: str | None = None) -> list[tuple[str, str]]:
        """The (sender, receiver) pairs of decode workers that cached KV is pulled through, with
        ``kv.peer_pull`` (one each way between two peers): every pair, or those of ``worker``."""
        if not self.spec.kv.peer_pull:
            return []
        decode = self.members.get("decode", ())
        return [(a, b) for a in decode for b in decode if a != b and worker in (None, a, b)]

    def peer_pair_calls(self, pairs: list[tuple[str, str]], generation: int = 0) -> list[tuple[str, object]]:
        """Has each receiving decode worker of ``pairs`` build its transfer group with the peer
        it pulls from (every rank of both; the rendezvous on the sender's node), as
        :meth:`pair_calls` does for prefill workers; returns the calls."""
        calls = []
        tp = self.pools["decode"].tp if pairs else 1
        for sender, receiver in pairs:
            pair = peer_pair_name(sender, receiver)
            layout = PairLayout(pair, tp, tp, self._num_kv_heads, self.spec.kv.transport)
            group = f"kv-{pair}" + (f".g{generation}" if generation else "")
            spec = GroupSpec(self.cluster_name, group, layout.size,
                             master_addr=self.nodes[sender].address or "127.0.0.1")
            calls.append((receiver, self.workers[receiver].pair_with_peer.remote(sender, layout, spec)))
        return calls

    def _live_planner(self):
        """The live planner (``planner.mode``: advise or act) on this deployment's pools."""
        from cluster.deployment.planner_resize import resize_to, split_of
        from cluster.plan.live.controller import LivePlanner

        return LivePlanner(self.spec, connect(self.registry_url), self.cluster_name, lambda: split_of(self),
                           lambda: [w for role in ("prefill", "decode") for w in self.members.get(role, ())],
                           self.info.vocab_size, self.info.max_model_len,
                           resize=lambda split: resize_to(self, split))

    def publish_membership(self) -> Membership:
        """Writes the pools' members now (and those draining) to the registry, as the next
        version of the membership record that routers place by; returns it."""
        self.membership = Membership(self.membership.version + 1,
                                     *(tuple(self.members.get(role, ())) for role in ROLES),
                                     draining=tuple(sorted(self.draining)))
        client = connect(self.registry_url)
        try:
            publish_membership(client, self.cluster_name, self.membership)
        finally:
            client.close()
        return self.membership

    def _forget_membership(self) -> None:
        import redis

        from cluster.registry.keys import Keys

        try:
            client = connect(self.registry_url)
            try:
                client.delete(Keys(self.cluster_name).membership)
            finally:
                client.close()
        except redis.RedisError:
            pass

    @property
    def scale(self):
        """Resizing this running deployment: ``scale.add(role)``, ``scale.remove(worker)``,
        ``scale.move(worker, role)`` (``cluster/deployment/scaling.py``)."""
        if getattr(self, "_scaler", None) is None:
            from cluster.deployment.scaling import Scaler

            self._scaler = Scaler(self)
        return self._scaler

    def _wait_for_registry(self) -> None:
        """Until every worker's first report is in the registry (they report right after their
        profile), so the router's first placements see measured step times. Requests that come
        sooner wait in the router for those reports."""
        client = connect(self.registry_url)
        deadline = time.monotonic() + REGISTRY_WAIT_S
        try:
            while time.monotonic() < deadline:
                if len(read_loads(client, self.cluster_name, list(self.workers))) == len(self.workers):
                    return
                time.sleep(0.05)
        finally:
            client.close()
        print(f"[tandem] not every worker reported to the registry within {REGISTRY_WAIT_S:.0f}s; requests wait "
              "in the router until they do", file=sys.stderr, flush=True)

    # -- looking at it ------------------------------------------------------------------------

    def worker_status(self) -> list[dict]:
        return worker_status(self._ray, self.workers)

    # -- stopping -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        ray = self._ray
        if ray is None:  # never started
            return
        if getattr(self, "planner", None) is not None:
            self.planner.stop()  # first: it resizes no more
            self.planner = None
        if getattr(self, "supervisor", None) is not None:
            self.supervisor.stop()  # first: the workers stopped below are not started again
            self.supervisor = None
        for worker in list(getattr(self, "workers", {}).values()):
            try:
                ray.get(worker.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to stop
                pass
            ray.kill(worker, no_restart=True)
        self.workers = {}
        for ref in getattr(self, "_abandoned", []):
            try:
                ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - its worker is gone; the first failure was reported
                pass
        self._abandoned = []
        from ray.util.placement_group import remove_placement_group

        for group in getattr(self, "placement_groups", {}).values():
            remove_placement_group(group)
        self.placement_groups = {}
        if getattr(self, "membership", Membership(0)).version and self.local_redis is None:
            self._forget_membership()  # a registry that outlives the cluster keeps no record of its workers
        if getattr(self, "local_redis", None) is not None:
            self.local_redis.stop()
            self.local_redis = None


def worker_status(ray, workers: dict[str, object]) -> list[dict]:
    """Each worker's status; a worker that does not answer is listed as dead."""
    refs = {name: w.status.remote() for name, w in workers.items()}
    rows = []
    for name, ref in refs.items():
        try:
            rows.append(ray.get(ref, timeout=10))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            rows.append({"name": name, "role": name.rpartition("-")[0], "state": "dead"})
    return rows


def check_registry(url: str) -> None:
    """Fails with one line naming the URL's host when the registry cannot be reached."""
    import redis

    try:
        client = connect(url, timeout_s=5.0)
    except ValueError as exc:
        raise EngineConfigError(f"--redis-url: {exc}") from None
    try:
        client.ping()
    except redis.RedisError as exc:
        where = client.connection_pool.connection_kwargs
        raise EngineConfigError(f"cannot reach the registry Redis at {where.get('host')}:{where.get('port')} "
                                f"(db {where.get('db', 0)}): {exc}") from None
    finally:
        client.close()
