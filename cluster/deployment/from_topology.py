"""A topology's deployment: the pools, the registry and the routers that ``tandem up`` starts
(``cluster/deployment/deployment.py``), built from a :class:`~cluster.topology.ClusterSpec`."""

from __future__ import annotations

import os

from cluster.deployment.deployment import Deployment, Pool, PoolResources
from cluster.engine.sampling_params import InvalidRequestError
from cluster.runtime.startup import TOPOLOGY_SETTINGS
from cluster.topology import ROLES, ClusterSpec


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


def pools_of(spec: ClusterSpec) -> list[Pool]:
    """The topology's pools, each with its resources and its own engine settings."""
    pools = []
    for role in ROLES:
        p = spec.pool(role)
        args = spec.engine_args(role)
        for shared in ("cluster_name", "device"):
            args.pop(shared)
        resources = PoolResources(p.cpus_per_rank, p.gpus_per_rank, tuple(sorted(dict(p.node.resources).items())))
        pools.append(Pool(role, p.replicas, p.tp, resources, tuple(sorted(args.items()))))
    return pools


def build_deployment(spec: ClusterSpec, verbose: bool = True) -> Deployment:
    generating = spec.decode if spec.decode.replicas else spec.colocated
    return Deployment(
        str(spec.model_dir()), pools_of(spec), cluster_name=spec.name, router_config=spec.router,
        registry_url=resolve_registry_url(spec), kv_transport=spec.kv.transport,
        transfer_timeout_s=spec.kv.transfer_timeout_s, stream_layers=spec.kv.stream_layers,
        ray_address=spec.ray.address, model_name=spec.model.name, verbose=verbose, settings=TOPOLOGY_SETTINGS,
        device=generating.device,
    )
