"""The long-lived parts of a cluster: the workers of each pool, the KV transfer groups between
prefill and decode workers, the registry, and the router actors. Requests never pass through
here: an ingress (``cluster/request_path.py``) asks a router where each goes and streams it
from the chosen decode worker.

Pools (``Pool``): ``prefill`` and ``decode`` workers for disaggregated serving, and
``colocated`` workers that prefill and decode every request themselves. Each worker's TP ranks
take one placement group packed on one node (STRICT_PACK), so a TP group never spans nodes.
Every prefill worker is paired with every decode worker through a transfer group of its own
(ranks of both engines, ports from the cluster name); each decode worker knows its pairs, and
fetches KV from the prefill worker the router chose. Without a Redis URL a private
redis-server runs on loopback and stops with the deployment.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.models.config import load_model_config
from cluster.kv_transfer.agent import PairLayout
from cluster.kv_transfer.transport import TransportError, transport_class
from cluster.parallel.group import GroupSpec
from cluster.parallel.tp_runner import check_tensor_parallel
from cluster.ray_runtime import ensure_ray
from cluster.registry.load import read_loads
from cluster.registry.local_redis import LocalRedis
from cluster.registry.reporter import connect
from router.config import RouterConfig
from router.router import Topology

REGISTRY_WAIT_S = 30.0
ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class PoolResources:
    """What each rank of a pool's workers reserves; a worker's ranks share one placement group
    packed on one node (STRICT_PACK), so a TP group never spans nodes."""

    cpus_per_rank: float = 0.25
    gpus_per_rank: int = 0
    resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources per rank

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_rank, **dict(self.resources)}
        if self.gpus_per_rank:
            bundle["GPU"] = float(self.gpus_per_rank)
        return bundle


@dataclass(frozen=True)
class Pool:
    role: str  # prefill, decode or colocated
    replicas: int
    tp: int = 1
    resources: PoolResources = field(default_factory=PoolResources)
    engine_args: tuple[tuple[str, object], ...] = ()  # EngineConfig fields for this pool, over the common ones

    def names(self) -> list[str]:
        return [f"{self.role}-{i}" for i in range(self.replicas)]


@dataclass(frozen=True)
class ServingInfo:
    """What an ingress needs to know of a deployment to serve it: the model, the request
    limits of its smallest generating worker, and the names of its actors."""

    cluster: str
    model_dir: str
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int  # of the smallest decode (or colocated) worker: a request needing more can never run
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    colocated: tuple[str, ...]
    routers: tuple[str, ...]
    router_config: RouterConfig
    transfer_timeout_s: float = 60.0
    stream_layers: bool = True

    @property
    def workers(self) -> tuple[str, ...]:
        return self.prefill + self.decode + self.colocated


class Deployment:
    def __init__(
        self,
        model: str,
        pools: Sequence[Pool],
        cluster_name: str = "tandem",
        router_config: RouterConfig | None = None,
        registry_url: str | None = None,
        kv_transport: str = "torch_distributed",
        transfer_timeout_s: float = 60.0,
        stream_layers: bool = True,
        ray_address: str | None = None,
        model_name: str | None = None,
        verbose: bool = True,
        **engine_args,
    ):
        """``engine_args`` are EngineConfig fields for every pool; each ``Pool`` may override them."""
        self.pools = {pool.role: pool for pool in pools if pool.replicas}
        if "decode" not in self.pools and "colocated" not in self.pools:
            raise EngineConfigError("the deployment needs decode or colocated workers")
        if "decode" in self.pools and "prefill" not in self.pools:
            raise EngineConfigError("decode workers need prefill workers (or declare a colocated pool)")
        model_dir = Path(model)
        config = load_model_config(model_dir, engine_args.get("dtype"))
        for pool in self.pools.values():
            try:
                check_tensor_parallel(config, pool.tp)
            except ValueError as exc:
                raise EngineConfigError(f"{pool.role}: {exc}") from None
        try:
            transport_class(kv_transport)
        except TransportError as exc:
            raise EngineConfigError(str(exc)) from None
        self.router_config = router_config or RouterConfig()
        self.cluster_name = cluster_name
        self.verbose = verbose
        self._ray = ray = ensure_ray(cluster_name, ray_address)
        if registry_url is not None:
            check_registry(registry_url)
        self.local_redis = LocalRedis() if registry_url is None else None
        self.registry_url = registry_url or self.local_redis.url
        self.placement_groups: list = []
        self.workers: dict[str, object] = {}
        self.routers: dict[str, object] = {}
        started = time.perf_counter()
        try:
            self._start_workers(model_dir, ray_address, engine_args)
            described = {name: d for name, d in zip(self.workers, ray.get(
                [w.describe.remote() for w in self.workers.values()]))}
            self._pair(config.num_kv_heads, kv_transport)
            generating = [d for n, d in described.items() if not n.startswith("prefill-")]
            smallest = min(generating, key=lambda d: d["num_blocks"])
            names = {role: tuple(self.pools[role].names()) if role in self.pools else () for role in ROLES}
            self.info = ServingInfo(
                cluster_name, str(model_dir), model_name or model_dir.name, config.architecture, config.vocab_size,
                smallest["max_model_len"], smallest["block_size"], smallest["num_blocks"], names["prefill"],
                names["decode"], names["colocated"],
                tuple(f"router-{i}" for i in range(self.router_config.replicas)), self.router_config,
                transfer_timeout_s, stream_layers)
            topology = Topology(names["prefill"], names["decode"], smallest["block_size"],
                                tuple(smallest["hash_keys"]), names["colocated"])
            from router.actor import RouterActor

            for name in self.info.routers:
                self.routers[name] = ray.remote(RouterActor).options(name=name, num_cpus=0.1).remote(
                    cluster_name, self.registry_url, topology, self.router_config, str(model_dir))
            self._wait_for_registry()
        except BaseException:
            self.shutdown()
            raise
        if verbose:
            pools = ", ".join(f"{p.replicas} {p.role} worker(s) TP {p.tp}" for p in self.pools.values())
            registry = "private redis-server on " + self.registry_url if self.local_redis else "Redis registry"
            print(f"[tandem] {pools}, {len(self.routers)} router(s) ({self.router_config.policy}), {registry}; "
                  f"ready in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)

    # -- starting -----------------------------------------------------------------------------

    def _start_workers(self, model_dir: Path, ray_address: str | None, engine_args: dict) -> None:
        from decode_worker.worker import ColocatedWorker, DecodeWorker
        from prefill_worker.worker import PrefillWorker

        classes = {"prefill": (PrefillWorker, 64), "decode": (DecodeWorker, 1000), "colocated": (ColocatedWorker, 1000)}
        common = dict(model=str(model_dir), cluster_name=self.cluster_name, ray_address=ray_address, **engine_args)
        device = common.pop("device", "cpu")
        gpus = itertools.count(int(device.partition(":")[2] or 0)) if device.startswith("cuda") else None

        def device_for(tp: int) -> str:
            """Without Ray-assigned GPUs, each worker's ranks take the next ``tp`` devices of this node."""
            if gpus is None:
                return device
            first = next(gpus)
            for _ in range(tp - 1):
                next(gpus)
            return f"cuda:{first}"

        for role in ROLES:
            pool = self.pools.get(role)
            if pool is None:
                continue
            cls, concurrency = classes[role]
            for name in pool.names():
                strategy = self._reserve(name, pool)
                # With GPUs per rank, Ray assigns each rank its device (it sees only that one, as cuda:0).
                config = EngineConfig(**{**common, **dict(pool.engine_args)}, tensor_parallel_size=pool.tp,
                                      engine_name=name,
                                      device="cuda:0" if pool.resources.gpus_per_rank else device_for(pool.tp),
                                      cpus_per_rank=pool.resources.cpus_per_rank,
                                      gpus_per_rank=pool.resources.gpus_per_rank)
                self.workers[name] = self._ray.remote(cls).options(
                    name=name, num_cpus=pool.resources.cpus_per_rank, num_gpus=pool.resources.gpus_per_rank,
                    max_concurrency=concurrency, scheduling_strategy=strategy).remote(config, self.registry_url)

    def _reserve(self, name: str, pool: Pool):
        """A placement group of ``tp`` bundles packed on one node for a worker's ranks; its
        scheduling strategy (rank 0 in bundle 0, the other ranks captured into the rest)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = pool.resources.bundle()
        group = placement_group([bundle] * pool.tp, strategy="STRICT_PACK", name=f"{self.cluster_name}-{name}")
        self.placement_groups.append(group)
        if not group.wait(REGISTRY_WAIT_S):
            raise EngineConfigError(
                f"cannot place {name}: its {pool.tp} rank(s) need {bundle} each, together on one node, and the "
                f"Ray cluster has no such room (see `ray status`)")
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                placement_group_capture_child_tasks=True)

    def _pair(self, num_kv_heads: int, kv_transport: str) -> None:
        """A transfer group for every (prefill, decode) pair; each decode worker learns its pairs."""
        if "prefill" not in self.pools or "decode" not in self.pools:
            return
        prefill, decode = self.pools["prefill"], self.pools["decode"]
        joins, peers = [], {d: {} for d in decode.names()}
        for (p, p_name), (d, d_name) in itertools.product(enumerate(prefill.names()), enumerate(decode.names())):
            pair = f"p{p}-d{d}"
            layout = PairLayout(pair, prefill.tp, decode.tp, num_kv_heads, kv_transport)
            spec = GroupSpec(self.cluster_name, f"kv-{pair}", layout.size)
            joins += [self.workers[p_name].join_pair.remote(layout, spec),
                      self.workers[d_name].join_pair.remote(layout, spec)]
            peers[d_name][p_name] = pair
        self._ray.get(joins)
        self._ray.get([self.workers[d].set_peers.remote(p) for d, p in peers.items()])

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

    def router_status(self) -> dict:
        return self._ray.get(next(iter(self.routers.values())).status.remote())

    def goodput(self) -> dict | None:
        """Goodput and SLO attainment per cluster, worker and class (last minute, last hour)."""
        return self._ray.get(next(iter(self.routers.values())).goodput.remote())

    # -- stopping -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        ray = self._ray
        for worker in list(getattr(self, "workers", {}).values()):
            try:
                ray.get(worker.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to stop
                pass
            ray.kill(worker, no_restart=True)
        self.workers = {}
        for router in list(getattr(self, "routers", {}).values()):
            ray.kill(router, no_restart=True)
        self.routers = {}
        from ray.util.placement_group import remove_placement_group

        for group in getattr(self, "placement_groups", []):
            remove_placement_group(group)
        self.placement_groups = []
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
