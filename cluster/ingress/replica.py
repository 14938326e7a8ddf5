"""The API ingress as a Ray Serve deployment: ``server.replicas`` stateless replicas, each an
asyncio gRPC server on the topology's address (they share the port through SO_REUSEPORT, so
the kernel spreads connections over them) running requests' paths itself
(``cluster/ingress/request_path.py``), each with a router of its own (``router-<rank>``,
``router/service.py``) that places its requests in the process. Serve health-checks each
replica and restarts one that dies, while the others keep serving.

Health means serving: each replica checks its workers every few seconds
(``cluster/ingress/health.py``); while no worker can generate, its gRPC health
service says NOT_SERVING and Serve's health check fails (Serve shows the deployment UNHEALTHY
and starts the replica again), and both recover by themselves once they answer again.

Serve's own gRPC proxy is not used: it has no TLS, binds every interface, and does not offer
the standard health service; each replica binds exactly the topology's address.
"""

from __future__ import annotations

from ray import serve

from cluster.protocol.messages import ServingInfo
from cluster.ingress.grpc_server import ApiServer
from cluster.ingress.health import HealthMonitor
from cluster.observability.metrics import IngressMetrics
from cluster.runtime.ports import host_port
from cluster.ingress.request_path import RequestPath
from cluster.ingress.status import read_status
from cluster.topology import ClusterSpec
from cluster.ingress.tracing import request_tracer
from cluster.runtime.short_slice import serve_with_short_slices

INGRESS = "grpc-ingress"


HEAD_NODE = {"node:__internal_head__": 0.001}  # the API's address is the head node's (and its Service's)


@serve.deployment(name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0.1, "resources": HEAD_NODE},
                  health_check_period_s=5, health_check_timeout_s=30,
                  logging_config={"enable_access_log": False})  # Serve's line per handle call is not Tandem's log
class GrpcIngress:
    def __init__(self, spec: ClusterSpec, info: ServingInfo):
        metrics = IngressMetrics(spec.name, info.workers)
        router = f"router-{serve.get_replica_context().rank.rank}"
        self.path = RequestPath(info, metrics, api="grpc", tracer=request_tracer(spec.observability.tracing, spec.name),
                                router_name=router)
        self.monitor = HealthMonitor(self.path, metrics=metrics)
        self.server = ApiServer(spec, self.path, status=lambda: read_status(self.monitor))
        self.monitor.on_change = self.server.serving_changed
        self.server.submit(self.path.start()).result(timeout=60)
        self.server.submit(self.monitor.check_now()).result(timeout=60)  # the health service is right from the start
        self._checks = self.server.submit(self.monitor.run())
        host = spec.server.host
        self.address_text = host_port(host, self.server.port)
        serve_with_short_slices(whole_process=True)  # every thread of the replica serves requests

    def address(self) -> str:
        return self.address_text

    def check_health(self) -> None:
        """Serve's check: fails while this replica cannot serve (see the module's docstring)."""
        if not self.server.alive:
            raise RuntimeError("the gRPC server's thread ended")
        if not self.monitor.serving:
            raise RuntimeError(f"not serving: {self.monitor.reason}")

    def __del__(self) -> None:
        checks = getattr(self, "_checks", None)
        if checks is not None:
            checks.cancel()
        server = getattr(self, "server", None)
        if server is not None:  # takes no more calls, lets those in flight end, then writes its goodput
            server.stop(grace_s=2, then=self.path.stop)  # records and takes its router's status off


def ingress_app(spec: ClusterSpec, info: ServingInfo):
    """The ingress for a validated topology (handed over whole: a replica does not check it again,
    nor load the model's config to do so)."""
    return GrpcIngress.options(num_replicas=spec.server.replicas).bind(spec, info)
