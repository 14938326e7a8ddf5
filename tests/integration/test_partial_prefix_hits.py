"""Partial prefix hits: a prompt whose next tokens begin a cached block (or a finished request's
last, not full, block) takes that block's KV by a copy and computes only the rest. The tokens
equal those of a run without any prefix cache, for the torch path and the fused CPU step (weights
quantized at load), with a 16-bit and an 8-bit KV cache; every block is free at the end."""

from __future__ import annotations

import pytest

from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from conftest import random_prompts

pytestmark = pytest.mark.integration

MAX_TOKENS = 20


@pytest.mark.parametrize("settings", [
    dict(),
    dict(kv_cache_dtype="int8"),
    dict(quantization="int8"),
    dict(quantization="int8", kv_cache_dtype="int8"),
], ids=["torch", "torch-kv-int8", "fused", "fused-kv-int8"])
def test_partial_hits_give_the_tokens_of_a_cold_cache(checkpoint, settings):
    model_dir = str(checkpoint("llama"))
    prompt = random_prompts([45], seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    turn = dict(verbose=False, num_kv_blocks=64, dtype="float32", **settings)
    with LLM(model_dir, enable_prefix_caching=False, **turn) as cold:
        assert (cold.engine.runner.native_step is not None) == ("quantization" in settings)
        alone = cold.generate([prompt], params)[0].token_ids
        short = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        assert cold.generate([prompt], short)[0].token_ids == alone[:10]
        chat = prompt + alone[:9] + [9, 10, 11]  # the next turn: the answer's last token has no KV yet
        next_alone = cold.generate([chat], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    with LLM(model_dir, **turn) as llm:
        # a request that ends inside block 2 (tokens 32..44 hold KV when it ends): a kept last block
        llm.generate([prompt[:40] + [5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        out = llm.generate([prompt], params)[0]
        assert out.usage.cached_tokens == 40  # 2 full blocks and 8 tokens copied from the kept block
        assert out.token_ids == alone
        again = llm.generate([prompt], params)[0]
        assert again.usage.cached_tokens == 44  # block 2 is full now (prompt and answer): all but the last token
        assert again.token_ids == alone
        llm.generate([prompt], short)  # ends with KV for tokens 48..53 in its last block
        follow = llm.generate([chat], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        assert follow.usage.cached_tokens == 54  # 3 full blocks and the answer's tokens in the next
        assert follow.token_ids == next_alone
        manager = llm.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks and not llm.engine.has_unfinished_requests()
