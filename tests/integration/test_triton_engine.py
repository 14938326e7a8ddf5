"""The engine on the fused (Triton) path gives the torch path's greedy tokens.

Without CUDA the kernels run under Triton's CPU interpreter, and the CUDA-graph decode path
runs its persistent buffers, bucket padding and metadata eagerly (nothing is captured on a
CPU); with CUDA both run for real. Small token budgets make steps that mix decodes with prompt
chunks, and a second round of the same prompts hits the prefix cache, so chunks attend to
cached context.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from cluster.offline.llm import LLM  # noqa: E402
from cluster.engine.sampling_params import SamplingParams  # noqa: E402
from conftest import random_prompts  # noqa: E402

pytestmark = pytest.mark.integration

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT_LENGTHS = [1, 9, 40, 70]
# Requests end at different steps, so batches shrink to sizes between the captured ones.
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 3, 5, 9)]
ENGINE = dict(verbose=False, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8, device=DEVICE)


def two_rounds(llm: LLM) -> list[list[int]]:
    """The prompts twice: the second time their full blocks come from the prefix cache."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=4)
    first = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    second = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    assert llm.engine.stats.cached_prompt_tokens > 0
    return first + second


@pytest.fixture(scope="module")
def torch_tokens(checkpoint):
    cache = {}

    def tokens(architecture: str) -> list[list[int]]:
        if architecture not in cache:
            cache[architecture] = two_rounds(LLM(str(checkpoint(architecture)), attention_backend="torch", **ENGINE))
        return cache[architecture]

    return tokens


# every architecture's attention eagerly; the graph mechanism (the same for all) on one of them
@pytest.mark.parametrize(("architecture", "enforce_eager"), [
    pytest.param("llama", True, id="eager-llama"), pytest.param("mistral", True, id="eager-mistral"),
    pytest.param("qwen3", True, id="eager-qwen3"), pytest.param("llama", False, id="graphs-llama")])
def test_fused_path_matches_torch_path(architecture, enforce_eager, checkpoint, torch_tokens):
    llm = LLM(str(checkpoint(architecture)), attention_backend="triton", enforce_eager=enforce_eager, **ENGINE)
    runner = llm.engine.runner
    replayed: list[int] = []
    if not enforce_eager:
        assert runner.graphs is not None and runner.graphs.sizes == (1, 2, 4, 8)
        run = runner.graphs.run
        runner.graphs.run = lambda *args: replayed.append(len(args[3])) or run(*args)
    else:
        assert runner.graphs is None
    assert two_rounds(llm) == torch_tokens(architecture)
    if not enforce_eager:
        assert 3 in replayed, "three decodes replay the graph of four, padded"
    assert llm.engine.block_manager.num_free_blocks == 64


def test_kernel_warm_up_writes_no_kv_and_changes_no_tokens(checkpoint, torch_tokens):
    """On CUDA the runner compiles every kernel variant at start-up with dummy steps (slot -1);
    here they run under the interpreter: the cache must come out untouched."""
    llm = LLM(str(checkpoint("llama")), attention_backend="triton", enforce_eager=True, **ENGINE)
    runner = llm.engine.runner
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    before = runner.kv_cache.clone()
    runner.warm_up_kernels()
    assert torch.equal(runner.kv_cache, before)
    runner.kv_cache.zero_()
    assert two_rounds(llm) == torch_tokens("llama")


def test_fused_path_reads_an_int8_cache_as_the_torch_path_does(checkpoint):
    """With ``kv_cache_dtype="int8"`` the kernels quantize each new row as the torch path does and
    attend to the same dequantized values, so greedy tokens match the torch path's with int8 KV
    (decode graphs included: replayed on CUDA, their buffers run eagerly here)."""
    path, int8 = str(checkpoint("llama")), dict(ENGINE, kv_cache_dtype="int8")
    llm = LLM(path, attention_backend="triton", **int8)
    assert llm.engine.runner.kv_cache.dtype == torch.int8 and llm.engine.runner.graphs is not None
    assert two_rounds(llm) == two_rounds(LLM(path, attention_backend="torch", **int8))


def test_guesses_checked_on_the_fused_path_give_the_torch_paths_tokens(checkpoint):
    """Speculative decoding on the Triton backend: a verify's rows are a prompt span of the fused
    kernels (decode-only steps still replay as graphs); greedy tokens are the torch path's."""
    from cluster.engine.speculative.config import SpeculativeConfig

    model_dir = str(checkpoint("llama"))
    prompts = [p + p for p in random_prompts([5, 12, 21], seed=8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, attention_backend="torch", **ENGINE).generate(prompts, params)]
    llm = LLM(model_dir, attention_backend="triton", speculative=SpeculativeConfig(num_tokens=3, adaptive=False),
              **ENGINE)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.stats.verify_steps > 0 and llm.engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]
