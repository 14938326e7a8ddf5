"""The ingress's health check over stand-in workers and the replica's router: serving while a
decode worker can generate; not serving (saying why) when the decode workers are gone, stopped,
or all failed; serving again by itself when one returns, with the returned worker handed back
to the router."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from cluster.protocol.messages import ServingInfo
from cluster.ingress.health import HealthMonitor
from router.config import RouterConfig
from router.router import Topology

pytestmark = pytest.mark.unit


class Call:
    """``.remote()`` runs at once (as a fire-and-forget Ray call would, eventually) and returns
    an awaitable of the answer."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        try:
            return Answer(self.fn(*args))
        except Exception as exc:  # noqa: BLE001 - handed to whoever awaits it
            return Answer(None, exc)


class Answer:
    """An awaitable result, like an ObjectRef (awaiting it is optional)."""

    def __init__(self, result, error: Exception | None = None):
        self.result, self.error = result, error

    def __await__(self):
        if self.error is not None:
            raise self.error
        return self.result
        yield  # a generator: the protocol of __await__


class Actor:
    """A stand-in actor: ``.status.remote()`` returns an awaitable, as Ray's do."""

    def __init__(self, status: dict):
        self.status = Call(lambda: status)


class FakeRouter:
    """The replica's router, as the health check uses it: the workers it places on (the
    deployment's, as it started) and those it marked failed."""

    def __init__(self, failed=()):
        self.failed_workers = frozenset(failed)
        self.returned = []
        self.topology = INFO.router_topology

    def worker_returned(self, name):
        self.returned.append(name)
        self.failed_workers -= {name}


class Dead:
    """An actor handle whose actor died: every call fails."""

    def __init__(self):
        def fail(*_):
            raise RuntimeError("the actor died")

        self.status = Call(fail)


@dataclass
class FakeRay:
    actors: dict = field(default_factory=dict)

    def get_actor(self, name, namespace=None):
        if name not in self.actors:
            raise ValueError(f"no actor {name}")
        return self.actors[name]


class FakePath:
    def __init__(self, info, ray):
        self.info, self.ray = info, ray
        self.router = FakeRouter()
        self.forgotten = []

    def worker(self, name):
        try:
            return self.ray.get_actor(name)
        except ValueError:
            raise LookupError(name) from None

    def forget_worker(self, name):
        self.forgotten.append(name)


INFO = ServingInfo("c1", "/m", "m", "LlamaForCausalLM", 512, 512, 16, 64, ("prefill-0",), ("decode-0", "decode-1"),
                   (), "redis://127.0.0.1:1", Topology(("prefill-0",), ("decode-0", "decode-1"), 16), RouterConfig())


def alive(name: str, state: str = "alive") -> dict:
    return {"name": name, "role": name.rpartition("-")[0], "state": state}


@pytest.fixture
def cluster():
    ray = FakeRay()
    for name in INFO.workers:
        ray.actors[name] = Actor(alive(name))
    changes = []

    async def on_change(serving):
        changes.append(serving)

    monitor = HealthMonitor(FakePath(INFO, ray), on_change=on_change, timeout_s=1)
    return ray, monitor, changes


def check(monitor) -> bool:
    return asyncio.run(monitor.check_now())


def test_serving_then_not_when_the_decode_workers_go_then_back(cluster):
    ray, monitor, changes = cluster
    assert check(monitor) and monitor.reason == ""
    del ray.actors["decode-0"]
    assert check(monitor)  # decode-1 still generates
    ray.actors["decode-1"] = Dead()
    assert not check(monitor)
    assert monitor.reason == "no decode worker can generate (decode-0 dead, decode-1 dead)"
    assert "decode-1" in monitor.path.forgotten  # looked up afresh next time
    ray.actors["decode-1"] = Actor(alive("decode-1"))
    assert check(monitor)
    assert changes == [True, False, True]


def test_a_stopped_engine_or_a_failed_worker_cannot_generate(cluster):
    ray, monitor, _ = cluster
    ray.actors["decode-0"] = Actor(alive("decode-0", "stopped"))
    monitor.path.router = FakeRouter(["decode-1"])
    ray.actors["decode-1"] = Dead()
    assert not check(monitor)
    assert monitor.reason == "no decode worker can generate (decode-0 stopped, decode-1 failed)"


def test_a_failed_worker_that_answers_again_is_handed_back(cluster):
    ray, monitor, _ = cluster
    router = monitor.path.router = FakeRouter(["decode-0", "decode-1"])
    assert check(monitor)  # both answer again: restarted under their names
    assert sorted(router.returned) == ["decode-0", "decode-1"] and not router.failed_workers
