"""Results do not depend on how requests were batched.

One request alone, or among 50 others; chunked prefill on or off; with a prefix-cache hit or
not; with so few KV blocks that requests are preempted and recomputed: the same tokens, and
every block back in the free list at the end.
"""

from __future__ import annotations

import pytest

from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from conftest import random_prompts

pytestmark = pytest.mark.integration

TARGET_LENGTH = 45
MAX_TOKENS = 20


def crowd(count: int = 50) -> tuple[list[list[int]], list[SamplingParams]]:
    lengths = [3 + (i * 37) % 120 for i in range(count)]
    prompts = random_prompts(lengths, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=4 + (i * 7) % 30, ignore_eos=True) for i in range(count)]
    return prompts, params


def engine(model_dir, **overrides) -> LLM:
    args = dict(verbose=False, num_kv_blocks=512, max_num_batched_tokens=256)
    return LLM(str(model_dir), **{**args, **overrides})


def assert_all_blocks_free(llm: LLM) -> None:
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def target():
    return random_prompts([TARGET_LENGTH], seed=3)[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(checkpoint, target):
    llm = engine(checkpoint("llama"))
    out = llm.generate([target[0]], target[1])[0]
    assert len(out.token_ids) == MAX_TOKENS
    return out.token_ids


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(enable_chunked_prefill=False),
        dict(max_num_batched_tokens=32),
        dict(enable_prefix_caching=False),
        dict(block_size=8, num_kv_blocks=1024),
    ],
    ids=["chunked", "whole-prompts", "small-chunks", "no-prefix-cache", "block-size-8"],
)
def test_same_tokens_among_fifty_others(checkpoint, target, alone, settings):
    llm = engine(checkpoint("llama"), **settings)
    prompts, params = crowd()
    position = 17
    prompts.insert(position, target[0])
    params.insert(position, target[1])
    outputs = llm.generate(prompts, params)
    assert outputs[position].token_ids == alone
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outputs, params))
    assert_all_blocks_free(llm)


def test_same_tokens_with_a_prefix_cache_hit(checkpoint, target, alone):
    llm = engine(checkpoint("llama"))
    prompt, params = target
    llm.generate([prompt[:40] + [5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    out = llm.generate([prompt], params)[0]
    assert out.usage.cached_tokens == 40  # two full blocks, and 8 tokens of the first request's last block
    assert out.token_ids == alone
    again = llm.generate([prompt], params)[0]
    assert again.usage.cached_tokens == 44  # 45 tokens: all but the last, which is always computed
    assert again.token_ids == alone
    assert_all_blocks_free(llm)


def test_output_blocks_are_cached_for_the_next_turn(checkpoint, target, alone):
    llm = engine(checkpoint("llama"))
    prompt, params = target
    first = llm.generate([prompt], params)[0]
    next_turn = prompt + first.token_ids + [9, 10, 11]
    out = llm.generate([next_turn], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.usage.cached_tokens == (len(prompt) + MAX_TOKENS - 1) // 16 * 16
    assert_all_blocks_free(llm)


def test_same_tokens_under_preemption(checkpoint, target, alone):
    llm = engine(checkpoint("llama"), num_kv_blocks=24, max_num_batched_tokens=128)
    prompts, params = crowd(20)
    prompts.insert(5, target[0])
    params.insert(5, target[1])
    outputs = llm.generate(prompts, params)
    assert llm.engine.stats.num_preemptions > 0
    assert outputs[5].token_ids == alone
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outputs, params))
    assert_all_blocks_free(llm)


def test_seeded_sampling_is_independent_of_the_batch(checkpoint, target):
    prompt, _ = target
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    solo = engine(checkpoint("llama")).generate([prompt], seeded)[0].token_ids
    prompts, params = crowd(20)
    params = [SamplingParams(temperature=1.0, max_tokens=p.max_tokens, ignore_eos=True) for p in params]
    prompts.insert(9, prompt)
    params.insert(9, seeded)
    llm = engine(checkpoint("llama"), max_num_batched_tokens=64)
    assert llm.generate(prompts, params)[9].token_ids == solo
    assert_all_blocks_free(llm)


def test_cancellation_frees_blocks_at_once(checkpoint):
    llm = engine(checkpoint("llama"))
    prompts, params = crowd(8)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        llm.engine.step()
    assert llm.engine.block_manager.num_used_blocks > 0
    outputs = [llm.engine.abort_request(f"r{i}") for i in range(8)]
    assert all(o.finished and o.finish_reason == "abort" for o in outputs)
    assert_all_blocks_free(llm)
