"""The KV-block registry against a real redis-server (started on loopback for the module)."""

from __future__ import annotations

import time

import pytest
import redis

from cluster.engine.block_hash import hash_token_blocks
from cluster.engine.block_manager import AllBlocksCleared, BlockManager, BlockRemoved, BlockStored
from cluster.registry.kv_index import LOOKUP_CHUNK, KVIndexPublisher, KVIndexReader
from cluster.registry.local_redis import LocalRedis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server():
    with LocalRedis() as local:
        yield local


@pytest.fixture
def client(server):
    c = redis.Redis.from_url(server.url)
    c.flushdb()
    yield c
    c.close()


def chain(n: int, seed: int = 0) -> list[bytes]:
    return hash_token_blocks(list(range(seed, seed + 4 * n)), 4, ("test-model",))


def test_events_from_a_block_manager_are_reflected(client):
    blocks = BlockManager(8, 4)
    hashes = chain(3)
    ids = blocks.allocate(3)
    for block_id, h in zip(ids, hashes):
        blocks.cache_block(block_id, h)
    publisher = KVIndexPublisher(client, "c1", "decode-0")
    publisher.publish(blocks.drain_events())
    reader = KVIndexReader(client, "c1")
    assert reader.prefix_blocks(hashes) == {"decode-0": 3}
    blocks.free(ids)
    blocks.allocate(8)  # reuses the freed blocks: their hashes are evicted
    events = blocks.drain_events()
    assert any(isinstance(e, BlockRemoved) for e in events)
    publisher.publish(events)
    assert reader.prefix_blocks(hashes) == {"decode-0": 0}


def test_lookup_gives_each_workers_prefix_and_stops_at_the_first_miss(client):
    hashes = chain(40)
    a, b = KVIndexPublisher(client, "c2", "a"), KVIndexPublisher(client, "c2", "b")
    a.publish([BlockStored(tuple(hashes[:5]))])
    b.publish([BlockStored(tuple(hashes[:2] + hashes[3:]))])  # holds block 3 onwards but not block 2
    reader = KVIndexReader(client, "c2")
    assert reader.prefix_blocks(hashes) == {"a": 5, "b": 2}
    calls = []
    original = client.pipeline

    def counting_pipeline(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    client.pipeline = counting_pipeline
    reader.prefix_blocks(hashes)
    assert len(calls) == 2, "one round trip for liveness, one chunk of hashes; not 40 / LOOKUP_CHUNK"
    assert len(hashes) > 2 * LOOKUP_CHUNK


def test_clusters_do_not_see_each_other(client):
    hashes = chain(2)
    KVIndexPublisher(client, "one", "w").publish([BlockStored(tuple(hashes))])
    assert KVIndexReader(client, "two").prefix_blocks(hashes) == {}
    assert all(key.startswith(b"tandem:one:") for key in client.keys("*"))


def test_cache_cleared_drops_every_block(client):
    hashes = chain(3)
    publisher = KVIndexPublisher(client, "c3", "w")
    publisher.publish([BlockStored(tuple(hashes))])
    publisher.publish([AllBlocksCleared()])
    assert KVIndexReader(client, "c3").prefix_blocks(hashes) == {"w": 0}
    assert not client.exists("tandem:c3:worker:w:blocks")


def test_a_worker_that_stops_beating_expires_with_its_blocks(client):
    hashes = chain(2)
    KVIndexPublisher(client, "c4", "dies", heartbeat_ttl_s=0.5).publish([BlockStored(tuple(hashes))])
    live = KVIndexPublisher(client, "c4", "lives", heartbeat_ttl_s=30)
    live.publish([BlockStored(tuple(hashes[:1]))])
    reader = KVIndexReader(client, "c4")
    assert reader.prefix_blocks(hashes) == {"dies": 2, "lives": 1}
    time.sleep(0.8)
    assert reader.prefix_blocks(hashes) == {"lives": 1}
    assert reader.sweep() == ["dies"]
    assert client.smembers(f"tandem:c4:block:{hashes[0].hex()}") == {b"lives"}


def test_after_a_redis_restart_the_worker_republishes_its_whole_state(client):
    hashes = chain(4)
    publisher = KVIndexPublisher(client, "c5", "w")
    publisher.publish([BlockStored(tuple(hashes[:3]))])
    client.flushall()  # what a restart without persistence leaves
    assert publisher.publish([BlockStored((hashes[3],))]) is True
    assert KVIndexReader(client, "c5").prefix_blocks(hashes) == {"w": 4}
    assert publisher.publish([BlockRemoved((hashes[3],))]) is False
    assert KVIndexReader(client, "c5").prefix_blocks(hashes) == {"w": 3}
