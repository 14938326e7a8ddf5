"""``tandem up``'s deploy of its ingress through Ray Serve (``run_serve_app``): it returns the
app's handle once the app runs, and a replica that cannot be constructed ends the wait with
Serve's own error, as ``serve.run`` would, never a wait without end."""

from __future__ import annotations

import pytest

from cluster.deployment.launcher import run_serve_app
from cluster.runtime.ray_runtime import ensure_ray

pytestmark = pytest.mark.integration

CLUSTER = "tandem-serve-app-tests"


@pytest.fixture(scope="module")
def serve():
    ray = ensure_ray(CLUSTER, num_cpus=2)
    from ray import serve

    serve.start(proxy_location="Disabled")
    yield serve
    serve.shutdown()
    ray.shutdown()


def test_an_app_that_runs_is_handed_back_running(serve):
    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Echo:
        def __call__(self, text: str) -> str:
            return text.upper()

    handle = run_serve_app(Echo.bind(), "echo")
    assert serve.status().applications["echo"].status == "RUNNING"
    assert handle.remote("ready").result(timeout_s=60) == "READY"
    serve.delete("echo")


def test_a_replica_that_cannot_start_fails_the_deploy_with_its_error(serve):
    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Broken:
        def __init__(self):
            raise ValueError("no port for the API")

    with pytest.raises(RuntimeError, match="Deploying application broken failed.*no port for the API"):
        run_serve_app(Broken.bind(), "broken")
    serve.delete("broken")
