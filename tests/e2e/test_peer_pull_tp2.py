"""Peer pulls between decode workers of TP 2 (the cluster: ``tests/peer_pull_cluster.py``):
each rank of the peer sends its KV heads of the blocks the receiver lacks, each rank of the
receiver takes its own; the greedy tokens are ``transformers``'s and nothing stays in use."""

from __future__ import annotations

import pytest

from peer_pull_cluster import running, served_by_a_pull

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tp2_cluster(checkpoint):
    yield from running(checkpoint, decode_tp=2)


def test_decode_workers_of_tp_2_pull_each_rank_its_shard(tp2_cluster, reference_model, checkpoint):
    llm, registry = tp2_cluster
    assert {w["name"]: w["tp"] for w in llm.worker_status()} == {"prefill-0": 1, "decode-0": 2, "decode-1": 2}
    served_by_a_pull(llm, registry, reference_model(checkpoint("llama")), seed=33)
