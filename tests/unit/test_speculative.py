"""Speculative decoding's parts without a model: the n-gram index, what a verify emits, the
adaptive policy's arithmetic, the config's refusals, and the scheduler's guesses and blocks
(block size 4, as in test_scheduler.py)."""

from __future__ import annotations

import pytest

from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler
from cluster.engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from cluster.engine.speculative.ngram import NgramIndex
from cluster.engine.speculative.policy import (CATCH_UP_STEPS, MIN_GAIN, StepCost, catch_up_share, plan_guesses,
                                               update_acceptance, update_continuation)
from cluster.engine.speculative.proposer import NgramProposer
from cluster.engine.speculative.verify import accepted_prefix

pytestmark = pytest.mark.unit

BS = 4
EOS = 2


# -- proposals ------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_longest_first():
    index = NgramIndex(2, 3)
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 5, 6, 7]
    # the 3-gram [5, 6, 7] occurred at 0..2, followed by 8 9 1; the 2-gram [6, 7] last at 6..7, followed by 3
    assert index.propose(tokens, 3) == [8, 9, 1]
    index = NgramIndex(2, 2)
    assert index.propose(tokens, 3) == [3, 4, 5]


def test_ngram_never_matches_its_own_suffix_and_runs_to_the_end():
    index = NgramIndex(2, 2)
    assert index.propose([1, 2, 3], 4) == []  # [2, 3] only occurs as the suffix
    assert index.propose([1, 2, 3, 1, 2], 4) == [3, 1, 2]  # what follows runs into the suffix itself


def test_ngram_index_extended_step_by_step_equals_one_built_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1):
        proposal = grown.propose(tokens[:end], 4)
        assert proposal == NgramIndex(1, 3).propose(tokens[:end], 4), end


def test_a_verify_emits_samples_while_they_equal_the_guesses_then_the_first_that_does_not():
    assert accepted_prefix([7, 8, 9], [7, 8]) == [7, 8, 9]  # both kept, and the last row's token
    assert accepted_prefix([7, 5, 9], [7, 8]) == [7, 5]  # the second row disagreed: its sample instead
    assert accepted_prefix([4, 8, 9], [7, 8]) == [4]
    assert accepted_prefix([4], []) == [4]


# -- the policy ------------------------------------------------------------------------------

def test_step_cost_is_a_line_through_the_widths_medians_and_each_widths_median():
    cost = StepCost.fit([(1, 0.006), (2, 0.007), (3, 0.008), (5, 0.010)])
    assert cost.fixed_s == pytest.approx(0.005) and cost.per_row_s == pytest.approx(0.001)
    assert cost.widths == {}  # no width measured MIN_FITTED_STEPS times: the line everywhere
    assert cost.seconds(4) == pytest.approx(0.009)
    assert StepCost.fit([(1, 0.006)] * 10) is None  # one width: nothing says what a row costs
    assert StepCost.fit([(1, 0.006), (2, 0.007)]) is None  # too few steps
    # four steps of 5 rows at 12 ms (the fused CPU step's fifth row): that width's mean, and no
    # wider step is taken for shorter than it
    cost = StepCost.fit([(1, 0.006)] * 4 + [(5, 0.012)] * 4)
    assert cost.widths == {1: pytest.approx(0.006), 5: pytest.approx(0.012)}
    assert cost.seconds(5) == pytest.approx(0.012) and cost.seconds(1) == pytest.approx(0.006)
    assert cost.seconds(3) == pytest.approx(0.009)  # the line: 0.0045 + 0.0015 * 3
    assert cost.seconds(6) == pytest.approx(0.0135)  # the line is above the 5-row mean here
    assert StepCost(0.005, 0.001, {5: 0.020}).seconds(6) == pytest.approx(0.020)  # never below a narrower width
    # through each width's median: a 2-row step caught in a load spike (70 ms) does not move the
    # line (through the raw steps its cost of a row would be 8.9 ms, not 1)
    cost = StepCost.fit([(1, 0.006)] * 8 + [(2, 0.007)] * 7 + [(2, 0.070)])
    assert cost.per_row_s == pytest.approx(0.001) and cost.fixed_s == pytest.approx(0.005)


def test_guesses_are_those_whose_number_makes_the_most_tokens_per_second():
    cost = StepCost(fixed_s=0.005, per_row_s=0.001)
    # one request, odds 0.8 then 0.8: gains 0.8, 0.64, 0.512, 0.41, 0.33, ...; rates 1 / 6 ms
    # (0.167), 1.8 / 7 (0.257), 2.44 / 8 (0.305), 2.95 / 9 (0.328), 3.36 / 10 (0.336),
    # 3.69 / 11 (0.335): the most at 4
    assert plan_guesses([0.8], [0.8], [8], rows=1, cost=cost) == [4]
    assert plan_guesses([0.8], [0.8], [2], rows=1, cost=cost) == [2]  # no more than the proposal has
    assert plan_guesses([0.1], [0.8], [8], rows=1, cost=cost) == [0]  # 1.1 / 7 < 1 / 6: not worth a row
    # a first guess that may well fail, after which guesses are kept in runs: 7 of a proposal of 8
    assert plan_guesses([0.3], [0.95], [8], rows=1, cost=cost) == [7]
    # 32 rows already: a row is worth 32/37 = 0.86 tokens, more than any guess adds
    assert plan_guesses([0.8] * 32, [0.8] * 32, [8] * 32, rows=32, cost=cost) == [0] * 32
    assert plan_guesses([0.8, 0.3], [0.8, 0.8], [4, 4], rows=2, cost=None) == [1, 1]  # no fit yet: one each, to measure
    # a fifth row as dear as three (12 ms for 5 rows, 1 ms a row up to 4): three guesses, not four
    widths = StepCost(0.005, 0.001, {1: 0.006, 2: 0.007, 3: 0.008, 4: 0.009, 5: 0.012, 6: 0.013, 7: 0.014, 8: 0.015})
    assert plan_guesses([0.8], [0.8], [8], rows=1, cost=widths) == [3]


def test_a_step_guesses_only_where_its_guesses_gain_min_gain_or_more():
    cost = StepCost(fixed_s=0.005, per_row_s=0.001)
    # 8 decodes: 8 tokens in 13 ms (0.615 a ms). One guess at odds 0.9: 8.9 in 14 ms (0.636), 3.3%
    # more, under MIN_GAIN: none (without the margin it was taken).
    assert MIN_GAIN == 0.05
    assert plan_guesses([0.9] + [0.0] * 7, [0.9] * 8, [1] * 8, rows=8, cost=cost) == [0] * 8
    # Every decode guessing at those odds: 8 + 8 * (0.9 + 0.81) tokens in 29 ms (0.748), 22% more: two each
    assert plan_guesses([0.9] * 8, [0.9] * 8, [4] * 8, rows=8, cost=cost) == [2] * 8
    # 32 decodes: a sure guess adds 0.4% to the step (32 / 37 -> 33 / 38); all 32 of them 7.2%
    # (64 / 69): taken only together
    assert plan_guesses([1.0] + [0.0] * 31, [0.0] * 32, [1] * 32, rows=32, cost=cost) == [0] * 32
    assert plan_guesses([1.0] * 32, [0.0] * 32, [1] * 32, rows=32, cost=cost) == [1] * 32
    # at batch 1 a guess at odds 0.3 gains 12% (1.3 tokens in 7.1 ms against 1 in 6.1): taken
    assert plan_guesses([0.3], [0.0], [1], rows=1, cost=StepCost(0.0051, 0.001)) == [1]


def test_a_draft_models_steps_are_counted_in_what_a_guess_costs():
    cost = StepCost(fixed_s=0.005, per_row_s=0.001)
    # A free draft: as without one (see above), 4 guesses at odds 0.8.
    assert plan_guesses([0.8], [0.8], [8], rows=1, cost=cost, round_cost=StepCost(0.0, 0.0)) == [4]
    # The draft runs only in steps that guess. A draft step of 2 ms + 0.1 ms a row: the first
    # guess costs its forward (2.1 ms) and a row (1 ms): 1.8 tokens in 9.1 ms (0.198 > 1 / 6);
    # the second a draft step (2.1 ms) and a row: 2.44 in 12.2 (0.2); the third 2.95 in 15.3
    # (0.193): the most at 2.
    assert plan_guesses([0.8], [0.8], [8], rows=1, cost=cost, round_cost=StepCost(0.002, 0.0001)) == [2]
    # A draft step as dear as the target's, every guess kept: 2 tokens in 13 ms < 1 in 6: none,
    # and a dearer one still: none (the draft then runs nothing at all).
    assert plan_guesses([1.0], [1.0], [8], rows=1, cost=cost, round_cost=StepCost(0.006, 0.001)) == [0]
    assert plan_guesses([0.8], [0.8], [8], rows=1, cost=cost, round_cost=StepCost(0.05, 0.0001)) == [0]
    # A guess that rides a draft step another request's surer guess opened costs only its rows
    draft = StepCost(0.001, 0.0001)
    assert plan_guesses([0.8], [0.8], [8], rows=2, cost=cost, round_cost=draft) == [1]
    assert plan_guesses([0.95, 0.8], [0.95, 0.8], [8, 8], rows=2, cost=cost, round_cost=draft) == [4, 1]


def test_a_drafts_catch_up_is_counted_in_the_first_guess_spread_over_the_steps_it_serves():
    cost = StepCost(fixed_s=0.005, per_row_s=0.001)
    draft = StepCost(0.001, 0.0001)
    # caught up (only the newest token to feed): as without catch_up
    assert plan_guesses([0.8], [0.8], [8], rows=1, cost=cost, round_cost=draft, catch_up=[0.0]) == \
        plan_guesses([0.8], [0.8], [8], rows=1, cost=cost, round_cost=draft)
    # caught up, 3 guesses at odds 0.8 make 2.95 tokens in 12.3 ms (9 ms of target, 3 draft steps
    # of 1.1 ms): 0.24 a ms. 20 rows of backlog more (2 ms): 2.95 / 14.3 = 0.21, still above the
    # plain step's 1 / 6 ms: guessed, as many
    assert plan_guesses([0.8], [0.8], [8], rows=1, cost=cost, round_cost=draft, catch_up=[20.0]) == [3]
    # ... 200 rows (20 ms): 2.95 / 32.3 < 1 / 6 ms, and no other number of guesses does better: none
    assert plan_guesses([0.8], [0.8], [8], rows=1, cost=cost, round_cost=draft, catch_up=[200.0]) == [0]
    # charged to the request whose first guess it is: the caught-up one gets its 5 guesses (6.30
    # tokens in 17.5 ms, the most a ms), the one 200 rows behind none, and taking its dear first
    # guess early (same odds) does not cut the other's run short
    assert plan_guesses([0.95, 0.95], [0.95, 0.95], [8, 8], rows=2, cost=cost, round_cost=draft,
                        catch_up=[0.0, 200.0]) == [5, 0]
    assert plan_guesses([0.95], [0.95], [8], rows=2, cost=cost, round_cost=draft) == [5]
    # a step carries 1/min(32, tokens left) of the backlog: paid once, it serves later steps' guesses
    assert catch_up_share(640, 1000) == 640 / CATCH_UP_STEPS == 20.0
    assert catch_up_share(640, 8) == 80.0  # 8 tokens left: at most 8 steps to pay it back
    assert catch_up_share(0, 100) == 0.0 and catch_up_share(5, 0) == 5.0


def test_odds_follow_the_checked_guesses_and_drift_back_while_none_are_made():
    assert update_acceptance(0.5, 4, 4) == pytest.approx(0.65)  # the first guess was kept
    assert update_acceptance(0.5, 4, 1) == pytest.approx(0.65)
    assert update_acceptance(0.5, 4, 0) == pytest.approx(0.35)
    assert update_acceptance(0.1, 0, 0) == pytest.approx(0.12)  # 5% of the gap back to the prior 0.5
    assert update_acceptance(0.9, 0, 0) == 0.9
    # after a kept guess: 4 checked of which 4 kept -> 3 of 3 continued; 1 kept -> 0 of 1
    assert update_continuation(0.5, 4, 4) == pytest.approx(0.65)
    assert update_continuation(0.5, 4, 1) == pytest.approx(0.35)
    assert update_continuation(0.5, 4, 2) == pytest.approx(0.5 * 0.7 + 0.3 * 0.5)  # 1 of 2
    assert update_continuation(0.5, 4, 0) == 0.5  # no guess after a kept one was checked
    assert update_continuation(0.5, 1, 1) == 0.5


def test_ngram_odds_are_the_engines_for_the_proposals_match_length():
    config = SpeculativeConfig(ngram_min=1, ngram_max=3)
    proposer = NgramProposer(config)
    a = Request("a", [5, 6, 7, 8, 5, 6, 7], SamplingParams(max_tokens=10), eos_token_ids=frozenset({EOS}))
    b = Request("b", [1, 2, 3, 9, 3], SamplingParams(max_tokens=10), eos_token_ids=frozenset({EOS}))
    assert proposer.available([a, b], [4, 4]) == [4, 2]  # a: [5, 6, 7] matched, [8, 5, 6, 7]; b: [3], [9, 3]
    assert (a.proposer_state.matched, b.proposer_state.matched) == (3, 1)
    assert proposer.first_odds([a, b]) == [0.5, 0.5]  # the prior, each length
    proposer.observe(a, 2, 2)  # a 3-token match's first guess kept, a 1-token one's not
    proposer.observe(b, 2, 0)
    assert proposer.first_odds([a, b]) == [pytest.approx(0.55), pytest.approx(0.45)]
    assert proposer.first_by_match[2] == 0.5


def test_num_tokens_left_out_is_8_for_ngram_and_4_for_a_draft():
    assert SpeculativeConfig().num_tokens == 8
    assert SpeculativeConfig(method="draft", draft_model="/models/small").num_tokens == 4
    assert SpeculativeConfig(num_tokens=3).num_tokens == 3
    assert SpeculativeConfig() == SpeculativeConfig(num_tokens=8)


def test_the_config_refuses_what_it_cannot_serve_with_one_line():
    with pytest.raises(SpeculativeConfigError, match="speculative.draft_model must name the draft checkpoint"):
        SpeculativeConfig(method="draft")
    with pytest.raises(SpeculativeConfigError, match="speculative.draft_model is read only with method draft"):
        SpeculativeConfig(draft_model="/models/small")
    with pytest.raises(SpeculativeConfigError, match="speculative.method must be one of ngram, draft, got 'eagle'"):
        SpeculativeConfig(method="eagle")
    assert SpeculativeConfig(method="draft", draft_model="/models/small").draft_model == "/models/small"
    with pytest.raises(SpeculativeConfigError, match=r"speculative.num_tokens must be an integer in \[1, 16\], got 0"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(SpeculativeConfigError, match="ngram_min .3. must not exceed"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(SpeculativeConfigError, match="adaptive must be true or false"):
        SpeculativeConfig(adaptive="yes")


# -- the scheduler -----------------------------------------------------------------------------

def make_scheduler(num_blocks: int = 16, budget: int = 16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, enable_prefix_caching=True), budget, 8, 64)


def decoding(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 16, **params) -> Request:
    """A request past its prompt step: its prompt's KV computed, one output token sampled."""
    request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=frozenset({EOS}))
    sched.add(request)
    out = sched.schedule()  # every other running request decodes a token too
    sched.update(out, {r.request_id: 50 for r, n in out.scheduled() if r.num_computed_tokens + n == r.num_tokens})
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == len(prompt)
    return request


def test_a_decode_with_guesses_is_scheduled_as_one_row_per_guess_and_its_blocks_held_for_them():
    sched = make_scheduler()
    request = decoding(sched, "a", [10, 11, 12])  # 3 prompt tokens + 1 output: 4 tokens, block 0 full
    assert request.block_ids == [0]
    request.spec_token_ids = [60, 61, 62]
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.verifies] == [("a", 4)] and not out.decodes
    assert out.num_tokens == 4
    assert request.block_ids == [0, 1]  # positions 3..6: the last token's and three guesses' slots
    # two guesses kept, the third not: the step emits 60, 61 and the third row's own token 70
    sched.update(out, {"a": [60, 61, 70]})
    assert request.token_ids == [10, 11, 12, 50, 60, 61, 70]
    assert request.num_computed_tokens == 6 and request.spec_token_ids == []
    assert request.block_ids == [0, 1]  # 7 tokens need both blocks: nothing to give back
    request.spec_token_ids = [71, 72, 73, 74]
    out = sched.schedule()
    assert request.block_ids == [0, 1, 2]  # positions 6..10
    sched.update(out, {"a": [80]})  # the first guess was wrong
    assert request.num_computed_tokens == 7 and request.token_ids[-1] == 80
    assert request.block_ids == [0, 1]  # 8 tokens: block 2, held for the guesses, went back
    assert sched.blocks.num_free_blocks == 14


def test_guesses_fit_the_token_budget_and_never_take_blocks_from_another_request():
    sched = make_scheduler(budget=3)
    request = decoding(sched, "a", [10, 11, 12])
    request.spec_token_ids = [60, 61, 62, 63]
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.verifies] == [("a", 3)]  # budget 3: two guesses
    assert request.spec_token_ids == [60, 61]

    sched = make_scheduler(num_blocks=2)
    a = decoding(sched, "a", [10, 11], max_tokens=4)
    b = decoding(sched, "b", [20, 21], max_tokens=4)  # a decoded once more meanwhile: 4 tokens in block 0
    assert (a.num_tokens, a.block_ids, b.block_ids, sched.blocks.num_free_blocks) == (4, [0], [1], 0)
    a.spec_token_ids = [60, 61]
    out = sched.schedule()
    # no free block for the guesses' slots: a decodes plainly, and b is not preempted for them
    assert not out.preempted and not out.verifies
    assert sorted(r.request_id for r in out.decodes) == ["a", "b"] and a.spec_token_ids == []


def test_look_ahead_slots_are_held_from_free_blocks_only_and_given_back_when_not_used():
    sched = make_scheduler(num_blocks=4)
    request = decoding(sched, "a", [10, 11, 12], max_tokens=8)  # 4 tokens: block 0 full
    assert sched.reserve_lookahead(request, 4 + 6, spare_blocks=1) == 10  # blocks 1 and 2 for positions 4..9
    assert request.block_ids == [0, 1, 2] and sched.blocks.num_free_blocks == 1
    assert sched.reserve_lookahead(request, 4 + 12, spare_blocks=1) == 12  # the last free block is spared
    request.spec_token_ids = [60]  # the budget or the proposer left one guess: block 2 is not needed
    out = sched.schedule()
    sched.update(out, {"a": [60, 61]})
    assert request.num_tokens == 6 and request.block_ids == [0, 1] and sched.blocks.num_free_blocks == 2
    assert sched.reserve_lookahead(request, 6 + 2) == 8 and request.block_ids == [0, 1]  # room already held
    out = sched.schedule()  # a plain decode (no guesses): the blocks it holds beyond its tokens go back too
    sched.update(out, {"a": [62]})
    assert request.block_ids == [0, 1] and sched.blocks.num_free_blocks == 2


def test_a_stop_among_the_emitted_tokens_finishes_the_request_and_frees_its_blocks():
    sched = make_scheduler()
    request = decoding(sched, "a", [10, 11, 12])
    request.spec_token_ids = [60, 61, 62]
    out = sched.schedule()
    finished = sched.update(out, {"a": [60, EOS]})
    assert finished == [request] and request.token_ids[-2:] == [60, EOS]
    assert request.block_ids == [] and sched.blocks.num_free_blocks == 16
    request = decoding(sched, "b", [30, 31, 32], max_tokens=3)
    assert sched.tokens_before_stop(request, [60, 61, 62]) == 2  # one output so far, max_tokens 3
    assert sched.tokens_before_stop(request, [EOS, 61]) == 1


def test_a_step_too_wide_for_any_requests_own_odds_skips_the_lookups():
    from cluster.engine.speculative.policy import worth_a_row

    cost = StepCost(fixed_s=0.005, per_row_s=0.001)
    assert worth_a_row(0.9, rows=1, cost=cost)  # 0.9 > 1/6
    assert not worth_a_row(0.8, rows=32, cost=cost)  # 0.8 < 32/37
    assert worth_a_row(0.9, rows=32, cost=cost)  # 0.9 > 32/37 = 0.865


def test_a_step_no_guess_could_pay_in_is_told_before_any_lookup():
    from cluster.engine.speculative.policy import GuessGate

    cost = StepCost(fixed_s=0.005, per_row_s=0.001)
    gate = GuessGate()
    # 32 decodes at odds 0.8 then 0.8, 8 guesses each: the plan of them all guesses nothing
    assert plan_guesses([0.8] * 32, [0.8] * 32, [8] * 32, rows=32, cost=cost) == [0] * 32
    assert not gate.open(32, 32, 0.8, 0.8, 8, cost)
    # 8 decodes at odds 0.9 then 0.9 would guess (two each, 22% more a ms): open
    assert gate.open(8, 8, 0.9, 0.9, 4, cost)
    # one decode at odds 0.1 (1.1 tokens in 7 ms against 1 in 6): closed; 0.3 then 0.95: open
    assert not gate.open(1, 1, 0.1, 0.8, 8, cost)
    assert gate.open(1, 1, 0.3, 0.95, 8, cost)


def test_the_gate_is_never_closed_where_the_plan_of_the_real_proposals_guesses():
    import random

    from cluster.engine.speculative.policy import GuessGate

    rng = random.Random(24)
    costs = [StepCost(0.005, 0.001), StepCost(0.006, 0.0008, {1: 0.006, 8: 0.012, 9: 0.02}), StepCost(0.004, 0.002)]
    closed = 0
    for trial in range(400):
        requests, cost = rng.randint(1, 12), costs[trial % len(costs)]
        first = [rng.random() for _ in range(requests)]
        then = [rng.random() for _ in range(requests)]
        available = [rng.randint(0, 8) for _ in range(requests)]
        rows = requests + rng.choice([0, 0, 3])
        gate_open = GuessGate().open(requests, rows, max(first), max(then), 8, cost)
        guessed = any(plan_guesses(first, then, available, rows, cost))
        assert gate_open or not guessed, (first, then, available, rows, cost)
        closed += not gate_open
    assert 0 < closed < 400  # both answers were tried


def test_the_gate_keeps_its_answer_until_the_question_or_the_cost_changes(monkeypatch):
    import cluster.engine.speculative.policy as policy

    planned = []
    real = policy.plan_guesses
    monkeypatch.setattr(policy, "plan_guesses", lambda *args: planned.append(args[3]) or real(*args))
    gate, cost = policy.GuessGate(), StepCost(0.005, 0.001)
    for _ in range(5):
        assert not gate.open(32, 32, 0.8, 0.8, 8, cost)
    assert planned == [32]  # planned once for five steps
    assert not gate.open(32, 32, 0.8001, 0.8, 8, cost)  # odds rounded up to 1/64: the same question
    assert planned == [32]
    assert not gate.open(32, 33, 0.8, 0.8, 8, cost)  # another width
    assert not gate.open(32, 33, 0.8, 0.8, 8, StepCost(0.005, 0.001))  # a cost fitted again
    assert planned == [32, 33, 33]
    assert gate.open(32, 33, 0.8, 0.8, 8, StepCost(0.05, 0.001))  # a step dear in its fixed part: guesses pay
