"""The KV-block registry against a real redis-server (one on loopback for the session, from
tests/conftest.py)."""

from __future__ import annotations

import time

import pytest

from cluster.engine.block_hash import hash_token_blocks
from cluster.engine.block_manager import AllBlocksCleared, BlockManager, BlockRemoved, BlockStored
from cluster.registry.kv_index import LOOKUP_CHUNK, KVIndexPublisher, KVIndexReader

pytestmark = pytest.mark.integration


def chain(n: int, seed: int = 0) -> list[bytes]:
    return hash_token_blocks(list(range(seed, seed + 4 * n)), 4, ("test-model",))


def test_events_from_a_block_manager_are_reflected(redis_client):
    blocks = BlockManager(8, 4)
    hashes = chain(3)
    ids = blocks.allocate(3)
    for block_id, h in zip(ids, hashes):
        blocks.cache_block(block_id, h)
    publisher = KVIndexPublisher(redis_client, "c1", "decode-0")
    publisher.publish(blocks.drain_events())
    reader = KVIndexReader(redis_client, "c1")
    assert reader.prefix_blocks(hashes) == {"decode-0": 3}
    blocks.free(ids)
    blocks.allocate(8)  # reuses the freed blocks: their hashes are evicted
    events = blocks.drain_events()
    assert any(isinstance(e, BlockRemoved) for e in events)
    publisher.publish(events)
    assert reader.prefix_blocks(hashes) == {"decode-0": 0}


def test_lookup_gives_each_workers_prefix_and_stops_at_the_first_miss(redis_client):
    hashes = chain(40)
    a, b = KVIndexPublisher(redis_client, "c2", "a"), KVIndexPublisher(redis_client, "c2", "b")
    a.publish([BlockStored(tuple(hashes[:5]))])
    b.publish([BlockStored(tuple(hashes[:2] + hashes[3:]))])  # holds block 3 onwards but not block 2
    reader = KVIndexReader(redis_client, "c2")
    assert reader.prefix_blocks(hashes) == {"a": 5, "b": 2}
    calls = []
    original = redis_client.pipeline

    def counting_pipeline(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    redis_client.pipeline = counting_pipeline
    reader.prefix_blocks(hashes)
    assert len(calls) == 2, "one round trip for liveness, one chunk of hashes; not 40 / LOOKUP_CHUNK"
    assert len(hashes) > 2 * LOOKUP_CHUNK


def test_clusters_do_not_see_each_other(redis_client):
    hashes = chain(2)
    KVIndexPublisher(redis_client, "one", "w").publish([BlockStored(tuple(hashes))])
    assert KVIndexReader(redis_client, "two").prefix_blocks(hashes) == {}
    assert all(key.startswith(b"tandem:one:") for key in redis_client.keys("*"))


def test_cache_cleared_drops_every_block(redis_client):
    hashes = chain(3)
    publisher = KVIndexPublisher(redis_client, "c3", "w")
    publisher.publish([BlockStored(tuple(hashes))])
    publisher.publish([AllBlocksCleared()])
    assert KVIndexReader(redis_client, "c3").prefix_blocks(hashes) == {"w": 0}
    assert not redis_client.exists("tandem:c3:worker:w:blocks")


def test_a_worker_that_stops_beating_expires_with_its_blocks(redis_client):
    hashes = chain(2)
    KVIndexPublisher(redis_client, "c4", "dies", heartbeat_ttl_s=0.5).publish([BlockStored(tuple(hashes))])
    live = KVIndexPublisher(redis_client, "c4", "lives", heartbeat_ttl_s=30)
    live.publish([BlockStored(tuple(hashes[:1]))])
    reader = KVIndexReader(redis_client, "c4")
    assert reader.prefix_blocks(hashes) == {"dies": 2, "lives": 1}
    time.sleep(0.8)
    assert reader.prefix_blocks(hashes) == {"lives": 1}
    assert reader.sweep() == ["dies"]
    assert redis_client.smembers(f"tandem:c4:block:{hashes[0].hex()}") == {b"lives"}


def test_after_a_redis_restart_the_worker_republishes_its_whole_state(redis_client):
    hashes = chain(4)
    publisher = KVIndexPublisher(redis_client, "c5", "w")
    publisher.publish([BlockStored(tuple(hashes[:3]))])
    redis_client.flushall()  # what a restart without persistence leaves
    assert publisher.publish([BlockStored((hashes[3],))]) is True
    assert KVIndexReader(redis_client, "c5").prefix_blocks(hashes) == {"w": 4}
    assert publisher.publish([BlockRemoved((hashes[3],))]) is False
    assert KVIndexReader(redis_client, "c5").prefix_blocks(hashes) == {"w": 3}
