"""The host KV tier on a CUDA device: slots in pinned host memory, loads on a side stream with an
event per layer. A host hit gives the greedy tokens of a device hit and of the CPU engine, and
no block stays in use. Skipped without CUDA (the CPU path: tests/integration/test_kv_host_tier_engine.py)."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from conftest import random_prompts
from engine_runs import run_one

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(model_dir, device: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device=device, num_kv_blocks=12, block_size=16,
                                  max_num_seqs=4, host_cache=32), verbose=False)


def run(llm: LLMEngine, request_id: str, prompt: list[int]):
    return run_one(llm, request_id, prompt, GREEDY)


def test_a_host_hit_on_cuda_loads_from_pinned_slots_on_a_side_stream_with_the_tokens_of_a_device_hit(checkpoint):
    model_dir = checkpoint("llama")
    prompt = random_prompts([70], seed=5)[0]  # 4 full blocks
    llm = engine(model_dir, "cuda")
    store = llm.host_store
    assert store.slots.is_pinned() and store._load_stream is not None
    assert not store.converts  # the device's format on the host: the bytes come back unchanged
    issued = []
    store.layer_issued = issued.append
    first = run(llm, "first", prompt)
    device_hit = run(llm, "device-hit", prompt)
    assert device_hit.usage.cached_tokens == 64
    for index, filler in enumerate(random_prompts([80, 80], seed=6)):  # takes every device block left
        run(llm, f"filler-{index}", filler)
    assert llm.stats.host_offloaded_blocks >= 4
    host_hit = run(llm, "host-hit", prompt)
    assert host_hit.usage.cached_tokens == 64 and llm.stats.host_loaded_blocks == 4
    assert issued == list(range(store.num_layers))  # one load, layer 0 first
    assert host_hit.token_ids == device_hit.token_ids == first.token_ids
    assert host_hit.token_ids == run(engine(model_dir, "cpu"), "cpu", prompt).token_ids
    assert llm.block_manager.num_free_blocks == 12
