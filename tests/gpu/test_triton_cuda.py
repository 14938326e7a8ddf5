"""The Triton backend and CUDA graphs on a real GPU: greedy tokens equal to the torch path with
graphs on and off, graphs captured for every bucket and replayed for decode steps, and bf16
kernels close to the reference. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ENGINE = dict(device="cuda", verbose=False, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=64)


def generate(model_dir, **engine) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(model_dir), **{**ENGINE, **engine})
    prompts = random_prompts([1, 9, 16, 17, 40, 130, 33], seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 5, 17, 30, 9, 12, 20)]
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    tokens += [o.token_ids for o in llm.generate(prompts, params)]  # again, from the prefix cache
    return llm, tokens


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_equal_the_torch_path_with_graphs_on_and_off(architecture, checkpoint):
    model_dir = checkpoint(architecture)
    _, reference = generate(model_dir, attention_backend="torch", enforce_eager=True)
    eager, eager_tokens = generate(model_dir, attention_backend="triton", enforce_eager=True)
    graphs, graph_tokens = generate(model_dir)  # the default on CUDA: Triton with decode graphs
    assert eager.engine.runner.graphs is None
    assert graphs.engine.runner.attention_backend == "triton"
    assert sorted(graphs.engine.runner.graphs.graphs) == [1, 2, 4, 8, 16]
    assert eager_tokens == reference
    assert graph_tokens == reference


def test_decode_steps_replay_graphs(checkpoint):
    llm = LLM(str(checkpoint("llama")), **ENGINE)
    graphs = llm.engine.runner.graphs
    replays = []
    for bucket, graph in graphs.graphs.items():
        graph.replay = (lambda original, b: lambda: replays.append(b) or original())(graph.replay, bucket)
    llm.generate(random_prompts([5, 9, 30], seed=2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert replays and set(replays) <= {1, 2, 4}
    assert 4 in replays, "three decodes replay the graph of four"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_engine_is_close_to_the_torch_path(dtype, checkpoint):
    """In 16-bit floats the two paths round differently; their logits must still agree closely."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([40, 7], seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    fused = LLM(str(model_dir), dtype=str(dtype).removeprefix("torch."), **ENGINE).generate(prompts, params)
    plain = LLM(str(model_dir), dtype=str(dtype).removeprefix("torch."), attention_backend="torch",
                enforce_eager=True, **ENGINE).generate(prompts, params)
    for a, b in zip(fused, plain):
        # First tokens come from identical prompts: their log-probabilities must agree closely.
        torch.testing.assert_close(torch.tensor(a.logprobs[0]), torch.tensor(b.logprobs[0]), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_an_8bit_cache_gives_the_torch_paths_tokens_with_graphs(kv_cache_dtype, checkpoint):
    """The Triton kernels write and read 8-bit rows (decode graphs captured over them); the torch
    path on CUDA quantizes with torch to the same bytes, so greedy tokens are equal."""
    model_dir = checkpoint("llama")
    _, reference = generate(model_dir, attention_backend="torch", enforce_eager=True, kv_cache_dtype=kv_cache_dtype)
    graphs, graph_tokens = generate(model_dir, kv_cache_dtype=kv_cache_dtype)
    assert graphs.engine.runner.kv_cache.dtype == torch.int8
    assert sorted(graphs.engine.runner.graphs.graphs) == [1, 2, 4, 8, 16]
    assert graph_tokens == reference
