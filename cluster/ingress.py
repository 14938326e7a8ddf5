"""The API ingress as a Ray Serve deployment: ``server.replicas`` stateless replicas, each an
asyncio gRPC server on the topology's address (they share the port through SO_REUSEPORT, so
the kernel spreads connections over them) running requests' paths itself
(``cluster/request_path.py``). Serve health-checks each replica and restarts one that dies,
while the others keep serving.

Serve's own gRPC proxy is not used: it has no TLS, binds every interface, and does not offer
the standard health service; each replica binds exactly the topology's address.
"""

from __future__ import annotations

import ray
from ray import serve

from cluster.deployment import ServingInfo
from cluster.grpc_server import ApiServer
from cluster.metrics import IngressMetrics
from cluster.request_path import RequestPath
from cluster.topology import parse_topology

INGRESS = "grpc-ingress"


HEAD_NODE = {"node:__internal_head__": 0.001}  # the API's address is the head node's (and its Service's)


@serve.deployment(name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0.1, "resources": HEAD_NODE},
                  health_check_period_s=5, health_check_timeout_s=30)
class GrpcIngress:
    def __init__(self, spec_yaml: str, info: ServingInfo):
        spec = parse_topology(spec_yaml)
        self.path = RequestPath(info, IngressMetrics(spec.name), api="grpc")
        self.server = ApiServer(spec, self.path)
        host = spec.server.host
        self.address_text = f"[{host}]:{self.server.port}" if ":" in host else f"{host}:{self.server.port}"

    def address(self) -> str:
        return self.address_text

    def check_health(self) -> None:
        ray.get([router.ready.remote() for router in self.path.routers], timeout=20)

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(grace_s=2)


def ingress_app(spec_yaml: str, info: ServingInfo, replicas: int):
    return GrpcIngress.options(num_replicas=replicas).bind(spec_yaml, info)
