"""Greedy runs of a fixed batch of prompts, and their comparison against ``transformers``.

Where a token differs, the reference's top two logits at that position must be within float
rounding of each other (a tie the two implementations may break either way); the comparison
stops there because the continuations diverge.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from conftest import random_prompts

PROMPT_LENGTHS = [1, 7, 16, 33, 70, 129]
MAX_TOKENS = 24
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """Greedy sampling of ``max_tokens`` tokens, EOS treated as any other token."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def colocated_tokens(model_dir, prompts, params) -> list[list[int]]:
    """The colocated engine's tokens for ``prompts``: what a cluster's must equal."""
    with LLM(str(model_dir), verbose=False, num_kv_blocks=256) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def reference_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """``max_tokens`` greedy tokens and their logits, EOS treated as any other token (as our
    ``ignore_eos`` runs do; ``generate`` would stop at it, or mask it with ``min_new_tokens``)."""
    tokens, scores, past = [], [], None
    inputs = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            out = model(input_ids=inputs, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
            tokens.append(int(logits.argmax()))
            scores.append(logits)
            inputs = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(scores)


def assert_equivalent(ours: list[int], reference: list[int], scores: torch.Tensor, dtype: torch.dtype, label: str):
    for position, (a, b) in enumerate(zip(ours, reference)):
        if a == b:
            continue
        top2 = scores[position].topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap <= TOLERANCE[dtype] * max(1.0, top2[0].abs().item()), (
            f"{label}: token {position} is {a}, reference {b}; reference top-2 logit gap {gap:.3g} is not a tie"
        )
        return
    assert len(ours) == len(reference), label


class BatchRun(NamedTuple):
    prompts: list[list[int]]
    tokens: list[list[int]]
    preemptions: int


def run_batch(model_dir, dtype="float32", **engine_args) -> BatchRun:
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    engine_args = {"num_kv_blocks": 128, "max_num_batched_tokens": 96, **engine_args}
    with LLM(str(model_dir), dtype=dtype, verbose=False, **engine_args) as llm:
        outputs = llm.generate(prompts, greedy())
        assert llm.engine.block_manager.num_free_blocks == engine_args["num_kv_blocks"]
        preemptions = llm.engine.stats.num_preemptions
    return BatchRun(prompts, [o.token_ids for o in outputs], preemptions)


def assert_batch_matches_reference(model_dir, reference, label: str, dtype: torch.dtype = torch.float32,
                                   **engine_args) -> list[list[int]]:
    """Runs the batch and checks it against the reference; returns our tokens. The CPU kernel
    multiplies in float32, the reference's arithmetic, unless ``engine_args`` say otherwise
    (bfloat16 dot products are held to quality bounds instead: test_quantized_quality.py)."""
    engine_args = {"cpu_matmul_dtype": "float32", **engine_args}
    prompts, ours, _ = run_batch(model_dir, dtype=str(dtype).removeprefix("torch."), **engine_args)
    for prompt, tokens in zip(prompts, ours):
        expected, scores = reference_greedy(reference, prompt, MAX_TOKENS)
        assert_equivalent(tokens, expected, scores, dtype, f"{label}, prompt of {len(prompt)}")
    return ours
