"""Speculative decoding through the engine: the tokens are the tokens without it.

Greedy output with n-gram guesses equals ``transformers``' greedy output on random checkpoints of
every architecture (ties aside, as in test_reference_equivalence.py) and the same engine's output
without guesses; on the default model (the fused CPU step, where a row's logits do not depend on
the rows beside it) greedy and seeded sampled output are identical with and without guesses,
logprobs included. Prompts repeat themselves so that guesses are made, and every test checks that
they were. Blocks: none held once every request ended, after rejected guesses and cancellations.
"""

from __future__ import annotations

import random

import pytest

from cluster.engine.kernels.quantized_matmul import bf16_dots_supported
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.speculative.config import SpeculativeConfig
from cluster.offline.llm import LLM
from conftest import ARCHITECTURES, random_prompts
from reference_checks import assert_equivalent, reference_greedy

pytestmark = pytest.mark.integration
needs_bf16_dots = pytest.mark.skipif(not bf16_dots_supported(), reason="no bfloat16 dot products here (AVX512_BF16)")

FIXED = SpeculativeConfig(num_tokens=4, adaptive=False)  # every proposal checked: the bookkeeping's test
MAX_TOKENS = 32


def repeating_prompts(seed: int = 3) -> list[list[int]]:
    """Random prompts whose second half repeats their first: guesses from the first step."""
    return [p + p for p in random_prompts([6, 11, 20, 35], seed=seed)]


def greedy(llm: LLM, prompts, max_tokens: int = MAX_TOKENS, **params) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params))
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_with_guesses_equals_transformers_and_the_engine_without_them(architecture, checkpoint,
                                                                            reference_model):
    model_dir = checkpoint(architecture)
    prompts = repeating_prompts()
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64) as plain:
        expected = greedy(plain, prompts)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64, speculative=FIXED) as llm:
        ours = greedy(llm, prompts)
        stats = llm.engine.stats
        assert stats.proposed_tokens > 0 and stats.verify_steps > 0, "no guess was made: nothing was tested"
        assert llm.engine.block_manager.num_free_blocks == 64
    reference = reference_model(model_dir)
    for prompt, tokens, plain_tokens in zip(prompts, ours, expected):
        wanted, scores = reference_greedy(reference, prompt, MAX_TOKENS)
        assert_equivalent(tokens, wanted, scores, reference.dtype, f"{architecture} with guesses")
        assert_equivalent(plain_tokens, wanted, scores, reference.dtype, f"{architecture} without")


def code_edit_prompt() -> str:
    source = (
        "def accepted_prefix(sampled, proposed):\n"
        "    emitted = []\n"
        "    for j, token in enumerate(sampled):\n"
        "        emitted.append(token)\n"
        "        if j >= len(proposed) or token != proposed[j]:\n"
        "            break\n"
        "    return emitted\n"
    )
    return (f"<|im_start|>user\nRepeat this code exactly, with the function renamed to kept_prefix:\n{source}"
            "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.registry
@pytest.mark.parametrize("speculative", [FIXED, SpeculativeConfig(num_tokens=4), SpeculativeConfig(num_tokens=8)],
                         ids=["fixed", "adaptive", "adaptive-8"])
def test_the_default_model_gives_the_same_tokens_and_logprobs_greedy_and_seeded(speculative):
    from cluster.default_model import default_model_path

    prompts = [code_edit_prompt(), "Once upon a time, in a small village at the edge of a great forest, there lived a"]
    sampled = dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1, logprobs=2)
    runs = {}
    for name, spec in (("off", None), ("on", speculative)):
        with LLM(str(default_model_path()), verbose=False, num_kv_blocks=64, speculative=spec) as llm:
            greedy_out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
            seeded_out = llm.generate(prompts, [SamplingParams(max_tokens=48, seed=seed, **sampled) for seed in (1, 2)])
            runs[name] = ([(o.token_ids, o.logprobs) for o in greedy_out], [(o.token_ids, o.logprobs)
                                                                           for o in seeded_out])
            if spec is not None:
                assert llm.engine.stats.accepted_tokens > 0, "no guess was kept: nothing was tested"
            assert llm.engine.block_manager.num_free_blocks == 64
    assert runs["on"][0] == runs["off"][0]
    assert runs["on"][1] == runs["off"][1]


def test_tensor_parallel_ranks_check_guesses_as_one_rank_does(checkpoint):
    model_dir = checkpoint("qwen2")
    prompts = repeating_prompts(seed=5)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64) as plain:
        expected = greedy(plain, prompts)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64, speculative=FIXED, tensor_parallel_size=2,
             cluster_name="spec-tp", engine_name="spec-tp2") as tp2:
        assert greedy(tp2, prompts) == expected
        assert tp2.engine.stats.verify_steps > 0


def test_no_block_is_held_after_300_requests_with_a_third_cancelled(checkpoint):
    model_dir = checkpoint("llama")
    rng = random.Random(7)
    prompts = [p + p for p in random_prompts([rng.randrange(2, 30) for _ in range(300)], seed=11)]
    with LLM(str(model_dir), verbose=False, num_kv_blocks=96, max_num_seqs=16, speculative=FIXED) as llm:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        cancelled = set(rng.sample(range(300), 100))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            for i in [i for i in cancelled if rng.random() < 0.2]:
                engine.abort_request(f"r{i}")
                cancelled.discard(i)
        assert engine.stats.verify_steps > 0 and engine.stats.proposed_tokens > engine.stats.accepted_tokens
        assert engine.block_manager.num_free_blocks == 96
        assert not engine.scheduler.requests


@pytest.mark.registry
@pytest.mark.parametrize("cpu_matmul_dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16_dots)])
def test_the_default_model_checks_8_guesses_a_step_with_the_tokens_and_blocks_of_plain_steps(cpu_matmul_dtype):
    """Verifies of up to 9 rows (past the fused step's 8-row tiles, the output layer's 4 and 5-row
    ones, one attention group): greedy tokens are the plain engine's, and after every step each
    running request holds the blocks of its computed tokens and at most its newest token's (those
    held for guesses not kept went back), every other block free. With bfloat16 dot products too:
    a row's products do not depend on the rows beside it there either."""
    from cluster.default_model import default_model_path

    prompts = [code_edit_prompt(), "Once upon a time, in a small village at the edge of a great forest, there lived a"]
    params = SamplingParams(temperature=0, max_tokens=64)
    options = dict(verbose=False, num_kv_blocks=64, cpu_matmul_dtype=cpu_matmul_dtype)
    with LLM(str(default_model_path()), **options) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM(str(default_model_path()), speculative=SpeculativeConfig(num_tokens=8, adaptive=False),
             **options) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        most_guesses = 0  # of a request in a step
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id] = output.token_ids
            running = engine.scheduler.running
            most_guesses = max([most_guesses, *(len(r.spec_token_ids) for r in running)])
            for request in running:  # the slots of its computed tokens, and at most its newest token's
                bs = engine.config.block_size
                assert -(-request.num_computed_tokens // bs) <= len(request.block_ids) <= -(-request.num_tokens // bs)
            assert engine.block_manager.num_free_blocks == 64 - sum(len(r.block_ids) for r in running)
        stats = engine.stats
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
        assert stats.proposed_tokens > stats.accepted_tokens > 0, "guesses kept and refused: both were tested"
        assert most_guesses == 8, "no request was given 8 guesses"
        assert engine.block_manager.num_free_blocks == 64


def test_a_steady_batch_keeps_a_step_cost_fitted_through_every_step_kept(checkpoint):
    """Where the latest steps all had one width (a steady batch that guesses nothing) the n-gram
    policy's cost is the line through every step kept, not none (which guesses one a request, a
    step twice as wide, to measure again); where every step kept had one width there is none."""
    from cluster.engine.engine import StepRecord
    from cluster.engine.speculative.policy import FITTED_STEPS

    with LLM(str(checkpoint("llama")), verbose=False, num_kv_blocks=64, max_num_seqs=8,
             speculative=SpeculativeConfig(num_tokens=4)) as llm:
        engine = llm.engine
        engine.stats.steps.clear()
        for _ in range(FITTED_STEPS + 10):
            engine.stats.record(StepRecord(num_decode_tokens=8, num_prefill_tokens=0, seconds=0.013, context_tokens=0))
        engine._cost_fitted_at = None
        assert engine._step_cost() is None  # one width in all of history: nothing says what a row costs
        for rows in (1, 2, 4):  # earlier steps of other widths, then a steady batch of 8
            for _ in range(4):
                engine.stats.steps.appendleft(StepRecord(num_decode_tokens=rows, num_prefill_tokens=0,
                                                         seconds=0.005 + 0.001 * rows, context_tokens=0))
        engine._cost_fitted_at = None
        cost = engine._step_cost()
        assert cost is not None
        assert (cost.fixed_s, cost.per_row_s) == (pytest.approx(0.005), pytest.approx(0.001))
        assert cost.widths == {1: pytest.approx(0.006), 2: pytest.approx(0.007), 4: pytest.approx(0.009),
                               8: pytest.approx(0.013)}


def test_a_closed_gate_makes_no_lookup_and_the_index_catches_up_at_the_next_one(checkpoint, monkeypatch):
    """While the policy's gate says no guess could pay (here: for the first 12 steps) no request's
    n-gram index is looked up or extended; at the first lookup after, each index catches up from
    where it stopped, and every proposal equals the one an index built at once over the request's
    tokens gives. Greedy tokens are the plain engine's."""
    from cluster.engine.speculative.ngram import NgramIndex
    from cluster.engine.speculative.policy import GuessGate, StepCost
    from cluster.engine.speculative.proposer import NgramProposer

    model_dir = checkpoint("llama")
    prompts = repeating_prompts()
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64) as plain:
        expected = greedy(plain, prompts)
    spec = SpeculativeConfig(num_tokens=4, adaptive=True)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64, speculative=spec) as llm:
        engine = llm.engine
        gate = {"open": False, "asked": 0}

        def gate_open(self, *args):
            gate["asked"] += 1
            return gate["open"]

        monkeypatch.setattr(GuessGate, "open", gate_open)
        # a fitted cost (the gate is asked every step) whose fixed part makes guesses pay at batch 4
        monkeypatch.setattr(engine, "_step_cost", lambda: StepCost(0.05, 0.001))
        checked, lookups = [], []
        real_available = NgramProposer.available

        def available(self, requests, rooms):
            indexed = [r.proposer_state.indexed if r.proposer_state is not None else 0 for r in requests]
            counts = real_available(self, requests, rooms)
            for request, room, before, count in zip(requests, rooms, indexed, counts):
                fresh = NgramIndex(spec.ngram_min, spec.ngram_max).propose(request.token_ids, room)
                checked.append(self._proposals[id(request)] == fresh and count == len(fresh))
                lookups.append(len(request.token_ids) - before)  # tokens the index caught up over
            return counts

        monkeypatch.setattr(NgramProposer, "available", available)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished_requests():
            gate["open"] = steps >= 12
            for output in engine.step():
                tokens[output.request_id] = output.token_ids
            steps += 1
            if steps == 12:
                assert gate["asked"] > 0 and not lookups, "a lookup was made while the gate was closed"
                assert all(r.proposer_state is None for r in engine.scheduler.running)
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
        assert checked and all(checked), "a proposal after a catch-up differs from a fresh index's"
        assert max(lookups) > 12, "no index caught up over the tokens made while the gate was closed"
        assert engine.stats.verify_steps > 0, "no guess was made: nothing was tested"
        assert engine.block_manager.num_free_blocks == 64
