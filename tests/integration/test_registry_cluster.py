"""The registry with real workers, real Redis and real Ray: workers' KV events and load reach
Redis, a killed worker expires, and Redis killed and restarted mid-run loses no request and is
rebuilt by the workers' re-publishing."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from cluster.disaggregated import DisaggregatedLLM
from cluster.engine.block_hash import hash_token_blocks
from cluster.engine.block_manager import BlockManager
from cluster.engine.sampling_params import SamplingParams
from cluster.ray_runtime import ensure_ray
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


def test_a_url_with_password_and_database_number():
    """Workers and readers reach a password-protected Redis in the URL's database; a wrong
    password is refused with a message naming where and why."""
    from cluster.deployment import check_registry as _check_registry
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
        with DisaggregatedLLM(str(model_dir), cluster_name=CLUSTER, prefill_workers=2, decode_workers=2,
                              registry_url=url, num_kv_blocks=128, verbose=False) as llm:
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
            time.sleep(1.2)  # the router's registry_retry_s: it tries the registry again after this
            after = llm.generate(prompts[:2], greedy(4))
            assert all(o.error is None for o in after)
            assert not any(llm.decisions[o.request_id].load_only for o in after)
            status = llm.router_status()
            assert status["registry"] == "ok" and status["in_flight"] == 0
            # Records made while Redis was down waited in the router and are written now; those
            # written before the kill went with the old, unpersisted server.
            assert status["goodput_records_waiting"] == 0
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
