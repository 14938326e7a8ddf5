"""The KV-block registry against a real redis-server (one on loopback for the session, from
tests/conftest.py)."""

from __future__ import annotations

import time

import pytest
import redis

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


def count_round_trips(client) -> list:
    """Patches ``client`` to note each command it sends alone (a script call too) and each
    pipeline it executes; returns the list the notes go to."""
    calls = []
    send, pipeline = client.execute_command, client.pipeline

    def counted_send(*args, **kwargs):
        calls.append(args[0])
        return send(*args, **kwargs)

    def counted_pipeline(*args, **kwargs):
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        def counted_execute(*a, **k):
            calls.append("pipeline")
            return execute(*a, **k)

        pipe.execute = counted_execute
        return pipe

    client.execute_command, client.pipeline = counted_send, counted_pipeline
    return calls


def two_workers_on_a_long_chain(client, cluster: str) -> list[bytes]:
    hashes = chain(40)
    a, b = KVIndexPublisher(client, cluster, "a"), KVIndexPublisher(client, cluster, "b")
    a.publish([BlockStored(tuple(hashes[:5]))])
    b.publish([BlockStored(tuple(hashes[:2] + hashes[3:]))])  # holds block 3 onwards but not block 2
    return hashes


def test_lookup_gives_each_workers_prefix_in_one_round_trip(redis_client):
    hashes = two_workers_on_a_long_chain(redis_client, "c2")
    reader = KVIndexReader(redis_client, "c2")
    assert reader.prefix_blocks(hashes) == {"a": 5, "b": 2}
    assert reader.prefix_blocks(hashes, ["b"]) == {"b": 2}
    assert reader.prefix_blocks(chain(3, seed=1000), ["a", "b"]) == {"a": 0, "b": 0}
    assert reader.prefix_blocks([], ["a"]) == {"a": 0}
    calls = count_round_trips(redis_client)
    reader.prefix_blocks(hashes)
    assert calls == ["SMEMBERS", "pipeline", "EVALSHA"], "two round trips for liveness, one for the whole chain"
    assert reader.scripting


def test_without_scripts_the_lookup_is_pipelined_and_stops_at_the_first_miss(redis_client):
    hashes = two_workers_on_a_long_chain(redis_client, "c2b")
    reader = KVIndexReader(redis_client, "c2b")

    def refused(**_):
        raise redis.ResponseError("unknown command 'EVALSHA'")

    reader._script = refused  # a server (or proxy) that does not run scripts
    assert reader.prefix_blocks(hashes) == {"a": 5, "b": 2}
    assert not reader.scripting
    calls = count_round_trips(redis_client)
    reader.prefix_blocks(hashes)
    assert calls == ["SMEMBERS", "pipeline", "pipeline"], "liveness, then one chunk of hashes; not 40 / LOOKUP_CHUNK"
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


def test_a_worker_its_deployment_saw_die_is_forgotten_at_once_and_its_loss_recorded(redis_client):
    """``forget``: the dead worker's heartbeat, load, blocks and sequence go now, not after its
    heartbeat; another worker's stay. Its loss and its return are kept newest first, capped."""
    from cluster.registry.keys import Keys
    from cluster.registry.load import WorkerLoad, publish_load, read_loads
    from cluster.registry.worker_events import EVENTS_KEPT, LOST, RESTARTED, WorkerEvent, read_events, record_event

    hashes = chain(3)
    for worker in ("decode-0", "decode-1"):
        KVIndexPublisher(redis_client, "c1", worker, heartbeat_ttl_s=60).publish(
            [BlockStored(tuple(hashes))])
        publish_load(redis_client, "c1", WorkerLoad(worker, "decode", 0, 0, 0, 0, 0, 8, 8, 4, 64, 4,
                                                    node_id=f"node-{worker}", node_address="10.0.0.1"), 60)
    reader = KVIndexReader(redis_client, "c1")
    reader.forget("decode-0")
    assert reader.alive_workers() == {"decode-1"}
    assert reader.prefix_blocks(hashes) == {"decode-1": 3}
    assert {k.decode() for k in redis_client.keys("tandem:c1:*decode-0*")} == set()
    assert {w: load.node_id for w, load in read_loads(redis_client, "c1", ["decode-0", "decode-1"]).items()} == {
        "decode-1": "node-decode-1"}
    record_event(redis_client, "c1", WorkerEvent("decode-0", "decode", LOST, "node-decode-0", "10.0.0.1", at=1.0))
    record_event(redis_client, "c1", WorkerEvent("decode-0", "decode", RESTARTED, "node-x", "10.0.0.2", at=2.0))
    assert [(e.event, e.node_id, e.at) for e in read_events(redis_client, "c1")] == [
        (RESTARTED, "node-x", 2.0), (LOST, "node-decode-0", 1.0)]
    for i in range(EVENTS_KEPT):
        record_event(redis_client, "c1", WorkerEvent(f"w{i}", "decode", LOST, "n", "a", at=3.0 + i))
    assert redis_client.llen(Keys("c1").worker_events) == EVENTS_KEPT
    assert [e.worker for e in read_events(redis_client, "c1", limit=2)] == [f"w{EVENTS_KEPT - 1}", f"w{EVENTS_KEPT - 2}"]


def test_a_placement_reads_the_load_reports_and_the_prefix_hits_in_one_round_trip(redis_client):
    from cluster.registry.load import WorkerLoad, publish_load
    from router.registry_view import RedisRegistryView

    hashes = two_workers_on_a_long_chain(redis_client, "c2c")
    for worker in ("a", "b"):
        publish_load(redis_client, "c2c", WorkerLoad(worker, "decode", 0, 1, 0, 0, 7, 90, 100, 4, 64, 8), 10.0)
    view = RedisRegistryView(redis_client, "c2c")
    view.prefix_blocks(hashes, ["a"])  # the script is loaded, as the first placement's lookup does
    calls = count_round_trips(redis_client)
    loads, hits = view.loads_and_prefix_blocks(["a", "b", "gone"], hashes)
    assert calls == ["pipeline"], "the MGET and the script's EVALSHA together, not asking first whether it is loaded"
    assert (sorted(loads), loads["b"].decode_context_tokens, hits) == (["a", "b"], 7, {"a": 5, "b": 2, "gone": 0})
    redis_client.script_flush()  # Redis restarted: its scripts are gone, the reports and blocks republished
    calls.clear()
    assert view.loads_and_prefix_blocks(["a", "b"], hashes)[1] == {"a": 5, "b": 2}
    assert calls == ["pipeline", "EVALSHA", "SCRIPT LOAD", "EVALSHA"]  # the lookup alone, loading its script
