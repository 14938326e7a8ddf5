"""What a topology's workers are: each pool's resources and engine settings, read from a
:class:`~cluster.topology.ClusterSpec` (and the engine settings a topology does not hold)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from cluster.engine.sampling_params import InvalidRequestError
from cluster.topology import ROLES, ClusterSpec


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
class EngineOverrides:
    """EngineConfig fields a topology does not hold (``tandem run``'s ``--seed``, ``--device``,
    ``--attention-backend``...): ``common`` for every pool, ``per_role`` over them for one.
    ``device`` in ``common`` is the device of ranks that Ray gives no GPU."""

    common: Mapping[str, object] = field(default_factory=dict)
    per_role: Mapping[str, Mapping[str, object]] = field(default_factory=dict)


def pools_of(spec: ClusterSpec, engine: EngineOverrides = EngineOverrides()) -> list[Pool]:
    """The topology's pools, each with its resources and its own engine settings."""
    common = {name: value for name, value in engine.common.items() if name != "device"}
    pools = []
    for role in ROLES:
        p = spec.pool(role)
        args = spec.engine_args(role)
        for shared in ("cluster_name", "device"):
            args.pop(shared)
        args.update(common)
        args.update(engine.per_role.get(role, {}))
        resources = PoolResources(p.cpus_per_rank, p.gpus_per_rank, tuple(sorted(dict(p.node.resources).items())))
        pools.append(Pool(role, p.replicas, p.tp, resources, tuple(sorted(args.items()))))
    return pools


def device_of(spec: ClusterSpec, engine: EngineOverrides = EngineOverrides()) -> str:
    """The device of ranks that Ray gives no GPU: the override's, else the generating pool's."""
    generating = spec.decode if spec.decode.replicas else spec.colocated
    return str(engine.common.get("device", generating.device))


def pair_name(prefill: str, decode: str) -> str:
    """The transfer group of a prefill and a decode worker, from their names: ``p1-d0``."""
    return f"p{prefill.rpartition('-')[2]}-d{decode.rpartition('-')[2]}"


def peer_pair_name(sender: str, receiver: str) -> str:
    """The transfer group through which the decode worker ``receiver`` pulls cached KV from its
    peer ``sender`` (one each way between two peers): ``d0-to-d1``."""
    return f"d{sender.rpartition('-')[2]}-to-d{receiver.rpartition('-')[2]}"


def resolve_registry_url(spec: ClusterSpec) -> str | None:
    url = spec.registry.url
    if url and spec.registry.password_env:
        password = os.environ.get(spec.registry.password_env)
        if password is None:
            raise InvalidRequestError(f"registry.password_env: environment variable {spec.registry.password_env} "
                                      "is not set")
        scheme, _, rest = url.partition("://")
        url = f"{scheme}://:{password}@{rest.rpartition('@')[2]}"
    return url
