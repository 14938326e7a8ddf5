"""The engine on a CUDA device: the same equivalence as the CPU tier. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_on_cuda_matches_cpu(architecture, checkpoint):
    model_dir = str(checkpoint(architecture))
    prompts = random_prompts([1, 9, 40, 130], seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(model_dir, verbose=False, num_kv_blocks=128).generate(prompts, params)
    gpu_llm = LLM(model_dir, device="cuda", verbose=False, num_kv_blocks=128)
    gpu = gpu_llm.generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert gpu_llm.engine.block_manager.num_free_blocks == 128


def test_seeded_sampling_on_cuda_matches_cpu(checkpoint):
    model_dir = str(checkpoint("llama"))
    prompt = random_prompts([30], seed=5)
    params = SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=16, ignore_eos=True)
    cpu = LLM(model_dir, verbose=False, num_kv_blocks=64).generate(prompt, params)[0].token_ids
    gpu = LLM(model_dir, device="cuda", verbose=False, num_kv_blocks=64).generate(prompt, params)[0].token_ids
    assert gpu == cpu
