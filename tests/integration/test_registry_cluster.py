"""The registry with real workers, real Redis and real Ray: workers' KV events and load reach
Redis, a killed worker expires, and Redis killed and restarted mid-run loses no request and is
rebuilt by the workers' re-publishing."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from cluster.offline.disaggregated import DisaggregatedLLM
from cluster.engine.block_hash import hash_token_blocks
from cluster.engine.block_manager import BlockManager
from cluster.engine.sampling_params import SamplingParams
from cluster.runtime.ray_runtime import ensure_ray
from cluster.registry.goodput import GoodputReader
from cluster.registry.kv_index import KVIndexReader
from cluster.registry.load import WorkerLoad, read_loads
from cluster.registry.local_redis import LocalRedis
from cluster.registry.reporter import WorkerReporter
from conftest import random_prompts, wait_for

pytestmark = pytest.mark.integration

CLUSTER = "tandem-registry-tests"
BLOCK = 16


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_reporter_publishes_events_and_load_and_survives_redis_restart():
    """A reporter keeps its worker's view while Redis is down and re-publishes it on return."""
    with LocalRedis() as server:
        port = server.port
        blocks = BlockManager(8, 4)
        hashes = hash_token_blocks(list(range(12)), 4, ("m",))

        def snapshot():
            load = WorkerLoad("w0", "decode", 0, 0, 0, 0, 0, blocks.num_free_blocks, 8, 4, 64, 4)
            return blocks.drain_events(), load

        reporter = WorkerReporter(server.url, "rep", "w0", snapshot, interval_s=0.05, heartbeat_ttl_s=1.0)
        client = redis.Redis.from_url(server.url)
        try:
            for block_id, h in zip(blocks.allocate(3), hashes):
                blocks.cache_block(block_id, h)
            reader = KVIndexReader(client, "rep")
            wait_for(lambda: reader.prefix_blocks(hashes) == {"w0": 3}, what="stored blocks")
            assert read_loads(client, "rep", ["w0"])["w0"].free_blocks == 5
            server.stop()
            wait_for(lambda: not reporter.connected, what="the reporter to notice")
            restarted = LocalRedis(port=port)
            try:
                client = redis.Redis.from_url(restarted.url)
                reader = KVIndexReader(client, "rep")
                wait_for(lambda: reader.prefix_blocks(hashes) == {"w0": 3}, what="re-published blocks")
                assert reporter.connected and reporter.resyncs == 1
                reporter.stop()
                assert reader.alive_workers() == set()
                assert reader.sweep() == ["w0"] and reader.prefix_blocks(hashes) == {}
            finally:
                restarted.stop()
        finally:
            reporter.stop()


def test_a_report_that_says_what_the_last_said_is_not_sent_until_the_heartbeat_needs_it():
    """Driven by hand (the reporter's own thread waits an hour): an unchanged load is not written
    again while the last write is fresh; a changed load, or KV events, are written at once; once
    ``quiet_resend_s`` has passed the unchanged load is written with its new time."""
    with LocalRedis() as server:
        blocks = BlockManager(8, 4)
        hashes = hash_token_blocks(list(range(8)), 4, ("m",))
        state = {"waiting": 0}

        def snapshot():
            return blocks.drain_events(), WorkerLoad("w0", "decode", state["waiting"], 0, 0, 0, 0,
                                                     blocks.num_free_blocks, 8, 4, 64, 4)

        reporter = WorkerReporter(server.url, "quiet", "w0", snapshot, interval_s=3600, heartbeat_ttl_s=3600)
        client = redis.Redis.from_url(server.url)

        def written() -> WorkerLoad:
            return read_loads(client, "quiet", ["w0"])["w0"]

        try:
            assert reporter.quiet_resend_s == 1.0
            assert reporter.report_now() and reporter.unsent == 0
            first = written()
            assert reporter.report_now() and reporter.report_now() and reporter.unsent == 2
            assert written() == first  # its time too: not written again
            state["waiting"] = 1
            assert reporter.report_now() and reporter.unsent == 2
            changed = written()
            assert changed.waiting == 1 and changed.updated_at > first.updated_at
            blocks.cache_block(blocks.allocate(1)[0], hashes[0])  # an event, the load as it was
            assert reporter.report_now() and reporter.unsent == 2
            assert KVIndexReader(client, "quiet").prefix_blocks(hashes[:1]) == {"w0": 1}
            again = written()
            assert again.free_blocks == blocks.num_free_blocks
            assert reporter.report_now() and reporter.unsent == 3
            reporter.quiet_resend_s = 0.0  # the last write has aged past it
            assert reporter.report_now() and reporter.unsent == 3
            renewed = written()
            assert renewed.updated_at > again.updated_at
            assert replace(renewed, updated_at=0) == replace(again, updated_at=0)
        finally:
            reporter.stop()


def test_an_unchanged_report_is_sent_again_after_redis_was_unreachable():
    """A write that failed leaves nothing to repeat: the next report goes out whole."""
    with LocalRedis() as server:
        port = server.port

        def snapshot():
            return [], WorkerLoad("w0", "decode", 0, 0, 0, 0, 0, 8, 8, 4, 64, 4)

        reporter = WorkerReporter(server.url, "quiet", "w0", snapshot, interval_s=3600, heartbeat_ttl_s=3600)
        try:
            assert reporter.report_now()
            server.stop()
            reporter._sent_at -= 3600  # the unchanged report is due again ...
            assert not reporter.report_now() and not reporter.connected  # ... and fails
            restarted = LocalRedis(port=port)
            try:
                assert reporter.report_now() and reporter.connected and reporter.unsent == 0
                client = redis.Redis.from_url(restarted.url)
                assert read_loads(client, "quiet", ["w0"])["w0"].free_blocks == 8
            finally:
                restarted.stop()
        finally:
            reporter.stop()


def _process_exists(pid: int) -> bool:
    """Whether the pid names a process, a zombie included (a reaped child has no /proc entry)."""
    return Path(f"/proc/{pid}").exists()


def test_embedded_redis_killed_is_reaped_restarted_and_repopulated():
    """kill -9 of the private redis-server: the supervisor reaps it (no zombie), starts it again
    on the same port, and the worker's reporter re-publishes its whole state there."""
    with LocalRedis() as server:
        port, url = server.port, server.url
        blocks = BlockManager(8, 4)
        hashes = hash_token_blocks(list(range(12)), 4, ("m",))

        def snapshot():
            return blocks.drain_events(), WorkerLoad("w0", "decode", 0, 0, 0, 0, 0, blocks.num_free_blocks, 8, 4,
                                                     64, 4)

        reporter = WorkerReporter(url, "sup", "w0", snapshot, interval_s=0.05, heartbeat_ttl_s=1.0)
        try:
            for block_id, h in zip(blocks.allocate(3), hashes):
                blocks.cache_block(block_id, h)
            reader = KVIndexReader(redis.Redis.from_url(url), "sup")
            wait_for(lambda: reader.prefix_blocks(hashes) == {"w0": 3}, what="stored blocks")
            killed = server.process.pid
            os.kill(killed, signal.SIGKILL)
            wait_for(lambda: server.restarts == 1, what="the supervisor to start redis-server again")
            assert server.port == port and server.process.pid != killed
            assert not _process_exists(killed)  # reaped, not a zombie
            reader = KVIndexReader(redis.Redis.from_url(url), "sup")
            wait_for(lambda: reader.prefix_blocks(hashes) == {"w0": 3}, what="re-published blocks")
            assert reporter.connected and reporter.resyncs == 1
        finally:
            reporter.stop()
        last = server.process.pid
    assert not _process_exists(last)  # stop() ends the server it started last, and no restart follows
    assert server.restarts == 1


def test_embedded_redis_restarts_are_bounded(monkeypatch):
    """A redis-server that keeps dying is started again at most MAX_RESTARTS times within the
    window; then the supervisor gives up, and the last one is reaped too."""
    from cluster.registry import local_redis

    monkeypatch.setattr(local_redis, "MAX_RESTARTS", 2)
    with LocalRedis() as server:
        pids = []
        for expected in (1, 2):
            pids.append(server.process.pid)
            os.kill(server.process.pid, signal.SIGKILL)
            wait_for(lambda: server.restarts == expected, what=f"restart {expected}")
        pids.append(server.process.pid)
        os.kill(server.process.pid, signal.SIGKILL)
        wait_for(lambda: not server._supervisor.is_alive(), what="the supervisor to give up")
        assert server.restarts == 2
        assert not any(_process_exists(pid) for pid in pids)
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(server.url, socket_timeout=1).ping()


def test_a_url_with_password_and_database_number():
    """Workers and readers reach a password-protected Redis in the URL's database; a wrong
    password is refused with a message naming where and why."""
    from cluster.deployment.deployment import check_registry as _check_registry
    from cluster.engine.config import EngineConfigError

    with LocalRedis(password="s3cret") as server:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/2"
        _check_registry(url)
        hashes = hash_token_blocks(list(range(8)), 4, ("m",))
        blocks = BlockManager(4, 4)
        for block_id, h in zip(blocks.allocate(2), hashes):
            blocks.cache_block(block_id, h)

        def snapshot():
            return blocks.drain_events(), WorkerLoad("w", "prefill", 0, 0, 0, 0, 0, 2, 4, 4, 64, 4)

        reporter = WorkerReporter(url, "auth", "w", snapshot, interval_s=0.05)
        try:
            in_db2 = redis.Redis.from_url(url)
            wait_for(lambda: KVIndexReader(in_db2, "auth").prefix_blocks(hashes) == {"w": 2}, what="blocks in db 2")
            assert redis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/0").dbsize() == 0
        finally:
            reporter.stop()
        with pytest.raises(EngineConfigError, match=rf"cannot reach the registry Redis at 127.0.0.1:{server.port} "
                                                     r"\(db 2\): .*(invalid|WRONGPASS)"):
            _check_registry(f"redis://:wrong@127.0.0.1:{server.port}/2")


@pytest.fixture(scope="module")
def ray_session():
    ray = ensure_ray(CLUSTER, num_cpus=8)
    yield ray
    ray.shutdown()


def test_redis_killed_and_restarted_mid_run_loses_no_request(checkpoint, ray_session):
    model_dir = checkpoint("llama")
    server = LocalRedis()
    port, url = server.port, server.url
    system = random_prompts([48], seed=11)[0]
    prompts = [system + p for p in random_prompts([8 + i for i in range(24)], seed=12)]
    try:
        with DisaggregatedLLM.from_args(str(model_dir), cluster_name=CLUSTER, prefill_workers=2, decode_workers=2,
                                        registry_url=url, num_kv_blocks=128, verbose=False,
                                        restart_workers=False) as llm:  # decode-1, killed at the end, stays dead
            client = redis.Redis.from_url(url)
            reader = KVIndexReader(client, CLUSTER)
            assert reader.alive_workers() == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
            first = llm.generate(prompts[:4], greedy(4))
            assert all(o.error is None for o in first)
            chain = hash_token_blocks(prompts[0], BLOCK, tuple(ray_session.get(llm.decode[0].describe.remote())
                                                               ["hash_keys"]))
            held = wait_for(lambda: {w: n for w, n in reader.prefix_blocks(chain).items() if n}, what="held blocks")
            assert max(held.values()) == 3  # 48 + 8 tokens: 3 full blocks, in the registry

            outputs: list = []
            run = threading.Thread(target=lambda: outputs.extend(llm.generate(prompts[4:14], greedy(24))))
            run.start()
            wait_for(lambda: llm.router_status()["placed"] >= 10, what="the second batch to start")
            server.stop()  # mid-run: the requests in flight finish
            run.join(timeout=120)
            assert not run.is_alive()
            assert len(outputs) == 10 and all(o.error is None and len(o.token_ids) == 24 for o in outputs)
            while_down = llm.generate(prompts[14:], greedy(24))  # placed by load only
            assert len(while_down) == 10 and all(o.error is None and len(o.token_ids) == 24 for o in while_down)
            assert llm.router_status()["placed_by_load_only"] > 0
            assert "placing by load only" in llm.router_status()["registry"]
            server = LocalRedis(port=port)

            client = redis.Redis.from_url(url)
            reader = KVIndexReader(client, CLUSTER)
            wait_for(lambda: reader.alive_workers() == {"prefill-0", "prefill-1", "decode-0", "decode-1"},
                     what="workers to re-register")
            wait_for(lambda: max(reader.prefix_blocks(chain).values(), default=0) == 3, what="blocks re-published")
            wait_for(lambda: llm.router_status()["registry"] == "ok", what="the router to find the registry back")
            after = llm.generate(prompts[:2], greedy(4))
            assert all(o.error is None for o in after)
            assert not any(llm.decisions[o.request_id].load_only for o in after)
            # Records made while Redis was down waited in the router and are written now (soon after
            # the next is made); those written before the kill went with the old, unpersisted server.
            status = wait_for(lambda: (s := llm.router_status())["in_flight"] == 0
                              and s["goodput_records_waiting"] == 0 and s,
                              what="the router to hear that every request finished and write its records")
            assert status["registry"] == "ok"
            goodput = GoodputReader(client, CLUSTER).window(120)
            assert goodput.requests >= 2 and goodput.failed == 0

            ray_session.kill(llm.decode[1])
            wait_for(lambda: "decode-1" not in reader.alive_workers(), timeout_s=10, what="decode-1 to expire")
            reader.sweep()
            assert "decode-1" not in reader.prefix_blocks(chain)
            survivors = llm.generate(prompts[:3], greedy(4))
            assert all(o.error is None for o in survivors)
    finally:
        server.stop()


def test_embedded_redis_killed_under_a_running_cluster_comes_back(checkpoint, ray_session):
    """The private redis-server of a cluster, killed with -9 while it serves: requests go on,
    the supervisor starts it again on the same port, every worker registers again, and the
    router leaves load-only placement."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([40, 20, 30], seed=13)
    with DisaggregatedLLM.from_args(str(model_dir), cluster_name=CLUSTER, num_kv_blocks=64, verbose=False) as llm:
        server = llm.local_redis
        port, killed = server.port, server.process.pid
        os.kill(killed, signal.SIGKILL)
        during = llm.generate(prompts[:1], greedy(4))
        assert during[0].error is None
        wait_for(lambda: server.restarts == 1, what="the supervisor to start redis-server again")
        assert server.port == port and not _process_exists(killed)
        reader = KVIndexReader(redis.Redis.from_url(llm.registry_url), CLUSTER)
        wait_for(lambda: reader.alive_workers() == {"prefill-0", "decode-0"}, what="workers to register again")

        def placed_with_the_registry() -> bool:
            output = llm.generate(prompts[1:2], greedy(2))[0]
            return output.error is None and not llm.decisions[output.request_id].load_only

        wait_for(placed_with_the_registry, timeout_s=30, every_s=0.5, what="placement with the registry again")
        assert llm.router_status()["registry"] == "ok"
    assert not _process_exists(server.process.pid)
