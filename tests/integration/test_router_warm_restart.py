"""A router started again (its ingress replica restarted) against a registry that workers
populated places as the one before it did: the same workers, the same prefix hits, from its
first placement. Real Redis (tests/conftest.py's loopback server)."""

from __future__ import annotations

import pytest

from cluster.engine.block_hash import hash_token_blocks
from cluster.engine.block_manager import BlockManager
from cluster.registry.kv_index import KVIndexPublisher
from cluster.registry.load import StepSample, WorkerLoad, publish_load
from router.config import RouterConfig
from router.registry_view import RedisRegistryView
from router.router import RouteRequest, Router, Topology

pytestmark = pytest.mark.integration

CLUSTER = "warm-restart"
BS = 4
KEYS = ("m",)
TOPOLOGY = Topology(prefill=("p0", "p1"), decode=("d0", "d1"), block_size=BS, hash_keys=KEYS)
PREFILL_STEPS = tuple(StepSample(n, 0, 0, 0, 0.010 + 0.001 * n) for n in (16, 64, 256))
DECODE_STEPS = tuple(StepSample(0, 0, s, c, 0.020 + 0.005 * s + 0.0001 * c) for s, c in ((1, 100), (2, 400), (4, 300)))
# Each conversation's prompt, and the worker that cached how many of its blocks.
PROMPTS = [list(range(1000 * i, 1000 * i + 41)) for i in range(6)]  # 10 cacheable blocks each
HELD = {0: [("p0", 10), ("d1", 4)], 1: [("p1", 10)], 2: [("p1", 6), ("d0", 10)], 3: [("p0", 3)],
        4: [("d1", 10), ("p1", 10)], 5: []}


def populate(client) -> None:
    """What the workers would have published: their load reports and their cached blocks."""
    for worker in TOPOLOGY.prefill + TOPOLOGY.decode:
        role = "prefill" if worker.startswith("p") else "decode"
        steps = PREFILL_STEPS if role == "prefill" else PREFILL_STEPS + DECODE_STEPS
        publish_load(client, CLUSTER, WorkerLoad(worker, role, 0, 0, 0, 0, 0, 100, 100, BS, 2048, 16, steps), 600)
        blocks = BlockManager(100, BS)
        for conversation, held in HELD.items():
            for holder, count in held:
                if holder == worker:
                    hashes = hash_token_blocks(PROMPTS[conversation], BS, KEYS)[:count]
                    for block_id, block_hash in zip(blocks.allocate(count), hashes):
                        blocks.cache_block(block_id, block_hash)
        KVIndexPublisher(client, CLUSTER, worker, heartbeat_ttl_s=600).publish(blocks.drain_events())


def placements(router: Router) -> list[tuple]:
    out = []
    for index, prompt in enumerate(PROMPTS):
        decision = router.route(RouteRequest(f"r{index}", prompt, max_tokens=4))
        out.append((decision.action, decision.prefill, decision.decode, decision.prefill_hit_blocks,
                    decision.decode_hit_blocks))
        router.forget(f"r{index}")  # as if it finished: each placement sees the same loads
    return out


def test_a_router_started_again_places_as_the_one_before_it(redis_client):
    populate(redis_client)
    config = RouterConfig.from_mapping({"policy": "prefix_affinity", "local_prefill_max_tokens": 0})
    before = Router(TOPOLOGY, RedisRegistryView(redis_client, CLUSTER), config)
    placed = placements(before)
    # Where each prefix is cached: on a prefill worker, or whole on a decode worker (it prefills itself).
    assert [p[1:3] for p in placed[:5]] == [("p0", "d1"), ("p1", "d0"), (None, "d0"), ("p0", "d0"), (None, "d1")]
    assert [p[3] for p in placed] == [10, 10, 10, 3, 10, 0]

    again = Router(TOPOLOGY, RedisRegistryView(redis_client, CLUSTER), config)  # the replica started again
    seconds = again.warm_up()
    assert again.warm_up_s == seconds > 0 and again.status()["warm_up_s"] == seconds
    assert sorted(again.status()["live_workers"]) == ["d0", "d1", "p0", "p1"]
    assert placements(again) == placed
    hit_rate = lambda ps: sum(p[3] for p in ps) / (10 * len(ps))  # noqa: E731
    assert hit_rate(placements(again)) == hit_rate(placed) == 43 / 60
