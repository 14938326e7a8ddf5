"""The gRPC ingress as a Ray Serve deployment: Serve runs it, health-checks it (through the
frontend actor) and restarts it; it runs the gRPC server of ``cluster/grpc_server.py``.

Serve's own gRPC proxy is not used: it has no TLS, binds every interface, and does not offer
the standard health service; the deployment binds exactly the topology's address.
"""

from __future__ import annotations

import ray
from ray import serve

from cluster.grpc_server import ApiServer
from cluster.topology import parse_topology

INGRESS = "grpc-ingress"


HEAD_NODE = {"node:__internal_head__": 0.001}  # the API's address is the head node's (and its Service's)


@serve.deployment(name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0.1, "resources": HEAD_NODE},
                  health_check_period_s=5, health_check_timeout_s=30)
class GrpcIngress:
    def __init__(self, spec_yaml: str):
        spec = parse_topology(spec_yaml)
        self.frontend = ray.get_actor("frontend", namespace=spec.name)
        self.server = ApiServer(spec, self.frontend)
        self.port = self.server.port
        host = spec.server.host
        self.address_text = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def address(self) -> str:
        return self.address_text

    def check_health(self) -> None:
        ray.get(self.frontend.ready.remote(), timeout=20)

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(grace_s=2)
