"""A worker added to a running pool gets the KV share its pool's workers started with where its
node's memory holds it (``cluster/deployment/kv_budget.py``): exact shares, and the line the add
says, for a deployment described by its pools and members."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.deployment.deployment import Deployment
from cluster.deployment.kv_budget import added_worker_share, kv_memory_shares
from cluster.engine.config import EngineConfig
from cluster.engine.host_memory import available_host_memory_bytes, host_memory_bytes

pytestmark = pytest.mark.unit

GIB = 2**30


def test_an_added_worker_takes_its_pool_s_start_share_where_memory_holds_it_twice():
    # 1 prefill + 1 decode started on a 24 GiB node at fraction 0.25: 1/2 each (3 GiB of KV);
    # a third worker counting everyone would get 1/3
    assert added_worker_share(0.5, 1 / 3, ranks=1, fraction=0.25, node_bytes=24 * GIB, available_bytes=6 * GIB) == 0.5
    # 5 GiB free holds 2.5 GiB of KV and as much again: 5/12 of the budget (more than 1/3)
    assert added_worker_share(0.5, 1 / 3, ranks=1, fraction=0.25, node_bytes=24 * GIB,
                              available_bytes=5 * GIB) == pytest.approx(5 / 12)
    assert added_worker_share(0.5, 1 / 3, ranks=1, fraction=0.25, node_bytes=24 * GIB, available_bytes=GIB) == 1 / 3
    # a TP-2 worker's two ranks each take the share: twice the memory
    assert added_worker_share(0.5, 0.25, ranks=2, fraction=0.25, node_bytes=24 * GIB,
                              available_bytes=6 * GIB) == pytest.approx(0.25)
    assert added_worker_share(None, 1 / 3, 1, 0.25, 24 * GIB, 24 * GIB) == 1 / 3  # the pool started with no worker
    assert added_worker_share(0.5, 1.0, 1, 0.25, 24 * GIB, 0) == 1.0  # a node of its own: its whole budget


def test_the_node_memory_read_is_the_engine_s_and_no_more_is_available_than_there_is():
    assert 0 < available_host_memory_bytes() <= host_memory_bytes()
    assert kv_memory_shares([("a", 1, True), ("a", 1, True), ("b", 1, True)]) == [0.5, 0.5, 1.0]


def deployment(available_bytes: int, num_kv_blocks: int | None = None, fails: bool = False):
    """1 prefill + 1 decode started on node n1, decode-1 placed there since."""
    members = {"prefill": ["prefill-0"], "decode": ["decode-0", "decode-1"]}
    pools = {role: SimpleNamespace(role=role, tp=1) for role in members}

    def node_memory(name):
        if fails:
            raise RuntimeError("the node is gone\nmore")
        return 24 * GIB, available_bytes

    return SimpleNamespace(
        members=members, start_shares={"prefill": 0.5, "decode": 0.5},
        _rank_place=lambda name: ("n1", 1, True), pool_of=lambda name: pools[name.rpartition("-")[0]],
        engine_config=lambda name, share: EngineConfig(model="m", kv_cache_memory_fraction=0.25,
                                                       num_kv_blocks=num_kv_blocks, kv_memory_share=share),
        _node_memory=node_memory)


def test_the_add_sizes_the_worker_like_its_pool_and_says_so():
    assert Deployment.added_kv_share(deployment(6 * GIB), "decode-1") == (
        0.5, "decode-1: KV cache 0.5 of its node's budget, as its pool's workers started with")
    assert Deployment.added_kv_share(deployment(5 * GIB), "decode-1") == (
        pytest.approx(5 / 12), "decode-1: KV cache 0.417 of its node's budget, less than its pool's 0.5: "
        "the node has 5.0 GiB free")
    assert Deployment.added_kv_share(deployment(6 * GIB, num_kv_blocks=160), "decode-1") == (1 / 3, "")
    assert Deployment.added_kv_share(deployment(6 * GIB, fails=True), "decode-1") == (
        1 / 3, "decode-1: its node's free memory could not be read (the node is gone); KV cache 0.333 of the "
        "node's budget, not its pool's 0.5")
