"""Peer pulls in a running cluster (``kv.peer_pull``; the cluster: ``tests/peer_pull_cluster.py``).
A prompt one decode worker caches is served on the other, which pulls the blocks it lacks from
its peer and computes only the rest: greedy tokens are ``transformers``'s, only the missing
blocks travel, and no KV block stays in use on any worker. A peer frozen when asked ends in
recomputation at ``kv.pull_timeout_s`` with the same tokens, nothing leaks, and the pair is
built again once the peer runs again; a peer killed while a pull waits on it also ends in
recomputation. (Decode workers of TP 2: ``test_peer_pull_tp2.py``.)
"""

from __future__ import annotations

import os
import signal

import pytest

from conftest import random_prompts, wait_for
from peer_pull_cluster import (DECODE, MAX_TOKENS, PULL_TIMEOUT_S, draining, holding, no_block_in_use, pull_from,
                               registry_holds, running, serve, served_by_a_pull)
from reference_checks import reference_greedy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(checkpoint):
    yield from running(checkpoint, decode_tp=1)


def test_a_prompt_cached_on_one_decode_worker_is_pulled_by_the_other(cluster, reference_model, checkpoint):
    served_by_a_pull(*cluster, reference_model(checkpoint("llama")), seed=31)


def frozen_holder(llm, registry, reference, seed: int, request_id: str):
    """A prompt served once, its holder's blocks in the registry, the holder (and the prefill
    worker) draining and the holder frozen: (prompt, its reference tokens, holder, other, pid)."""
    prompt = random_prompts([70], seed=seed)[0]
    expected, _ = reference_greedy(reference, prompt, MAX_TOKENS)
    tokens, first = serve(llm, prompt, request_id)
    assert tokens == expected
    holder = first.decision.decode
    other = next(w for w in DECODE if w != holder)
    registry_holds(llm, registry, holder, prompt, 4)
    pid = next(w["pid"] for w in llm.worker_status() if w["name"] == holder)
    draining(llm, holding(holder))
    os.kill(pid, signal.SIGSTOP)
    return prompt, expected, holder, other, pid


def test_a_peer_frozen_when_asked_ends_in_recomputation_and_nothing_leaks(cluster, reference_model, checkpoint):
    llm, registry = cluster
    prompt, expected, holder, other, pid = frozen_holder(llm, registry, reference_model(checkpoint("llama")), 32,
                                                         "cached")
    try:
        tokens, end = serve(llm, prompt, "recomputed")
    finally:
        os.kill(pid, signal.SIGCONT)
        draining(llm, set())
    assert (end.decision.decode, end.decision.kv_source) == (other, holder), (end.decision, pull_from(llm, registry))
    pull = end.pull
    assert (pull.blocks_pulled, pull.bytes) == (0, 0)
    assert pull.error == f"{holder} did not answer within {PULL_TIMEOUT_S:g}s (kv.pull_timeout_s)"
    assert end.usage.cached_tokens == 0 and tokens == expected
    # The peer, running again, finds the ask past its deadline and sends nothing; the pair
    # (out of use since the ask timed out) is built again, and nothing stays in use anywhere.
    wait_for(lambda: pull_from(llm, registry).get(other) == (holder,), 120, f"{other} pulling from {holder} again")
    no_block_in_use(llm)


def test_a_peer_killed_mid_pull_ends_in_recomputation_and_nothing_leaks(cluster, reference_model, checkpoint):
    """The peer is frozen when the pull is placed, then killed while the pull waits on it (this
    module's last test: the worker stays dead). The pull ends in recomputation, by the peer's
    death or at the deadline, whichever the receiver sees first: the same tokens, and no KV
    block left in use on the workers that live."""
    from concurrent.futures import ThreadPoolExecutor

    llm, registry = cluster
    prompt, expected, holder, other, pid = frozen_holder(llm, registry, reference_model(checkpoint("llama")), 33,
                                                         "cached-for-kill")
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(serve, llm, prompt, "peer-killed")
        wait_for(lambda: llm.router_status()["in_flight"] >= 1, 30, "the request to be placed")
        os.kill(pid, signal.SIGKILL)
        tokens, end = served.result(timeout=120)
    assert (end.decision.decode, end.decision.kv_source) == (other, holder), end.decision
    pull = end.pull
    assert (pull.blocks_pulled, pull.bytes) == (0, 0)
    assert pull.error in (f"{holder} died", f"{holder} did not answer within {PULL_TIMEOUT_S:g}s (kv.pull_timeout_s)")
    assert end.usage.cached_tokens == 0 and tokens == expected
    wait_for(lambda: all(w["kv_blocks_used"] == 0 for w in llm.worker_status() if w["name"] != holder), 30,
             "the living workers' KV blocks free")
