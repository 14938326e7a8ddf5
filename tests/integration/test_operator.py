"""What an operator sees of a real deployment (1 prefill + 1 decode worker on Ray, the tiny
checkpoint), served by an ingress's parts in this process (request path, health check, gRPC
server), without Serve:

- a request's trace (in-memory exporter) has the request span and, under it, admission,
  placement (with the decision and its predictions), prefill, KV transfer and decode;
- ``GetStatus`` answers what ``tandem status`` shows, and ``tandem status --addr`` and
  ``tandem top --addr`` read it without registering a Ray job;
- the gRPC health says NOT_SERVING once the decode worker is killed, and SERVING again, by
  itself, once a decode worker runs again under its name (which the router then places on).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from cluster.deployment.deployment import Deployment  # noqa: E402
from cluster.ingress.grpc_server import ApiServer  # noqa: E402
from cluster.ingress.health import HealthMonitor  # noqa: E402
from cluster.runtime.ray_runtime import ensure_ray  # noqa: E402
from cluster.ingress.request_path import RequestPath  # noqa: E402
from cluster.ingress.status import read_status  # noqa: E402
from cluster.topology import (  # noqa: E402
    ClusterSpec, KVSpec, ModelSpec, PoolSpec, RaySpec, TracingSpec, parse_topology,
)
from cluster.ingress.tracing import memory_exporter, request_tracer  # noqa: E402
from conftest import random_prompts, wait_for  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from tandem.client import TandemClient, build_generate_request  # noqa: E402

pytestmark = pytest.mark.integration

CLUSTER = "tandem-operator-tests"
_SCRIPT = Path(sys.executable).parent / "tandem"
TANDEM = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "cluster.cli.main"]


class Ingress:
    """An ingress replica's parts, as cluster/ingress/replica.py wires them, on a free port."""

    def __init__(self, deployment: Deployment):
        self.path = RequestPath(deployment.info, None, "grpc", request_tracer(TracingSpec(exporter="memory"), CLUSTER))
        self.monitor = HealthMonitor(self.path, period_s=0.5, timeout_s=10)
        spec = parse_topology(f"cluster: {{name: {CLUSTER}}}\nserver: {{port: 0}}")
        self.server = ApiServer(spec, self.path, status=lambda: read_status(self.monitor))
        self.monitor.on_change = self.server.serving_changed
        self.server.submit(self.path.start()).result(timeout=60)
        self.server.submit(self.monitor.check_now()).result(timeout=60)
        self.checks = self.server.submit(self.monitor.run())
        self.address = f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        self.checks.cancel()
        self.server.submit(self.path.stop()).result(timeout=60)
        self.server.stop()


@pytest.fixture(scope="module")
def cluster(checkpoint):
    ray = ensure_ray(CLUSTER, num_cpus=8)
    pool = PoolSpec(max_num_batched_tokens=96)
    deployment = Deployment(ClusterSpec(
        name=CLUSTER, model=ModelSpec(path=str(checkpoint("llama"))), prefill=pool, decode=pool,
        kv=KVSpec(num_blocks=64), router=RouterConfig(local_prefill_max_tokens=0),
        ray=RaySpec(restart_workers=False)),  # the health test starts the decode worker again itself
        verbose=False).start()
    ingress = Ingress(deployment)
    yield ray, deployment, ingress
    ingress.stop()
    deployment.shutdown()
    ray.shutdown()


def test_a_requests_trace_has_every_phase(cluster):
    _, _, ingress = cluster
    exporter = memory_exporter()
    exporter.clear()
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with TandemClient(ingress.address, timeout_s=120) as client:
        request = build_generate_request(random_prompts([40], seed=5)[0], max_tokens=6, temperature=0,
                                         ignore_eos=True, request_id="traced-1")
        # With the caller's traceparent, as an instrumented client sends it.
        call = client._stub.Generate(request, metadata=(("traceparent", caller),), timeout=120)
        messages = list(call)
    assert messages[-1].finished and messages[-1].prefill_worker == "prefill-0"
    spans = wait_for(lambda: [s for s in exporter.get_finished_spans()
                              if format(s.context.trace_id, "032x") == caller.split("-")[1]], 10, "the trace")
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"tandem.request", "admission", "placement", "prefill", "kv_transfer", "decode"}
    root = by_name["tandem.request"]
    assert format(root.parent.span_id, "016x") == caller.split("-")[2]
    assert all(s.parent.span_id == root.context.span_id for s in spans if s is not root)
    assert root.attributes["tandem.request_id"] == "traced-1" and root.attributes["tandem.completion_tokens"] == 6
    placement = by_name["placement"].attributes
    assert placement["tandem.placement.prefill"] == "prefill-0" and placement["tandem.placement.decode"] == "decode-0"
    assert placement["tandem.placement.predicted_ttft_ms"] > 0 and placement["tandem.placement.path"] == "remote"
    assert by_name["kv_transfer"].attributes["tandem.kv.bytes"] > 0
    assert by_name["kv_transfer"].attributes["tandem.kv.blocks_sent"] == 3  # 40 tokens in blocks of 16
    assert by_name["decode"].attributes["tandem.decode.tokens"] == 6
    assert by_name["decode"].attributes["tandem.decode.proposed_tokens"] == 0  # no speculation here
    assert by_name["decode"].attributes["tandem.decode.accepted_tokens"] == 0
    # In order along the request (times from the decode worker are this machine's clock too).
    assert root.start_time <= by_name["admission"].start_time <= by_name["placement"].start_time
    assert by_name["placement"].end_time <= by_name["prefill"].start_time <= by_name["prefill"].end_time
    assert by_name["prefill"].end_time <= by_name["decode"].start_time <= by_name["decode"].end_time <= root.end_time
    assert all(s.status.is_ok for s in spans)


def ray_jobs(ray) -> int:
    from ray._private import state

    return len(state.jobs())


def test_status_and_top_read_the_api_without_a_ray_job(cluster, tmp_path):
    ray, _, ingress = cluster
    with TandemClient(ingress.address, timeout_s=60) as client:
        status = client.status()
    assert status.cluster == CLUSTER and status.serving and status.health == ""
    assert {(w.name, w.role, w.state) for w in status.workers} == {("prefill-0", "prefill", "alive"),
                                                                   ("decode-0", "decode", "alive")}
    (router,) = status.routers
    assert router.name == "router-0" and router.placed >= 1 and router.policy == "slo"
    assert status.last_minute.cluster.requests >= 1
    jobs = ray_jobs(ray)
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path)}  # no state here: --addr is the only way in
    shown = subprocess.run([*TANDEM, "status", "--addr", ingress.address], capture_output=True, text=True, env=env,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "decode-0" in shown.stdout and "; serving" in shown.stdout and "last minute:" in shown.stdout
    top = subprocess.run([*TANDEM, "top", "--addr", ingress.address, "--iterations", "2", "--interval", "0.2"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert top.returncode == 0, top.stderr
    assert top.stdout.count("tandem top - ") == 2 and "goodput, last minute" in top.stdout
    assert ray_jobs(ray) == jobs
    missing = subprocess.run([*TANDEM, "status"], capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 1 and "give its API address with --addr" in missing.stderr


def test_health_flips_when_the_decode_worker_dies_and_back_when_one_returns(cluster):
    ray, deployment, ingress = cluster
    from cluster.runtime.startup import guarded
    from decode_worker.worker import DecodeWorker

    client = TandemClient(ingress.address, timeout_s=30)
    assert client.health() == "SERVING"
    router = ingress.path.router
    ray.kill(deployment.workers["decode-0"], no_restart=True)
    ingress.server.submit(_call(router.worker_failed, "decode-0")).result(timeout=60)  # as a request that found it dead
    wait_for(lambda: client.health() == "NOT_SERVING", 60, "NOT_SERVING after the decode worker died", every_s=0.2)
    status = client.status()
    assert not status.serving and "decode-0" in status.health
    assert {w.name: w.state for w in status.workers}["decode-0"] == "dead"
    config = deployment.configs["decode-0"]
    returned = ray.remote(guarded(DecodeWorker)).options(name="decode-0", num_cpus=0.25, max_concurrency=1000).remote(
        config, deployment.registry_url)
    try:
        ray.get(returned.started.remote(), timeout=300)
        wait_for(lambda: client.health() == "SERVING", 60, "SERVING once a decode worker runs again", every_s=0.2)
        assert "decode-0" not in router.failed_workers
        assert {w.name: w.state for w in client.status().workers}["decode-0"] == "alive"
    finally:
        client.close()
        ray.kill(returned, no_restart=True)


async def _call(fn, *args):
    """``fn(*args)`` on the ingress's event loop, where its router runs."""
    return fn(*args)
