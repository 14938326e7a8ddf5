"""Disaggregated prefill and decode on the CPU: workers are Ray actors, KV moves over gloo.

Output must equal the colocated engine's, for TP 1 to TP 1, prefill TP 2 to decode TP 1 and
prefill TP 1 to decode TP 2; a second turn must send only the blocks the decode worker lacks;
a decode worker killed mid-transfer must leave the prefill worker serving the next request
within its deadline, with no leaked blocks on any live worker.
"""

from __future__ import annotations

import time

import pytest

from cluster.disaggregated import DisaggregatedLLM
from cluster.engine.sampling_params import SamplingParams
from cluster.ray_runtime import ensure_ray
from conftest import random_prompts
from reference_checks import MAX_TOKENS, PROMPT_LENGTHS, run_batch

pytestmark = pytest.mark.integration

CLUSTER = "tandem-disagg-tests"
BLOCKS = 64


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray = ensure_ray(CLUSTER, num_cpus=8)
    yield ray
    ray.shutdown()


def disaggregated(model_dir, **kwargs) -> DisaggregatedLLM:
    kwargs = {"num_kv_blocks": BLOCKS, "max_num_batched_tokens": 96, "verbose": False, **kwargs}
    return DisaggregatedLLM(str(model_dir), cluster_name=CLUSTER, **kwargs)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


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


def test_whole_request_transfer_gives_the_same_tokens(checkpoint):
    """The comparison mode of the benchmark: all layers sent after the forward pass."""
    model_dir = checkpoint("llama")
    with disaggregated(model_dir, stream_layers=False) as llm:
        outputs = llm.generate(random_prompts(PROMPT_LENGTHS, seed=1), greedy())
        assert [o.token_ids for o in outputs] == run_batch(model_dir).tokens
        assert_no_leaks(llm)


def test_seeded_sampling_continues_where_the_prefill_worker_left_off(checkpoint):
    model_dir = checkpoint("llama")
    prompts = random_prompts([5, 40], seed=3)
    params = SamplingParams(temperature=0.9, top_k=30, seed=7, max_tokens=12, ignore_eos=True)
    from cluster.engine.llm import LLM

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
        assert second.usage.cached_tokens == 64
        assert_no_leaks(llm)
    from cluster.engine.llm import LLM

    with LLM(str(model_dir), verbose=False, num_kv_blocks=BLOCKS) as colocated:
        assert colocated.generate([second_prompt], greedy(10))[0].token_ids == second.token_ids


def test_decode_worker_killed_mid_transfer(checkpoint, ray_session):
    """Decode worker 0 reserves blocks and posts its receive, then dies before the KV lands:
    the prefill worker's transfer ends (failed, or sent into a closed connection) within its
    deadline with every block freed, and the next request is served by decode worker 1."""
    from cluster.engine.request import TransferTarget

    model_dir = checkpoint("llama")
    prompts = random_prompts([120, 30], seed=6)
    with disaggregated(model_dir, decode_workers=2, transfer_timeout_s=10) as llm:
        decode0, prefill = llm.decode[0], llm.prefill[0]
        first_block, dst_blocks = ray_session.get(decode0.reserve.remote("doomed", prompts[0], greedy(8)))
        receive = decode0.receive.remote("p0-d0", "doomed", dst_blocks, 0, 10)
        ray_session.kill(decode0)
        started = time.monotonic()
        result = ray_session.get(prefill.prefill.remote("doomed", prompts[0], greedy(8),
                                                        TransferTarget("p0-d0", 0, first_block, 10)))
        assert time.monotonic() - started < 10 + 5
        assert result.first_token is not None
        with pytest.raises(ray_session.exceptions.RayActorError):
            ray_session.get(receive)
        survivor = llm.generate([prompts[1]], greedy(8))[0]  # decode 0 is found dead and skipped
        assert survivor.error is None and len(survivor.token_ids) == 8
        assert time.monotonic() - started < 10 + 15
        prefill_free, decode_free = llm.worker_free_blocks()
        assert prefill_free == [BLOCKS] and decode_free == [None, BLOCKS]


def test_prefill_worker_killed_frees_the_reserved_decode_blocks(checkpoint, ray_session):
    """Prefill worker 0 is dead when the request reaches it: the request fails naming it, the
    decode worker's receive fails and frees the reserved blocks, and prefill worker 1 serves
    the next request."""
    model_dir = checkpoint("llama")
    with disaggregated(model_dir, prefill_workers=2, transfer_timeout_s=5, policy="round_robin") as llm:
        ray_session.kill(llm.prefill[0])  # the router's first round-robin turn is prefill worker 0
        llm.engine.add_request("orphan", random_prompts([90], seed=7)[0], greedy(4))
        queued = llm.engine.queue.pop()
        flight = llm._dispatch(queued, ray_session.get(llm._place(queued)))
        assert flight.prefill == 0
        failed = llm._complete(flight)
        assert failed.finish_reason == "error" and "prefill worker 0 died" in failed.error
        survivor = llm.generate(random_prompts([25], seed=8), greedy(4))[0]
        assert survivor.error is None
        deadline = time.monotonic() + 10
        while llm.worker_free_blocks()[1] != [BLOCKS] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert llm.worker_free_blocks() == ([None, BLOCKS], [BLOCKS])
