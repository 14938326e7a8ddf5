"""Disaggregated prefill and decode on the CPU: workers are Ray actors, KV moves over gloo.

Output must equal the colocated engine's, for TP 1 to TP 1, prefill TP 2 to decode TP 1 and
prefill TP 1 to decode TP 2; a second turn must send only the blocks the decode worker lacks;
a decode worker killed mid-transfer must leave the prefill worker serving the next request
within its deadline, with no leaked blocks on any live worker (those tests keep dead workers
dead: ``restart_workers=False``); a killed worker is started again and serves again. A
constrained request's first token obeys its grammar on the prefill worker, and a moved one's
grammar resumes where it was.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest

from cluster.offline.disaggregated import DisaggregatedLLM
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.speculative.config import SpeculativeConfig
from cluster.engine.structured.spec import StructuredOutput
from cluster.registry.load import read_loads
from cluster.registry.reporter import connect
from cluster.runtime.ray_runtime import ensure_ray
from conftest import random_prompts, wait_for
from router.config import RouterConfig
from reference_checks import PROMPT_LENGTHS, colocated_tokens, greedy, run_batch

pytestmark = pytest.mark.integration

CLUSTER = "tandem-disagg-tests"
BLOCKS = 64


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray = ensure_ray(CLUSTER, num_cpus=8)
    yield ray
    ray.shutdown()


def disaggregated(model_dir, **kwargs) -> DisaggregatedLLM:
    kwargs = {"num_kv_blocks": BLOCKS, "max_num_batched_tokens": 96, "verbose": False,
              "local_prefill_max_tokens": 0, **kwargs}  # every prompt's KV travels, unless a test says otherwise
    return DisaggregatedLLM.from_args(str(model_dir), cluster_name=CLUSTER, **kwargs)


def assert_no_leaks(llm: DisaggregatedLLM) -> None:
    prefill, decode = llm.worker_free_blocks()
    assert all(free == BLOCKS for free in prefill + decode if free is not None), (prefill, decode)


@pytest.mark.parametrize(
    "architecture, prefill_tp, decode_tp",
    [("llama", 1, 1), ("mistral", 1, 1), ("qwen2", 2, 1), ("qwen3", 1, 2), ("llama3", 2, 2)],
)
def test_disaggregated_output_equals_colocated(checkpoint, architecture, prefill_tp, decode_tp):
    model_dir = checkpoint(architecture)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    colocated = run_batch(model_dir).tokens
    with disaggregated(model_dir, prefill_tp=prefill_tp, decode_tp=decode_tp) as llm:
        outputs = llm.generate(prompts, greedy())
        assert [(o.finish_reason, o.error) for o in outputs] == [("length", None)] * len(prompts)
        assert [o.token_ids for o in outputs] == colocated
        block = 16
        sent = {t.request_id: t.blocks_sent for t in llm.transfers}  # transfers end in any order
        assert [sent[o.request_id] for o in outputs] == [-(-n // block) for n in PROMPT_LENGTHS]
        assert_no_leaks(llm)


def test_speculating_decode_workers_give_the_tokens_of_decoding_without_guesses(checkpoint):
    """decode.speculative (n-gram, 4 tokens a step, every proposal checked) reaches the decode
    worker only: on prompts that repeat themselves it guesses, keeps some guesses (several tokens
    a step cross the stream), and its greedy tokens are those of the same requests opted out
    (``speculative: false``) and of the engine without speculation; its status counts the
    guesses, and opted-out requests make none."""
    model_dir = checkpoint("llama")
    bases = [base for seed in range(3) for base in random_prompts([8, 5], seed=seed)]
    prompts = [base * (48 // len(base)) for base in bases]
    params = greedy(32)
    expected = colocated_tokens(model_dir, prompts, params)
    # Without a prefix cache each pass sends every prompt's KV whole: both passes take the same path.
    with disaggregated(model_dir, speculative=SpeculativeConfig(num_tokens=4, adaptive=False),
                       enable_prefix_caching=False) as llm:
        opted_out = llm.generate(prompts, replace(params, speculative=False))
        assert [o.token_ids for o in opted_out] == expected
        workers = {w["role"]: w for w in llm.worker_status()}
        assert workers["decode"]["speculation"]["proposed_tokens"] == 0
        assert workers["prefill"]["speculation"] is None

        outputs = llm.generate(prompts, params)
        assert [(o.finish_reason, o.error) for o in outputs] == [("length", None)] * len(prompts)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in opted_out] == expected
        speculation = {w["role"]: w for w in llm.worker_status()}["decode"]["speculation"]
        assert (speculation["method"], speculation["num_tokens"], speculation["adaptive"]) == ("ngram", 4, False)
        assert speculation["proposed_tokens"] > 0 and speculation["accepted_tokens"] > 0
        assert speculation["acceptance_rate"] == speculation["accepted_tokens"] / speculation["proposed_tokens"]
        assert speculation["tokens_per_verify"] > 1
        # Each request's own counts come back with its end, and add up to the worker's.
        assert sum(o.usage.proposed_tokens for o in outputs) == speculation["proposed_tokens"]
        assert sum(o.usage.accepted_tokens for o in outputs) == speculation["accepted_tokens"]
        assert all(o.usage.proposed_tokens == 0 for o in opted_out)
        assert_no_leaks(llm)


@pytest.mark.parametrize("place, prefill_tp", [("prefill", 1), ("decode", 1), ("prefill", 2)])
def test_a_decode_worker_with_a_draft_model_gives_the_tokens_of_decoding_without_guesses(checkpoint, place, prefill_tp):
    """decode.speculative with method draft (the model itself as its draft), its KV of each prompt
    built where ``draft_prompt_kv`` says: by the prefill worker, sent with the model's (the decode
    worker's draft is fed no prompt token: no catch-up forward), or by the decode worker at the
    request's first guess. From a prefill worker of 2 ranks the model's KV is re-sharded as ever and
    the draft's (run beside rank 0) travels whole between the first ranks. Either way every greedy
    guess is kept (the bookkeeping's check), a
    second pass too (its prompts' blocks cached on the decode worker, only the rest sent), and
    the tokens are the colocated engine's."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([9, 21, 40], seed=4)
    params = greedy(24)
    expected = colocated_tokens(model_dir, prompts, params)
    speculative = SpeculativeConfig(method="draft", draft_model=str(model_dir), num_tokens=3, adaptive=False,
                                    draft_prompt_kv=place)
    with disaggregated(model_dir, speculative=speculative, prefill_tp=prefill_tp) as llm:
        before = {w["role"]: w["draft"] for w in llm.worker_status()}  # the start-up profile's own requests
        served = []
        for _ in range(2):
            outputs = llm.generate(prompts, params)
            assert [(o.finish_reason, o.error) for o in outputs] == [("length", None)] * len(prompts)
            assert [o.token_ids for o in outputs] == expected
            served.extend(zip(outputs, prompts))
        transfers = {t.request_id: t for t in llm.transfers}
        # A second pass's prompt mostly cached on the decode worker may be prefilled there: its
        # draft then catches up on the uncached tokens, whatever the place.
        local = sum(len(p) - o.usage.cached_tokens for o, p in served if o.request_id not in transfers)
        workers = {w["role"]: w for w in llm.worker_status()}
        speculation = workers["decode"]["speculation"]
        assert speculation["method"] == "draft" and speculation["proposed_tokens"] > 0
        assert speculation["accepted_tokens"] == speculation["proposed_tokens"]
        fed = {role: workers[role]["draft"]["prompt_tokens_fed"] - before[role]["prompt_tokens_fed"]
               for role in ("prefill", "decode") if before[role] is not None}
        received = workers["decode"]["draft"]["prompts_received"] - before["decode"]["prompts_received"]
        assert len(transfers) >= len(prompts)
        if place == "prefill":
            assert (fed["decode"], received) == (local, len(transfers))
            assert fed["prefill"] >= sum(len(p) for p in prompts)
            assert all(t.draft_bytes > 0 for t in transfers.values())
        else:
            assert fed["decode"] >= sum(len(p) for p in prompts) and received == 0
            assert workers["prefill"]["draft"] is None
            assert all(t.draft_bytes == 0 for t in llm.transfers)
        assert_no_leaks(llm)


def test_an_offline_batch_is_answered_whole_never_refused_by_admission_control(checkpoint):
    """The offline API answers every prompt, as an engine's ``generate`` does: 6 prompts for a
    decode worker of one slot, under a ``standard`` class that may wait 1 ms (in the ingress,
    each prompt behind the first is refused at once), all come back with the colocated
    engine's tokens."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([20, 24, 28, 32, 36, 40], seed=19)
    expected = colocated_tokens(model_dir, prompts, greedy(6))
    impatient = RouterConfig.from_mapping({"slo_classes": {
        "standard": {"ttft_ms": 5000, "tpot_ms": 250, "on_overload": "queue", "max_wait_ms": 1}}})
    with disaggregated(model_dir, max_num_seqs=1, router_config=impatient) as llm:
        outputs = llm.generate(prompts, greedy(6))
        assert [(o.error, o.token_ids) for o in outputs] == [(None, e) for e in expected]
        assert_no_leaks(llm)


def test_max_tokens_past_the_context_is_served_to_the_context_not_held_for_room(checkpoint):
    """2,000 tokens asked of a 512-token context with a 1,024-token cache: the engine ends it at
    the context, so the router must place it for that much, not hold it for blocks no worker
    has (it did: the request waited in the router for ever)."""
    import threading

    (prompt,) = random_prompts([40], seed=3)
    with disaggregated(checkpoint("llama")) as llm:
        done: list = []
        serving = threading.Thread(target=lambda: done.extend(llm.generate([prompt], greedy(2000))), daemon=True)
        serving.start()
        serving.join(timeout=300)  # a hang guard only
        assert done, "the request was never served"
        assert done[0].error is None and done[0].finish_reason == "length"
        assert len(prompt) + len(done[0].token_ids) == 512
        assert_no_leaks(llm)


def test_whole_request_transfer_gives_the_same_tokens(checkpoint):
    """The comparison mode of the benchmark: all layers sent after the forward pass."""
    model_dir = checkpoint("llama")
    with disaggregated(model_dir, stream_layers=False) as llm:
        outputs = llm.generate(random_prompts(PROMPT_LENGTHS, seed=1), greedy())
        assert [o.token_ids for o in outputs] == run_batch(model_dir).tokens
        assert_no_leaks(llm)


def test_a_cluster_named_apart_from_the_processs_ray_namespace_serves(checkpoint, ray_session):
    """Ray keeps the namespace of the first ``ray.init`` for the whole process (here the
    module's, as a notebook's or another cluster's would be). A cluster named otherwise still
    names its workers in its own namespace, where the ingress and its workers look them up:
    before, they landed in the process's, the ingress waited on a worker it could not find,
    and remote prefills hung."""
    model_dir = checkpoint("llama")
    other = "tandem-disagg-apart"
    with DisaggregatedLLM.from_args(str(model_dir), cluster_name=other, num_kv_blocks=BLOCKS,
                                    max_num_batched_tokens=96, verbose=False, local_prefill_max_tokens=0) as llm:
        for name in llm.deployment.workers:
            ray_session.get_actor(name, namespace=other)  # raises ValueError where it is not
        outputs = llm.generate(random_prompts(PROMPT_LENGTHS, seed=1), greedy())
        assert [o.token_ids for o in outputs] == run_batch(model_dir).tokens
        assert len(llm.transfers) == len(PROMPT_LENGTHS)
        assert_no_leaks(llm)


def test_seeded_sampling_continues_where_the_prefill_worker_left_off(checkpoint):
    model_dir = checkpoint("llama")
    prompts = random_prompts([5, 40], seed=3)
    params = SamplingParams(temperature=0.9, top_k=30, seed=7, max_tokens=12, ignore_eos=True)
    from cluster.offline.llm import LLM

    with LLM(str(model_dir), verbose=False, num_kv_blocks=BLOCKS) as colocated:
        expected = [o.token_ids for o in colocated.generate(prompts, params)]
    with disaggregated(model_dir) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_second_turn_sends_only_the_blocks_the_decode_worker_lacks(checkpoint):
    model_dir = checkpoint("qwen2")
    first_prompt = random_prompts([50], seed=4)[0]
    with disaggregated(model_dir) as llm:
        first = llm.generate([first_prompt], greedy(15))[0]
        second_prompt = first_prompt + first.token_ids + random_prompts([20], seed=5)[0]
        second = llm.generate([second_prompt], greedy(10))[0]
        turn1, turn2 = llm.transfers
        assert (turn1.blocks_cached_on_decode, turn1.blocks_sent) == (0, 4)
        # The first turn computed 50 + 14 tokens: 4 full blocks cached on the decode side.
        # The second prompt (50 + 15 + 20 = 85 tokens) needs 6 blocks, so 2 travel.
        assert (turn2.blocks_cached_on_decode, turn2.blocks_sent) == (4, 2)
        # Its cached tokens are those it did not compute: the prefill worker held the first
        # prompt's 3 full blocks and its last block's 2 tokens (a partial hit), and computed the
        # rest (the decode worker's 4 spared only their transfer).
        assert turn2.prefill_cached_tokens == 50 and second.usage.cached_tokens == 50
        assert_no_leaks(llm)
    from cluster.offline.llm import LLM

    with LLM(str(model_dir), verbose=False, num_kv_blocks=BLOCKS) as colocated:
        assert colocated.generate([second_prompt], greedy(10))[0].token_ids == second.token_ids


def test_prefill_worker_survives_a_decode_worker_that_died_before_its_kv_landed(checkpoint, ray_session):
    """Decode worker 0 dies; a prefill streaming KV to it ends its transfer (failed, or sent into
    a closed connection) within its deadline with every block freed, and the next requests are
    served by decode worker 1."""
    from cluster.engine.request import TransferTarget

    model_dir = checkpoint("llama")
    prompts = random_prompts([120, 30], seed=6)
    with disaggregated(model_dir, decode_workers=2, transfer_timeout_s=10, restart_workers=False) as llm:
        decode0, prefill = llm.decode[0], llm.prefill[0]
        ray_session.kill(decode0)
        started = time.monotonic()
        result = ray_session.get(prefill.prefill.remote("doomed", prompts[0], greedy(8),
                                                        TransferTarget("p0-d0", 0, 0, 10)))
        assert time.monotonic() - started < 10 + 5
        assert result.first_token is not None or result.error
        survivors = llm.generate([prompts[1]] * 2, greedy(8))  # decode 0 is found dead and skipped
        assert all(s.error is None and len(s.token_ids) == 8 for s in survivors)
        prefill_free, decode_free = llm.worker_free_blocks()
        assert prefill_free == [BLOCKS] and decode_free == [None, BLOCKS]


def test_a_decode_worker_killed_mid_stream_moves_its_requests_without_losing_a_token(checkpoint, ray_session):
    """Two decode workers; decode-0 dies while it streams: each of its requests is prefilled
    again (prompt plus the tokens already sent) on decode-1 and resumes, and every request's
    greedy tokens equal an uninterrupted run."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([30, 45, 20, 60], seed=12)
    params = greedy(300)
    expected = colocated_tokens(model_dir, prompts, params)
    outputs, llm = served_while_decode_0_dies(ray_session, model_dir, prompts, params)
    assert [(o.finish_reason, o.error) for o in outputs] == [("length", None)] * len(prompts)
    assert [o.token_ids for o in outputs] == expected
    assert all(llm.decisions[o.request_id].decode == "decode-1" for o in outputs)


def test_a_killed_decode_worker_is_started_again_and_serves_again(checkpoint, ray_session):
    """The quick start's shape (one prefill, one decode worker) on one node: its only decode
    worker killed, a request waits in the router for it (or, past its class's wait bound, is
    refused naming the restart); the deployment starts the worker again under its name,
    paired with the prefill worker again, and the router that saw it dead places on it again:
    later requests succeed with the colocated engine's tokens, their KV sent by the prefill worker.
    Then the prefill worker is killed: started again, the decode worker pairs with it anew."""
    model_dir = checkpoint("llama")
    prompts, others = random_prompts([40, 70], seed=16), random_prompts([50, 33], seed=17)
    spare = random_prompts([36], seed=18)  # served while decode-0 starts again: it may prefill it itself
    expected, expected_others, expected_spare = (colocated_tokens(model_dir, p, greedy(8))
                                                 for p in (prompts, others, spare))
    with disaggregated(model_dir) as llm:
        assert llm.generate(prompts[:1], greedy(8))[0].token_ids == expected[0]
        before = next(w for w in llm.worker_status() if w["name"] == "decode-0")
        ray_session.kill(llm.deployment.workers["decode-0"])
        meanwhile = llm.generate(spare, greedy(8))[0]
        assert (meanwhile.error is None and meanwhile.token_ids == expected_spare[0]) or (
            meanwhile.error_kind == "rejected" and "waiting for decode-0 to start again" in meanwhile.error), \
            meanwhile.error
        back = wait_for(lambda: next((w for w in llm.worker_status() if w["name"] == "decode-0" and w["state"] == "alive"
                                      and w["unpaired"] == [] and w["pid"] != before["pid"]), None),
                        timeout_s=180, what="decode-0 to start again", every_s=0.5)
        assert back["started_at"] > before["started_at"]
        paired_in_registry(llm, "decode-0")
        after = llm.generate(prompts, greedy(8))
        assert [(o.error, o.token_ids) for o in after] == [(None, e) for e in expected]
        sent = {t.request_id: (t.decode_worker, t.blocks_sent) for t in llm.transfers}
        assert [sent[o.request_id] for o in after] == [("decode-0", 3), ("decode-0", 5)]
        # Its prefill worker killed too: started again, and decode-0 (which lived on) pairs with it.
        prefill_before = next(w for w in llm.worker_status() if w["name"] == "prefill-0")
        ray_session.kill(llm.deployment.workers["prefill-0"])
        wait_for(lambda: any(w["name"] == "prefill-0" and w["state"] == "alive" and w["pid"] != prefill_before["pid"]
                             for w in llm.worker_status())
                 and next(w for w in llm.worker_status() if w["name"] == "decode-0")["unpaired"] == [],
                 timeout_s=180, what="prefill-0 to start again and be paired", every_s=0.5)
        paired_in_registry(llm, "decode-0")
        last = llm.generate(others, greedy(8))
        assert [(o.error, o.token_ids) for o in last] == [(None, e) for e in expected_others]
        sent = {t.request_id: (t.prefill_worker, t.blocks_sent) for t in llm.transfers}
        assert [sent[o.request_id] for o in last] == [("prefill-0", 4), ("prefill-0", 3)]  # KV over the new group
        assert llm.deployment.supervisor.restarts == 2
        assert_no_leaks(llm)


def paired_in_registry(llm: DisaggregatedLLM, decode: str) -> None:
    """Until the registry (what routers read) shows ``decode`` paired with every prefill worker."""
    registry = connect(llm.deployment.registry_url)
    try:
        wait_for(lambda: (load := read_loads(registry, CLUSTER, [decode]).get(decode)) is not None
                 and load.unpaired == (), timeout_s=60, what=f"the registry to show {decode} paired")
    finally:
        registry.close()


def served_while_decode_0_dies(ray, model_dir, prompts, params):
    """The outputs of ``prompts`` served by two decode workers, decode-0 killed once it generates
    (some request moved: checked here), and the stopped DisaggregatedLLM (its decisions, tokenizer)."""
    with disaggregated(model_dir, decode_workers=2, policy="round_robin", num_kv_blocks=160,
                       restart_workers=False) as llm:
        ids = [f"m{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            llm.engine.add_request(request_id, prompt, params)
        wait_for(lambda: any(w["name"] == "decode-0" and w["running"] for w in llm.worker_status()),
                 timeout_s=120, what="decode-0 to be generating", every_s=0.01)
        ray.kill(llm.decode[0])
        outputs = llm.run_until_done(ids)
    assert any(llm.migrations.get(i) for i in ids), "no request moved: nothing was tested"
    return outputs, llm


def test_a_constrained_requests_first_token_is_sampled_on_the_prefill_worker_under_its_grammar(checkpoint):
    """The prefill worker samples the first token under the request's grammar (the model's own
    first choice is not a digit here: the grammar changed it); the decode worker's matcher replays
    that token and continues: the tokens are the colocated engine's, and the grammar ends the
    request."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([30, 45], seed=14)
    params = greedy(40)
    constrained = replace(params, structured=StructuredOutput("regex", "[0-9]{3}-[a-z]{2,6}", source="regex"))
    free, expected = (colocated_tokens(model_dir, prompts, p) for p in (params, constrained))
    assert [f[0] for f in free] != [e[0] for e in expected]
    with disaggregated(model_dir) as llm:
        outputs = llm.generate(prompts, constrained)
        assert [(o.finish_reason, o.error) for o in outputs] == [("stop", None)] * 2
        assert [o.token_ids for o in outputs] == expected
        assert all(re.fullmatch("[0-9]{3}-[a-z]{2,6}", o.text) for o in outputs)
        sent = {t.request_id: (t.prefill_worker, t.blocks_sent) for t in llm.transfers}
        assert [sent[o.request_id] for o in outputs] == [("prefill-0", 2), ("prefill-0", 3)]  # the first token too
        assert_no_leaks(llm)


def test_a_constrained_request_moved_mid_stream_replays_its_tokens_into_its_grammar(checkpoint, ray_session):
    """decode-0 dies mid-stream under requests held to "exactly 60 words of five letters": on
    decode-1 each grammar starts past the tokens already streamed (without that, it would allow
    60 more words), so the output is the uninterrupted run's and matches the grammar whole."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([30, 45], seed=15)
    words = "([a-z]{5} ){59}[a-z]{5}"
    params = replace(greedy(600), structured=StructuredOutput("regex", words, source="regex"))
    expected = colocated_tokens(model_dir, prompts, params)
    outputs, llm = served_while_decode_0_dies(ray_session, model_dir, prompts, params)
    assert [(o.finish_reason, o.error) for o in outputs] == [("stop", None)] * len(prompts)
    assert [o.token_ids for o in outputs] == expected
    assert all(re.fullmatch(words, llm.path.tokenizer.decode(o.token_ids)) for o in outputs)


def test_a_prefill_worker_killed_before_its_kv_lands_is_retried_on_another(checkpoint, ray_session):
    """Prefill worker 0 is dead when the request reaches it: the decode worker's call fails, the
    request is placed again on prefill worker 1 and completes; the decode worker's receive for
    the dead prefill ends at its deadline and frees the blocks it reserved."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([90, 25], seed=7)
    with disaggregated(model_dir, prefill_workers=2, transfer_timeout_s=5, policy="round_robin",
                       restart_workers=False) as llm:
        ray_session.kill(llm.prefill[0])  # the router's first round-robin turn is prefill worker 0
        outputs = llm.generate(prompts, greedy(4))
        assert [o.error for o in outputs] == [None, None]
        assert [o.token_ids for o in outputs] == colocated_tokens(model_dir, prompts, greedy(4))
        assert {llm.decisions[o.request_id].prefill for o in outputs} == {"prefill-1"}
        wait_for(lambda: llm.worker_free_blocks() == ([None, BLOCKS], [BLOCKS]), timeout_s=30,
                 what="the blocks reserved for the dead prefill worker's KV to be freed", every_s=0.2)


def break_pair(ray, prefill_worker, pair: str, prompt: list[int]):
    """Breaks the real transfer group ``pair``: the prefill worker sends a request's KV that no
    decode worker receives, its send times out, and gloo closes the group's connections
    ("Application timeout caused pair closure"), as with a slow or frozen peer."""
    from cluster.engine.request import TransferTarget

    return ray.get(prefill_worker.prefill.remote("breaks-the-pair", prompt, greedy(4),
                                                 TransferTarget(pair, 2**29, 0, 5.0)))


def test_a_prompt_the_decode_worker_holds_whole_sends_no_block_and_breaks_no_pair(checkpoint):
    """The same prompt again (3 full blocks, cached on both sides): the decode worker reserves no
    block to receive into, so the prefill worker sends none (a send with no receive waited out the
    transfer timeout, failed the attempt and had the pair rebuilt). Round robin: under the ``slo``
    policy a decode worker holding the whole prompt may prefill it itself, and whether it does is
    the measured times' call (on a busy machine it did, and no second transfer came). One thread
    a worker, so that the two have cores of their own: a decode worker taking turns with its
    prefill worker on the same cores keeps what it may prefill itself (``router/filters.py``)."""
    model_dir = checkpoint("llama")
    prompt = random_prompts([48], seed=6)[0]
    expected = colocated_tokens(model_dir, [prompt], greedy(8))[0]
    with disaggregated(model_dir, transfer_timeout_s=60, policy="round_robin", num_threads=1) as llm:
        assert [llm.generate([prompt], greedy(8))[0].token_ids for _ in range(2)] == [expected, expected]
        first, second = llm.transfers
        assert (first.blocks_cached_on_decode, first.blocks_sent) == (0, 3)
        assert (second.blocks_cached_on_decode, second.blocks_sent) == (3, 0)
        decode = next(w for w in llm.worker_status() if w["name"] == "decode-0")
        assert (decode["pair_rebuilds"], decode["unpaired"]) == (0, [])
        assert_no_leaks(llm)


def test_a_transfer_group_closed_by_a_timeout_is_rebuilt_and_carries_kv_again(checkpoint, ray_session):
    """A transfer that timed out closes its gloo group for good. The decode worker reports the
    pair unusable (the router places around it: here the decode worker prefills itself), builds
    a new group with the prefill worker, and the next requests' KV travels over it again,
    token-exact, with no block leaked on either side."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([40, 70, 25, 50, 33], seed=21)
    expected = colocated_tokens(model_dir, prompts, greedy(6))
    with disaggregated(model_dir, transfer_timeout_s=20) as llm:
        assert llm.generate(prompts[:1], greedy(6))[0].token_ids == expected[0]
        assert "Timed out" in break_pair(ray_session, llm.prefill[0], "p0-d0", prompts[1]).error
        # Served while the group is rebuilt (around it) and after (through it): never wedged.
        during = llm.generate(prompts[2:3], greedy(6))[0]
        assert (during.error, during.token_ids) == (None, expected[2])
        status = wait_for(lambda: next(w for w in llm.worker_status() if w["name"] == "decode-0")["unpaired"] == []
                          and next(w for w in llm.worker_status() if w["name"] == "decode-0"),
                          timeout_s=120, what="the transfer group to be rebuilt")
        assert status["pair_rebuilds"] == 1
        registry = connect(llm.deployment.registry_url)
        wait_for(lambda: read_loads(registry, CLUSTER, ["decode-0"])["decode-0"].unpaired == (), timeout_s=60,
                 what="the registry to show the pair back in use")
        registry.close()
        time.sleep(4 * llm.deployment.info.router_config.load_refresh_s)  # the router's view is read anew
        after = llm.generate(prompts[3:], greedy(6))
        assert [(o.error, o.token_ids) for o in after] == [(None, e) for e in expected[3:]]
        sent = {t.request_id: (t.prefill_worker, t.blocks_sent) for t in llm.transfers}
        assert [sent[o.request_id] for o in after] == [("prefill-0", 4), ("prefill-0", 3)]
        wait_for(lambda: llm.worker_free_blocks() == ([BLOCKS], [BLOCKS]), timeout_s=60,
                 what="every block to be free again", every_s=0.2)


def test_workers_run_at_nice_0_on_every_cpu_they_were_given(checkpoint):
    """Ray starts its workers at nice 15 and with OMP_NUM_THREADS=1: a worker left so would step
    on one thread, behind every other process on its node (ensure_ray and engine_runner undo both)."""
    import os

    from cluster.parallel.tp_runner import threads_per_rank

    with disaggregated(checkpoint("llama")) as llm:
        statuses = llm.worker_status()
        assert {s["role"] for s in statuses} == {"prefill", "decode"}
        for status in statuses:
            assert status["threads"] == threads_per_rank(status["tp"]), status
            assert os.getpriority(os.PRIO_PROCESS, status["pid"]) == 0, status
