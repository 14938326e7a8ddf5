"""Speculative decoding with a draft model (``method: draft``) through the engine.

A draft is a smaller random checkpoint with the target's tokenizer: its guesses are mostly wrong,
and greedy output must still be the output without speculation, token for token, on every
architecture. A draft that is the model itself must have every greedy guess kept: the check that
the draft's KV follows the target's (prompt chunks, kept guesses, the prefix cache, preemption) to
the token. The draft runs only for guesses and catches up in one forward when a request's
guessing resumes (exact forward sizes). Blocks: none held once every request ended, after
rejected guesses, cancellations and preemptions. A draft that cannot guess for the target is
refused naming speculative.draft_model.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest

from cluster.engine.config import EngineConfigError
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.speculative.config import SpeculativeConfig
from cluster.engine.speculative.policy import FITTED_STEPS, StepCost
from cluster.offline.llm import LLM
from conftest import random_prompts

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]


def draft(path, num_tokens: int = 4, adaptive: bool = False) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", draft_model=str(path), num_tokens=num_tokens, adaptive=adaptive)


def greedy(llm: LLM, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_with_a_draft_equals_greedy_without(architecture, checkpoint, draft_checkpoint):
    model_dir = checkpoint(architecture)
    prompts = random_prompts([5, 17, 40, 70], seed=4)  # 70: a prompt in several chunks
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64) as plain:
        expected = greedy(plain, prompts)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64, max_num_batched_tokens=32,
             speculative=draft(draft_checkpoint(architecture))) as llm:
        assert greedy(llm, prompts) == expected
        stats = llm.engine.stats
        assert stats.proposed_tokens > 0 and stats.verify_steps > 0, "no guess was made: nothing was tested"
        assert llm.engine.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("architecture", ["llama", "mistral"])
def test_a_draft_that_is_the_model_itself_has_every_greedy_guess_kept(architecture, checkpoint):
    """Prompts in several chunks, a second pass served from the prefix cache (the cached blocks
    must hold the draft's KV too), guesses cut at max_tokens, the whole in a small budget."""
    model_dir = checkpoint(architecture)
    prompts = random_prompts([3, 16, 33, 60], seed=6)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64) as plain:
        expected = greedy(plain, prompts, 30)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64, max_num_batched_tokens=24,
             speculative=draft(model_dir, num_tokens=5)) as llm:
        assert greedy(llm, prompts, 30) == expected
        assert greedy(llm, prompts, 30) == expected  # the prompts' blocks now come from the prefix cache
        stats = llm.engine.stats
        assert stats.proposed_tokens > 100
        assert stats.accepted_tokens == stats.proposed_tokens
        assert llm.engine.block_manager.num_free_blocks == 64


def test_a_self_draft_keeps_every_guess_through_preemption(checkpoint):
    """A cache too small for the batch: requests are preempted and recomputed, and the draft's
    KV is rebuilt with theirs (every guess still kept)."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([30, 25, 28, 31, 27, 22], seed=8)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64) as plain:
        expected = greedy(plain, prompts, 40)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=20, speculative=draft(model_dir)) as llm:
        assert greedy(llm, prompts, 40) == expected
        stats = llm.engine.stats
        assert stats.num_preemptions > 0, "no request was preempted: nothing was tested"
        assert stats.proposed_tokens > 0 and stats.accepted_tokens == stats.proposed_tokens
        assert llm.engine.block_manager.num_free_blocks == 20


def test_no_block_is_held_after_requests_with_a_third_cancelled_and_preemptions(checkpoint, draft_checkpoint):
    model_dir = checkpoint("llama")
    rng = random.Random(9)
    prompts = random_prompts([rng.randrange(2, 40) for _ in range(60)], seed=12)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=24, max_num_seqs=12,
             speculative=draft(draft_checkpoint("llama"))) as llm:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        cancelled = set(rng.sample(range(60), 20))
        while engine.has_unfinished_requests():
            engine.step()
            for i in [i for i in cancelled if rng.random() < 0.2]:
                engine.abort_request(f"r{i}")
                cancelled.discard(i)
        assert engine.stats.verify_steps > 0 and engine.stats.proposed_tokens > engine.stats.accepted_tokens
        assert engine.stats.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == 24
        assert not engine.scheduler.requests


def test_the_adaptive_policy_counts_the_drafts_measured_steps(checkpoint):
    """Adaptive with a self-draft: guesses are made (one each until the step cost is fitted) and
    all kept, and the draft's forwards are timed; each step's record says how much of it was the
    draft's, none in a step that made no guesses (the draft runs only for guesses). Once the
    target's step cost is fitted, the draft's cost is known too (measured, or the target's scaled
    by the draft's share of the weights: here all of them), and a draft as dear as the target,
    its catch-up counted, is given no more guesses: it runs nothing."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([12, 20], seed=2)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64, speculative=draft(model_dir, adaptive=True)) as llm:
        greedy(llm, prompts, 48)
        engine = llm.engine
        assert engine.proposer.size_ratio == 1.0
        assert engine.proposer.round_cost(engine._step_cost()) is not None and len(engine.proposer.forwards) > 0
        assert engine.stats.proposed_tokens > 0 and engine.stats.accepted_tokens == engine.stats.proposed_tokens
        steps = list(engine.stats.steps)
        assert all(s.draft_seconds < s.seconds for s in steps)
        # a step's draft time is its proposing of the next step's guesses
        assert [s.draft_seconds > 0 for s in steps[:-1]] == [s.guess_tokens > 0 for s in steps[1:]]
        forwards, guesses = len(engine.proposer.forwards), engine.stats.proposed_tokens
        # the target's cost fitted by now; past FITTED_STEPS steps of one width it stays fitted,
        # and nothing is guessed again to measure it (which would make the draft catch up)
        greedy(llm, random_prompts([16], seed=3), FITTED_STEPS + 40)
        assert (len(engine.proposer.forwards), engine.stats.proposed_tokens) == (forwards, guesses)


def test_a_drafts_cost_before_it_is_measured_is_the_targets_scaled_by_its_weights(checkpoint):
    model_dir = checkpoint("llama")
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64, speculative=draft(model_dir, adaptive=True)) as llm:
        proposer = llm.engine.proposer
        assert proposer.round_cost(None) is None  # nothing measured, nothing to scale
        proposer.size_ratio = 0.25
        assert proposer.round_cost(StepCost(0.008, 0.002)) == StepCost(0.002, 0.0005)
        # one-row forwards measured (batch 1: one width, no line): their mean, a row at the scaled rate
        proposer.forwards.extend([(1, 0.003)] * 4)
        assert proposer.round_cost(StepCost(0.008, 0.002)) == StepCost(pytest.approx(0.0025), 0.0005)


def test_a_draft_that_cannot_guess_for_the_target_is_refused_naming_the_key(checkpoint, draft_checkpoint, tmp_path):
    model_dir = str(checkpoint("llama"))
    cases = [
        (tmp_path / "missing", r"^speculative.draft_model: .*missing does not exist"),
        (draft_checkpoint("llama", vocab_size=400), r"^speculative.draft_model: the draft's tokenizer differs"),
        (draft_checkpoint("llama", vocab_size=600), r"^speculative.draft_model: the draft's vocabulary \(600 ids\) is "
                                                   r"larger than the model's \(512\)"),
        (draft_checkpoint("llama", max_position_embeddings=128), r"^speculative.draft_model: the draft's context "
                                                                 r"\(128 tokens\) is shorter than max_model_len \(512\)"),
    ]
    for path, message in cases:
        with pytest.raises(EngineConfigError, match=message):
            LLM(model_dir, verbose=False, num_kv_blocks=16, speculative=draft(path))


@contextmanager
def switched_self_draft(model_dir, monkeypatch, num_kv_blocks: int):
    """An engine with the model as its own draft (block size 16, up to 3 guesses) that guesses
    only while ``switch["on"]`` (every proposal in full), and a log of the draft's forwards:
    (rows, each span's first position)."""
    import cluster.engine.engine as engine_module

    switch = {"on": False}
    from cluster.engine.speculative.policy import GuessGate

    monkeypatch.setattr(GuessGate, "open", lambda self, *args: True)
    monkeypatch.setattr(engine_module, "worth_a_row", lambda *args: True)
    monkeypatch.setattr(engine_module, "plan_guesses",
                        lambda first, then, available, rows, cost, round_cost=None, catch_up=None:
                        list(available) if switch["on"] else [0] * len(available))
    with LLM(str(model_dir), verbose=False, num_kv_blocks=num_kv_blocks, block_size=16,
             speculative=draft(model_dir, num_tokens=3, adaptive=True)) as llm:
        engine, forwards = llm.engine, []
        run = engine.proposer._forward

        def logged(plan):
            forwards.append((len(plan.input_ids), [p.context_len - p.query_len for p in plan.prefills]))
            return run(plan)

        monkeypatch.setattr(engine.proposer, "_forward", logged)
        yield engine, switch, forwards


def run_to_the_end(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_a_draft_runs_nothing_while_nothing_is_guessed_and_catches_up_in_one_forward(checkpoint, monkeypatch):
    """A self-draft kept idle for the prompts and 6 decode steps runs no forward; when guessing
    resumes, one forward feeds each request every token it missed (prompt and output so far,
    from position 0), then every guess is kept: the caught-up KV is the target's. A second pass
    of the same prompts trusts the draft's KV of the cached blocks it completed: its catch-up
    starts at the cached prefix."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([40, 23], seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64) as plain:
        expected = greedy(plain, prompts, 20)
    with switched_self_draft(model_dir, monkeypatch, 64) as (engine, switch, forwards):
        requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        for _ in range(7):  # the prompts' step, then 6 decodes
            engine.step()
        assert forwards == [] and engine.stats.proposed_tokens == 0
        assert [r.num_output_tokens for r in requests] == [7, 7]
        switch["on"] = True
        engine.step()  # a plain decode (no guesses were held for it); then the first guesses
        assert forwards[0] == (40 + 8 + 23 + 8, [0, 0])  # every token of both, in one forward
        assert [f[0] for f in forwards[1:3]] == [2, 2]  # then 2 decode rounds of both
        run_to_the_end(engine)
        assert [r.output_token_ids for r in requests] == expected
        assert engine.stats.proposed_tokens > 0 and engine.stats.accepted_tokens == engine.stats.proposed_tokens
        assert engine.block_manager.num_free_blocks == 64

        # Again, guessing throughout: the first pass's catch-up completed the prompts' full
        # blocks (2 of 16 tokens and 1), which the target's prefix cache serves now.
        forwards.clear()
        again = [engine.add_request(f"s{i}", p, params) for i, p in enumerate(prompts)]
        engine.step()
        assert [r.num_cached_tokens for r in again] == [32, 16]
        assert forwards[0] == ((41 - 32) + (24 - 16), [32, 16])
        run_to_the_end(engine)
        assert [r.output_token_ids for r in again] == expected
        assert engine.stats.accepted_tokens == engine.stats.proposed_tokens
        assert engine.block_manager.num_free_blocks == 64


def test_cached_blocks_the_draft_never_filled_are_computed_again(checkpoint, monkeypatch):
    """A first pass that never guessed left the target's KV in the prefix cache and none of the
    draft's: the second pass's catch-up starts at 0, and every guess is still kept."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([40], seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=32) as plain:
        expected = greedy(plain, prompts, 12)
    with switched_self_draft(model_dir, monkeypatch, 32) as (engine, switch, forwards):
        first = engine.add_request("idle", prompts[0], params)
        run_to_the_end(engine)
        assert forwards == [] and first.output_token_ids == expected[0]
        switch["on"] = True
        second = engine.add_request("guessing", prompts[0], params)
        engine.step()
        assert second.num_cached_tokens == 32  # the target's KV comes from the cache ...
        assert forwards[0] == (41, [0])  # ... the draft's does not: it never computed those blocks
        run_to_the_end(engine)
        assert second.output_token_ids == expected[0]
        assert engine.stats.proposed_tokens > 0 and engine.stats.accepted_tokens == engine.stats.proposed_tokens
        assert engine.block_manager.num_free_blocks == 32


def test_a_float_draft_is_quantized_like_a_quantized_target_and_runs_its_fused_step(checkpoint):
    """A target quantized at load (int8) runs the fused CPU step; its float self-draft is
    quantized alike at load and runs there too, so it still guesses the target's every token.
    Beside a float target, a float draft stays float."""
    from cluster.engine.speculative.draft_model import draft_quantization, read_draft

    model_dir = checkpoint("llama")
    prompts = random_prompts([9, 30], seed=3)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64, quantization="int8") as plain:
        expected = greedy(plain, prompts)
    with LLM(str(model_dir), verbose=False, num_kv_blocks=64, quantization="int8",
             speculative=draft(model_dir)) as llm:
        runner = llm.engine.proposer.runner
        assert runner.config.quantization == "int8" and runner.native_step is not None
        assert greedy(llm, prompts) == expected
        stats = llm.engine.stats
        assert stats.proposed_tokens > 0 and stats.accepted_tokens == stats.proposed_tokens
    checkpoint_of = read_draft(str(model_dir))
    assert draft_quantization(checkpoint_of, "gguf", "cpu", "torch") == "int8"
    assert draft_quantization(checkpoint_of, "none", "cpu", "torch") == "none"
