"""The KV-block registry against a real redis-server (one on loopback for the session, from
tests/conftest.py)."""

from __future__ import annotations

import time

import pytest
import redis

from cluster.engine.block_hash import hash_token_blocks
from cluster.engine.block_manager import AllBlocksCleared, BlockManager, BlockRemoved, BlockStored
from cluster.engine.kv_tiers.host_pool import HostBlockPool
from cluster.engine.kv_tiers.tier import HOST
from cluster.registry.kv_index import LOOKUP_CHUNK, KVIndexPublisher, KVIndexReader, TierHits

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
    assert redis_client.hgetall(f"tandem:c4:block:{hashes[0].hex()}") == {b"lives": b"device"}


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


def refuse_scripts(reader: KVIndexReader) -> KVIndexReader:
    def refused(**_):
        raise redis.ResponseError("unknown command 'EVALSHA'")

    reader._script = refused
    return reader


def test_a_block_offloaded_to_the_host_moves_tier_and_one_the_host_drops_is_removed(redis_client):
    blocks = BlockManager(4, 4, host=HostBlockPool(2))
    hashes = chain(4)
    ids = blocks.allocate(4)
    for block_id, h in zip(ids, hashes):
        blocks.cache_block(block_id, h)
    blocks.free(ids)  # free list 3, 2, 1, 0: the chain's tail goes first
    publisher = KVIndexPublisher(redis_client, "t1", "w")
    publisher.publish(blocks.drain_events())
    reader = KVIndexReader(redis_client, "t1")
    assert reader.prefix_tiers(hashes) == {"w": TierHits(4, 0)}
    key = f"tandem:t1:block:{hashes[3].hex()}"
    assert blocks.allocate(2) == [3, 2]  # blocks 3 and 2 (hashes 3 and 2) to the host tier
    publisher.publish(blocks.drain_events())
    assert redis_client.hgetall(key) == {b"w": b"host"}  # moved, not removed
    assert reader.prefix_tiers(hashes) == {"w": TierHits(2, 2)}
    assert reader.prefix_blocks(hashes) == {"w": 4}
    assert blocks.allocate(1) == [1]  # hash 1 to the host, which drops hash 3 (least recently stored)
    publisher.publish(blocks.drain_events())
    assert redis_client.hgetall(key) == {}
    assert redis_client.hgetall(f"tandem:t1:block:{hashes[1].hex()}") == {b"w": b"host"}
    assert reader.prefix_tiers(hashes) == {"w": TierHits(1, 2)}
    assert refuse_scripts(KVIndexReader(redis_client, "t1")).prefix_tiers(hashes) == {"w": TierHits(1, 2)}
    assert redis_client.smembers("tandem:t1:worker:w:blocks") == {h.hex().encode() for h in hashes[:3]}


def test_a_block_loaded_back_is_on_the_device_until_both_tiers_drop_it(redis_client):
    hashes = chain(1)
    publisher = KVIndexPublisher(redis_client, "t2", "w")
    key = f"tandem:t2:block:{hashes[0].hex()}"
    publisher.publish([BlockStored((hashes[0],), HOST), BlockStored((hashes[0],))])
    assert redis_client.hgetall(key) == {b"w": b"device"}
    publisher.publish([BlockRemoved((hashes[0],))])
    assert redis_client.hgetall(key) == {b"w": b"host"}
    publisher.publish([BlockStored((hashes[0],)), BlockRemoved((hashes[0],), HOST)])
    assert redis_client.hgetall(key) == {b"w": b"device"}
    publisher.publish([BlockRemoved((hashes[0],))])
    assert redis_client.hgetall(key) == {} and not redis_client.exists("tandem:t2:worker:w:blocks")


@pytest.mark.parametrize("scripts", [True, False])
def test_each_workers_prefix_is_device_blocks_then_host_blocks(redis_client, scripts):
    hashes = chain(6)
    d, h = BlockStored, lambda held: BlockStored(held, HOST)
    # a: device 0-1, host 2-3, device 4 (a device block after the host run is computed: the prefix ends)
    KVIndexPublisher(redis_client, "t3", "a").publish([d(tuple(hashes[:2])), h(tuple(hashes[2:4])), d((hashes[4],))])
    KVIndexPublisher(redis_client, "t3", "b").publish([h(tuple(hashes))])  # all on the host
    KVIndexPublisher(redis_client, "t3", "c").publish([d(tuple(hashes[:3]))])  # device only
    KVIndexPublisher(redis_client, "t3", "e").publish([h(tuple(hashes[1:]))])  # not block 0: nothing
    reader = KVIndexReader(redis_client, "t3")
    if not scripts:
        refuse_scripts(reader)
    assert reader.prefix_tiers(hashes) == {"a": TierHits(2, 2), "b": TierHits(0, 6), "c": TierHits(3, 0),
                                           "e": TierHits(0, 0)}
    assert reader.prefix_tiers(hashes, ["a"]) == {"a": TierHits(2, 2)}
    assert reader.scripting is scripts


def test_after_a_gap_the_whole_state_is_republished_with_its_tiers(redis_client):
    hashes = chain(3)
    publisher = KVIndexPublisher(redis_client, "t4", "w")
    publisher.publish([BlockStored(tuple(hashes[:2])), BlockStored((hashes[2],), HOST)])
    redis_client.flushall()
    assert publisher.publish([BlockRemoved((hashes[0],)), BlockStored((hashes[0],), HOST)]) is True
    assert KVIndexReader(redis_client, "t4").prefix_tiers(hashes) == {"w": TierHits(0, 1)}
    assert redis_client.hgetall(f"tandem:t4:block:{hashes[1].hex()}") == {b"w": b"device"}


def test_a_lost_worker_s_report_says_so_to_routers_until_it_is_started_again(redis_client):
    """``mark_lost``: the worker's last report, marked lost and expiring; only a reader that asks
    for lost reports (a router) sees it; the worker started again overwrites it."""
    from cluster.registry.keys import Keys
    from cluster.registry.load import LOST_MARK_S, WorkerLoad, mark_lost, publish_load, read_loads

    report = WorkerLoad("decode-0", "decode", 0, 3, 0, 0, 90, 8, 8, 4, 64, 4, incarnation="a")
    publish_load(redis_client, "c2", report, 60)
    mark_lost(redis_client, "c2", "decode-0", "decode", read_loads(redis_client, "c2", ["decode-0"])["decode-0"])
    assert read_loads(redis_client, "c2", ["decode-0"]) == {}
    lost = read_loads(redis_client, "c2", ["decode-0"], lost=True)["decode-0"]
    assert (lost.lost, lost.incarnation, lost.running) == (True, "a", 3)
    assert 0 < redis_client.pttl(Keys("c2").load("decode-0")) <= LOST_MARK_S * 1000
    mark_lost(redis_client, "c2", "decode-1", "decode", None)  # its report had lapsed already
    assert read_loads(redis_client, "c2", ["decode-1"], lost=True)["decode-1"].lost
    publish_load(redis_client, "c2", WorkerLoad("decode-0", "decode", 0, 0, 0, 0, 0, 8, 8, 4, 64, 4, incarnation="b"), 60)
    assert read_loads(redis_client, "c2", ["decode-0"])["decode-0"].incarnation == "b"


def test_a_placement_reads_the_load_reports_and_the_prefix_hits_in_one_round_trip(redis_client):
    from cluster.registry.load import WorkerLoad, publish_load
    from router.registry_view import RedisRegistryView

    hashes = two_workers_on_a_long_chain(redis_client, "c2c")
    for worker in ("a", "b"):
        publish_load(redis_client, "c2c", WorkerLoad(worker, "decode", 0, 1, 0, 0, 7, 90, 100, 4, 64, 8), 10.0)
    view = RedisRegistryView(redis_client, "c2c")
    view.prefix_tiers(hashes, ["a"])  # the script is loaded, as the first placement's lookup does
    calls = count_round_trips(redis_client)
    loads, hits = view.loads_and_prefix_tiers(["a", "b", "gone"], hashes)
    assert calls == ["pipeline"], "the MGET and the script's EVALSHA together, not asking first whether it is loaded"
    assert (sorted(loads), loads["b"].decode_context_tokens, hits) == (["a", "b"], 7, {"a": TierHits(5), "b": TierHits(2), "gone": TierHits(0)})
    redis_client.script_flush()  # Redis restarted: its scripts are gone, the reports and blocks republished
    calls.clear()
    assert view.loads_and_prefix_tiers(["a", "b"], hashes)[1] == {"a": TierHits(5), "b": TierHits(2)}
    assert calls == ["pipeline", "EVALSHA", "SCRIPT LOAD", "EVALSHA"]  # the lookup alone, loading its script
