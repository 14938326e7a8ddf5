"""A cluster with peer pulls on (``kv.peer_pull``) for the e2e tests that pull
(``tests/e2e/test_peer_pull_cluster.py``, ``test_peer_pull_tp2.py``): 1 prefill and 2 decode
workers as Ray actors over gloo, a private redis-server as the registry, and the request path an
ingress replica runs (its router in this process), with what drives and checks a pull.

Two things are set here that a real deployment would not need:

* The router's price of a pulled block is set to nothing: its prior (``DEFAULT_PULL_S_PER_BLOCK``,
  measured for the default model's 720 KiB blocks), and what a decode worker's pulls measured
  (``WorkerLoad.pull_s_per_block``: a loaded machine's gloo receive of a few-KiB block took
  longer than the tiny model computes one, and then rightly no pull was chosen). The router is
  otherwise unchanged, and chooses the pull by its own arithmetic.
* The worker that caches the prompt is marked draining (as ``tandem scale remove`` does at
  first), and the prefill worker with it, so the router places the next request on its peer,
  prefilling there: a draining worker still lends its cache. The prefill worker caches nothing, so it never holds the prompt itself, and every
  engine prefills 16 tokens a step (``STEP_TOKENS``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.engine.block_hash import hash_token_blocks, request_hash_keys
from cluster.engine.sampling_params import SamplingParams
from cluster.offline.disaggregated import DisaggregatedLLM
from cluster.offline.spec_from_args import disaggregated_spec
from cluster.protocol.messages import ApiRequest, RequestFailed
from cluster.registry.kv_index import KVIndexReader
from cluster.registry.load import read_loads
from cluster.registry.reporter import connect
from cluster.runtime.ray_runtime import ensure_ray
from conftest import random_prompts, wait_for
from reference_checks import reference_greedy
from router import cost_model, peer_pull
from router import router as router_module

CLUSTER = "tandem-peer-pull-tests"
BLOCK = 16
BLOCKS = 64
MAX_TOKENS = 8
PULL_TIMEOUT_S = 3.0
# Prompts are prefilled 16 tokens a step, so every step a pull saves is a step's fixed cost the
# router sees: the pull is predicted sooner than computing here, and than a prefill worker's
# (which computes the whole prompt), whatever the noise in its fits of a loaded machine.
STEP_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
DECODE = ("decode-0", "decode-1")


def running(checkpoint, decode_tp: int):
    """The cluster (for a module fixture to ``yield from``): (its DisaggregatedLLM, a registry
    client), once each decode worker reports its peer in ``pull_from``; stopped after."""
    patch = pytest.MonkeyPatch()
    patch.setattr(cost_model, "DEFAULT_PULL_S_PER_BLOCK", 0.0)
    patch.setattr(router_module, "best_pull", lambda *args: peer_pull.best_pull(*args[:6]))  # measured pulls unread
    ray = ensure_ray(CLUSTER, num_cpus=8)
    spec, engine = disaggregated_spec(str(checkpoint("llama")), cluster_name=CLUSTER, decode_workers=2,
                                      decode_tp=decode_tp, num_kv_blocks=BLOCKS, block_size=BLOCK,
                                      max_num_batched_tokens=STEP_TOKENS, max_num_seqs=4,
                                      restart_workers=False, role_args={"prefill": {"enable_prefix_caching": False}})
    spec = replace(spec, kv=replace(spec.kv, peer_pull=True, pull_timeout_s=PULL_TIMEOUT_S))
    llm = DisaggregatedLLM(spec, engine, verbose=False)
    registry = connect(llm.registry_url)
    try:
        # Each decode worker pulls from the other through a pair of its own, and says so.
        wait_for(lambda: pull_from(llm, registry) == {"decode-0": ("decode-1",), "decode-1": ("decode-0",)},
                 60, "both decode workers reporting their peer in pull_from")
        yield llm, registry
    finally:
        registry.close()
        llm.shutdown()
        ray.shutdown()
        patch.undo()


def pull_from(llm: DisaggregatedLLM, registry) -> dict[str, tuple[str, ...]]:
    return {w: load.pull_from for w, load in read_loads(registry, CLUSTER, DECODE).items()}


def serve(llm: DisaggregatedLLM, prompt: list[int], request_id: str):
    """One request down the ingress's request path: its tokens and its last message's ending."""
    async def run():
        tokens, end = [], None
        async for message in llm.path.generate(ApiRequest(list(prompt), request_id=request_id, sampling=GREEDY)):
            if isinstance(message, RequestFailed):
                raise AssertionError(f"{request_id}: {message.kind}: {message.message}")
            tokens += message.token_ids
            end = message.end or end
        await end.router_told
        return tokens, end

    return llm._on_loop(run(), timeout_s=120)


def registry_holds(llm: DisaggregatedLLM, registry, worker: str, prompt: list[int], blocks: int) -> None:
    """Waits until the registry shows ``worker`` holding the prompt's first ``blocks`` blocks."""
    keys = request_hash_keys(llm.deployment.info.router_topology.hash_keys)
    hashes = hash_token_blocks(prompt[:blocks * BLOCK], BLOCK, keys)
    wait_for(lambda: KVIndexReader(registry, CLUSTER).prefix_blocks(hashes, [worker]).get(worker, 0) >= blocks,
             30, f"the registry to show {worker} holding {blocks} blocks")


def draining(llm: DisaggregatedLLM, workers: set[str]) -> None:
    """Marks ``workers`` draining (no new placements) and waits for the router to place by it.
    The prefill worker drains with them (``holding``), so the request left to place has no
    remote prefill to choose: only its other decode worker, pulling or computing, and the pull
    is the sooner by the router's arithmetic however a loaded machine skews the step fits (a
    prefill worker computing the whole prompt won once under load against a pull of 4 blocks)."""
    deployment = llm.deployment
    deployment.draining = set(workers)
    version = deployment.publish_membership().version
    wait_for(lambda: llm.router_status()["topology_version"] >= version, 30, "the router to read the membership")


def holding(holder: str) -> set[str]:
    """The workers drained while a request is placed to pull from ``holder``: it, and the prefill worker."""
    return {holder, "prefill-0"}


def no_block_in_use(llm: DisaggregatedLLM) -> None:
    def idle():
        return {w["name"]: w["kv_blocks_used"] for w in llm.worker_status()} == {
            "prefill-0": 0, "decode-0": 0, "decode-1": 0}

    wait_for(idle, 30, "every worker's KV blocks free")


def served_by_a_pull(llm: DisaggregatedLLM, registry, reference, seed: int) -> None:
    prompt = random_prompts([70], seed=seed)[0]  # 4 cacheable blocks; the last 6 tokens are always computed
    expected, _ = reference_greedy(reference, prompt, MAX_TOKENS)
    tokens, first = serve(llm, prompt, "first")
    assert tokens == expected
    holder = first.decision.decode
    other = next(w for w in DECODE if w != holder)
    registry_holds(llm, registry, holder, prompt, 4)
    try:
        draining(llm, holding(holder))
        # The other worker comes to hold the prompt's first 2 blocks itself (pulled or computed).
        head = prompt[:2 * BLOCK] + [7]
        tokens, head_end = serve(llm, head, "head")
        assert head_end.decision.decode == other
        tokens, end = serve(llm, prompt, "pulled")
    finally:
        draining(llm, set())
    decision, pull = end.decision, end.pull
    assert (decision.decode, decision.prefill, decision.kv_source, decision.kv_source_blocks) == (
        other, None, holder, 4), (decision, head_end.pull, pull_from(llm, registry))
    # Only the 2 blocks it lacked travelled, and it computed only the 6 tokens past the 4 blocks.
    assert (pull.source, pull.blocks_asked, pull.blocks_held, pull.blocks_pulled, pull.error) == (holder, 4, 2, 2, None)
    assert pull.bytes > 0 and pull.bytes % 2 == 0 and pull.span[0] <= pull.span[1]
    assert end.usage.cached_tokens == 4 * BLOCK
    assert tokens == expected
    pulls = next(w["pulls"] for w in llm.worker_status() if w["name"] == other)  # what `tandem status` shows
    assert pulls["pulled"] >= 1 and pulls["blocks"] >= 2, pulls
    # The pull it made prices its next ones: its reports carry what it took per block.
    wait_for(lambda: read_loads(registry, CLUSTER, [other])[other].pull_s_per_block > 0, 30,
             f"{other} to report its pulls' cost")
    no_block_in_use(llm)
