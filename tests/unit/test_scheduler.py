"""The scheduler driven directly, with fake tokens in place of a model.

``step`` does what the engine does in one step: schedule, let every request whose scheduled
tokens reach the end of its known tokens "sample" a deterministic token, then update. Block
size is 4 throughout, so block boundaries are easy to follow by hand.
"""

from __future__ import annotations

import random
from typing import Callable

import pytest

from cluster.engine.block_manager import BlockManager
from cluster.engine.request import FinishReason, Request, RequestStatus
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.engine.scheduler import Scheduler, SchedulerOutput

pytestmark = pytest.mark.unit

BS = 4
EOS = 2


def fake_token(request: Request) -> int:
    """A token that depends only on its position, so recomputation after preemption yields the
    same sequence; never EOS."""
    return 1000 + request.num_tokens


def make_scheduler(
    num_blocks: int = 16,
    budget: int = 16,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    chunked: bool = True,
    prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching), budget, max_num_seqs,
                     max_model_len, enable_chunked_prefill=chunked)


def req(rid: str, prompt: int | list[int], max_tokens: int = 16, priority: int = 0, **params) -> Request:
    """A request; an int prompt means that many distinct tokens (offset per id, so that two
    int prompts never share a prefix)."""
    if isinstance(prompt, int):
        base = 100 * (1 + sum(map(ord, rid)))
        prompt = list(range(base, base + prompt))
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset({EOS}), priority=priority)


def step(sched: Scheduler, tokens: dict[str, int] | None = None,
         token: Callable[[Request], int] = fake_token) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step. ``tokens`` overrides the sampled token for some request ids."""
    out = sched.schedule()
    sampled = {
        r.request_id: (tokens or {}).get(r.request_id, token(r))
        for r, n in out.scheduled()
        if r.num_computed_tokens + n == r.num_tokens
    }
    finished = sched.update(out, sampled)
    return out, finished


def shape(out: SchedulerOutput) -> tuple[list[str], list[tuple[str, int]]]:
    """(decode ids, [(prefill id, chunk size)]) of one step."""
    return [r.request_id for r in out.decodes], [(r.request_id, n) for r, n in out.prefills]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def run_until_done(sched: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    outs = []
    while sched.num_unfinished:
        assert len(outs) < max_steps, "scheduler made no progress"
        out, _ = step(sched)
        outs.append(out)
    return outs


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.blocks
    assert sched.num_unfinished == 0
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


# -- one request, start to end --------------------------------------------------------------


def test_single_request_prefill_then_decodes_to_max_tokens():
    s = make_scheduler(num_blocks=8)
    a = req("a", 6, max_tokens=3)
    s.add(a)
    assert (a.status, ids(s.waiting)) == (RequestStatus.WAITING, ["a"])

    out, finished = step(s)
    assert shape(out) == ([], [("a", 6)])
    assert (out.num_tokens, finished, out.preempted) == (6, [], [])
    assert a.status is RequestStatus.RUNNING
    assert (a.block_ids, a.num_computed_tokens, a.num_tokens) == ([0, 1], 6, 7)
    assert [s.blocks.ref_count(b) for b in range(3)] == [1, 1, 0]
    # Only the full block is cached.
    assert s.blocks.block_hash_of(0) == a.block_hashes[0]
    assert s.blocks.block_hash_of(1) is None

    out, finished = step(s)
    assert shape(out) == (["a"], [])
    assert (a.block_ids, a.num_computed_tokens, finished) == ([0, 1], 7, [])

    out, finished = step(s)
    assert shape(out) == (["a"], [])
    assert finished == [a]
    assert (a.status, a.finish_reason) == (RequestStatus.FINISHED, FinishReason.LENGTH)
    assert a.output_token_ids == [1006, 1007, 1008]
    assert a.block_ids == []
    # The second block became full (8 computed tokens) before the request finished: both stay
    # cached on the free list, tail block first in eviction order.
    assert s.blocks.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert s.blocks.block_hash_of(1) == a.block_hashes[1]
    assert s.schedule().is_empty
    assert_all_free(s)


def test_decode_takes_a_new_block_when_it_crosses_a_boundary():
    s = make_scheduler(num_blocks=4)
    a = req("a", 4, max_tokens=6)
    s.add(a)
    step(s)
    assert a.block_ids == [0]
    step(s)  # computes position 4
    assert a.block_ids == [0, 1]
    for _ in range(3):
        step(s)  # positions 5..7
    assert a.block_ids == [0, 1]
    out, finished = step(s)  # position 8
    assert (finished, a.finish_reason) == ([a], FinishReason.LENGTH)
    assert a.num_output_tokens == 6
    assert_all_free(s)


# -- token budget ---------------------------------------------------------------------------


def test_running_requests_go_first_then_chunks_of_new_prompts():
    s = make_scheduler(budget=8)
    a, b, c = req("a", 3, max_tokens=3), req("b", 10, max_tokens=2), req("c", 4, max_tokens=1)
    for r in (a, b, c):
        s.add(r)

    out, _ = step(s)
    assert shape(out) == ([], [("a", 3), ("b", 5)])
    assert (a.block_ids, b.block_ids, ids(s.waiting)) == ([0], [1, 2], ["c"])

    out, _ = step(s)
    assert shape(out) == (["a"], [("b", 5), ("c", 2)])
    assert out.num_tokens == 8
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0], [1, 2, 3], [4])

    out, finished = step(s)
    assert shape(out) == (["a", "b"], [("c", 2)])
    assert finished == [a, b, c]
    # a (position 4) was served first and took the next free block.
    assert [r.output_token_ids for r in (a, b, c)] == [[1003, 1004, 1005], [1010, 1011], [1004]]
    assert_all_free(s)


def test_budget_runs_out_on_decodes():
    s = make_scheduler(budget=2)
    for rid in "abc":
        s.add(req(rid, 1, max_tokens=3))
    out, _ = step(s)
    assert shape(out) == ([], [("a", 1), ("b", 1)])
    out, _ = step(s)
    assert shape(out) == (["a", "b"], [])
    assert ids(s.waiting) == ["c"]
    out, finished = step(s)
    assert shape(out) == (["a", "b"], [])
    assert ids(finished) == ["a", "b"]
    out, _ = step(s)
    assert shape(out) == ([], [("c", 1)])
    run_until_done(s)
    assert_all_free(s)


def test_long_prompt_is_split_across_steps_with_chunked_prefill():
    s = make_scheduler(budget=4)
    a = req("a", 10, max_tokens=2)
    s.add(a)

    out, _ = step(s)
    assert shape(out) == ([], [("a", 4)])
    assert (a.num_computed_tokens, a.num_tokens, a.block_ids) == (4, 10, [0])
    out, _ = step(s)
    assert shape(out) == ([], [("a", 4)])
    assert (a.num_computed_tokens, a.num_tokens, a.block_ids) == (8, 10, [0, 1])
    assert a.num_output_tokens == 0
    out, _ = step(s)
    assert shape(out) == ([], [("a", 2)])
    assert (a.num_computed_tokens, a.num_tokens, a.block_ids) == (10, 11, [0, 1, 2])
    assert a.output_token_ids == [1010]
    out, finished = step(s)
    assert shape(out) == (["a"], [])
    assert (finished, a.output_token_ids) == ([a], [1010, 1011])
    assert_all_free(s)


def test_without_chunked_prefill_a_long_prompt_runs_whole_and_alone():
    s = make_scheduler(budget=4, chunked=False)
    a, b, c = req("a", 2, max_tokens=2), req("b", 10, max_tokens=1), req("c", 2, max_tokens=1)
    for r in (a, b, c):
        s.add(r)

    out, _ = step(s)
    # b does not fit in the 2 tokens left and may not be chunked; c queues behind it.
    assert shape(out) == ([], [("a", 2)])
    assert ids(s.waiting) == ["b", "c"]
    out, finished = step(s)
    assert shape(out) == (["a"], [])
    assert finished == [a]
    out, finished = step(s)
    assert shape(out) == ([], [("b", 10)])
    assert out.num_tokens == 10
    assert (finished, b.block_ids) == ([b], [])
    out, finished = step(s)
    assert shape(out) == ([], [("c", 2)])
    assert_all_free(s)


def test_without_chunked_prefill_prompts_that_fit_share_a_step():
    s = make_scheduler(budget=8, chunked=False)
    for rid, n in (("a", 3), ("b", 5), ("c", 1)):
        s.add(req(rid, n, max_tokens=2))
    out, _ = step(s)
    assert shape(out) == ([], [("a", 3), ("b", 5)])
    out, _ = step(s)
    assert shape(out) == (["a", "b"], [("c", 1)])
    run_until_done(s)
    assert_all_free(s)


def test_with_chunked_prefill_the_same_prompt_is_chunked_instead():
    s = make_scheduler(budget=4, chunked=True)
    a, b = req("a", 2, max_tokens=2), req("b", 10, max_tokens=1)
    s.add(a)
    s.add(b)
    out, _ = step(s)
    assert shape(out) == ([], [("a", 2), ("b", 2)])
    out, _ = step(s)
    assert shape(out) == (["a"], [("b", 3)])
    out, _ = step(s)
    assert shape(out) == ([], [("b", 4)])
    out, finished = step(s)
    assert shape(out) == ([], [("b", 1)])
    assert finished == [b]
    assert_all_free(s)


# -- prefix hits ----------------------------------------------------------------------------


def test_prefix_hit_shares_the_first_full_blocks():
    s = make_scheduler(num_blocks=16)
    shared = list(range(10, 18))  # two full blocks
    a = req("a", shared + [20, 21], max_tokens=3)
    s.add(a)
    step(s)
    assert a.block_ids == [0, 1, 2]
    assert a.num_cached_tokens == 0

    b = req("b", shared + [30, 31, 32], max_tokens=2)
    s.add(b)
    out, _ = step(s)
    assert shape(out) == (["a"], [("b", 3)])
    assert b.block_ids == [0, 1, 3]
    assert b.block_hashes[:2] == a.block_hashes[:2]
    assert [s.blocks.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert b.num_cached_tokens == 2 * BS
    assert b.num_computed_tokens == 11

    out, finished = step(s)
    assert shape(out) == (["a", "b"], [])
    assert finished == [a, b]
    assert_all_free(s)


def test_prefix_hit_on_blocks_that_are_free_but_still_cached():
    s = make_scheduler(num_blocks=8)
    shared = list(range(10, 18))
    a = req("a", shared + [20], max_tokens=1)
    s.add(a)
    step(s)
    assert a.finished
    assert s.blocks.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]

    b = req("b", shared + [30, 31], max_tokens=1)
    s.add(b)
    s.blocks.drain_events()
    out = s.schedule()
    assert shape(out) == ([], [("b", 2)])
    assert b.block_ids == [0, 1, 3]
    assert [s.blocks.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    assert b.num_cached_tokens == 8
    assert s.blocks.free_block_ids() == [4, 5, 6, 7, 2]
    assert s.blocks.drain_events() == []  # taking back cached blocks evicts nothing
    s.update(out, {"b": 99})
    assert b.finished
    assert_all_free(s)


def test_prompt_of_exactly_n_full_blocks_recomputes_its_last_block():
    s = make_scheduler(num_blocks=8)
    prompt = list(range(10, 18))  # exactly 2 full blocks
    a = req("a", prompt, max_tokens=1)
    s.add(a)
    step(s)
    assert a.finished
    assert [s.blocks.block_hash_of(i) is not None for i in (0, 1)] == [True, True]

    b = req("b", prompt, max_tokens=1)
    s.add(b)
    out = s.schedule()
    # Only 1 of the 2 cached blocks is shared: the last token must be computed to sample. The
    # second block's first 3 tokens are a partial hit: copied into b's own block 2.
    assert shape(out) == ([], [("b", 1)])
    assert (b.num_cached_tokens, b.num_computed_tokens) == (7, 7)
    assert b.block_ids == [0, 2]
    assert out.block_copies == [(1, 2)]
    assert [s.blocks.ref_count(i) for i in range(3)] == [1, 1, 1]  # the copy's source held for the step
    assert s.update(out, {"b": 99}) == [b]
    assert_all_free(s)


def test_without_partial_hits_a_prompt_of_n_full_blocks_recomputes_its_last_block():
    s = make_scheduler(num_blocks=8)
    s.partial_hits = False
    prompt = list(range(10, 18))
    a = req("a", prompt, max_tokens=1)
    s.add(a)
    step(s)
    b = req("b", prompt, max_tokens=1)
    s.add(b)
    out = s.schedule()
    assert shape(out) == ([], [("b", 4)])
    assert (b.num_cached_tokens, b.num_computed_tokens, b.block_ids, out.block_copies) == (4, 4, [0, 2], [])
    assert s.update(out, {"b": 99}) == [b]
    assert_all_free(s)


def test_a_finished_requests_last_block_serves_a_prompt_that_begins_with_its_tokens():
    """A chat's next turn: the prompt is the last one and its answer and more. The last request's
    last block was not full, so not cached; it still offers the tokens whose KV it holds."""
    s = make_scheduler(num_blocks=8)
    a = req("a", [10, 11, 12, 13, 14], max_tokens=2)  # 5 prompt tokens + 2 out: KV for 6 when it ends
    s.add(a)
    run_until_done(s)
    assert a.output_token_ids == [1005, 1006] and a.num_computed_tokens == 6
    assert s.blocks.block_hash_of(1) is None  # block 1 holds tokens 4 and 5 only
    b = req("b", [10, 11, 12, 13, 14, 1005, 1006, 40, 41])
    s.add(b)
    out = s.schedule()
    # block 0 is a full hit; block 1's tokens 14 and 1005 are copied; 1006, 40, 41 are computed
    assert shape(out) == ([], [("b", 3)])
    assert (b.num_cached_tokens, b.block_ids, out.block_copies) == (6, [0, 2, 3], [(1, 2)])
    s.update(out, {"b": 99})
    s.abort("b")
    assert_all_free(s)


def test_a_partial_hit_keeps_to_its_tenant_and_its_parent():
    s = make_scheduler(num_blocks=8)
    a = Request("a", [10, 11, 12, 13, 14, 15], SamplingParams(max_tokens=1), cache_salt="t1")
    s.add(a)
    run_until_done(s)
    for other in (Request("b", [10, 11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=1), cache_salt="t2"),
                  Request("c", [99, 11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=1), cache_salt="t1")):
        s.add(other)
        out = s.schedule()
        assert (out.block_copies, other.num_cached_tokens) == ([], 0)
        s.update(out, {other.request_id: 99})
        s.abort(other.request_id)
    d = Request("d", [10, 11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=1), cache_salt="t1")
    s.add(d)
    out = s.schedule()
    assert (d.num_cached_tokens, len(out.block_copies)) == (6, 1)
    s.update(out, {"d": 99})
    s.abort("d")
    assert_all_free(s)


def test_a_reallocated_block_serves_no_partial_hit():
    s = make_scheduler(num_blocks=4)
    a = req("a", [10, 11, 12, 13, 14], max_tokens=1)
    s.add(a)
    run_until_done(s)
    s.blocks.allocate(4)  # every block taken (the kept last block among them): its KV is gone
    s.blocks.free(list(range(4)))
    b = req("b", [10, 11, 12, 13, 14, 1005, 7], max_tokens=1)
    s.add(b)
    out = s.schedule()
    assert (out.block_copies, b.num_cached_tokens) == ([], 0)


def test_prompt_one_token_past_a_cached_prefix_is_a_prefill_chunk():
    s = make_scheduler(num_blocks=8)
    shared = list(range(10, 18))
    a = req("a", shared + [20], max_tokens=2)
    s.add(a)
    step(s)
    b = req("b", shared + [30], max_tokens=2)
    s.add(b)
    out, _ = step(s)
    # b's prompt still lacks KV for one token: that is its (only) prompt chunk, not a decode.
    assert shape(out) == (["a"], [("b", 1)])
    assert (b.num_cached_tokens, b.block_ids[:2]) == (8, [0, 1])
    out, _ = step(s)
    assert shape(out) == (["b"], [])
    assert_all_free(s)


def test_one_token_prompt_is_a_prefill_chunk():
    s = make_scheduler()
    a = req("a", 1, max_tokens=2)
    s.add(a)
    out, _ = step(s)
    assert shape(out) == ([], [("a", 1)])
    out, _ = step(s)
    assert shape(out) == (["a"], [])
    assert_all_free(s)


def test_no_prefix_hit_without_prefix_caching():
    s = make_scheduler(prefix_caching=False)
    shared = list(range(10, 18))
    a = req("a", shared + [20], max_tokens=3)
    s.add(a)
    step(s)
    b = req("b", shared + [30], max_tokens=1)
    s.add(b)
    out = s.schedule()
    assert shape(out) == (["a"], [("b", 9)])
    assert (b.num_cached_tokens, b.block_ids) == (0, [3, 4, 5])
    assert s.blocks.block_hash_of(0) is None
    s.update(out, {"a": 99, "b": 99})
    run_until_done(s)
    assert_all_free(s)


def test_cache_salt_separates_prefixes():
    s = make_scheduler()
    shared = list(range(10, 18))
    a = Request("a", shared + [1], SamplingParams(max_tokens=3), cache_salt="tenant-1")
    b = Request("b", shared + [2], SamplingParams(max_tokens=1), cache_salt="tenant-2")
    c = Request("c", shared + [3], SamplingParams(max_tokens=1), cache_salt="tenant-1")
    s.add(a)
    step(s)
    s.add(b)
    s.add(c)
    out = s.schedule()
    assert shape(out) == (["a"], [("b", 9), ("c", 1)])
    assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 8)
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1, 2], [3, 4, 5], [0, 1, 6])
    s.update(out, {"a": 99, "b": 99, "c": 99})
    run_until_done(s)
    assert_all_free(s)


# -- priorities -----------------------------------------------------------------------------


def test_admission_by_priority_then_arrival():
    s = make_scheduler(max_num_seqs=1)
    for rid, priority in (("low", 0), ("mid1", 1), ("high", 5), ("mid2", 1), ("low2", 0)):
        s.add(req(rid, 3, max_tokens=1, priority=priority))
    assert ids(s.waiting) == ["high", "mid1", "mid2", "low", "low2"]
    order = []
    for _ in range(5):
        out, finished = step(s)
        assert len(out.prefills) == 1 and out.decodes == []
        order += ids(finished)
    assert order == ["high", "mid1", "mid2", "low", "low2"]
    assert_all_free(s)


def test_admission_order_within_one_step_follows_priority():
    s = make_scheduler(budget=5)
    s.add(req("a", 2, max_tokens=1))
    s.add(req("b", 2, max_tokens=1, priority=2))
    s.add(req("c", 2, max_tokens=1, priority=1))
    out, _ = step(s)
    assert shape(out) == ([], [("b", 2), ("c", 2), ("a", 1)])
    run_until_done(s)
    assert_all_free(s)


# -- preemption -----------------------------------------------------------------------------


def test_preemption_takes_the_latest_running_request_and_recomputes_it():
    s = make_scheduler(num_blocks=4, budget=16)
    a, b = req("a", 4, max_tokens=8), req("b", 4, max_tokens=8)
    s.add(a)
    s.add(b)
    out, _ = step(s)
    assert shape(out) == ([], [("a", 4), ("b", 4)])
    assert (a.block_ids, b.block_ids) == ([0], [1])
    for _ in range(4):  # positions 4..7
        out, _ = step(s)
        assert shape(out) == (["a", "b"], []) and out.preempted == []
    assert (a.block_ids, b.block_ids, s.blocks.num_free_blocks) == ([0, 2], [1, 3], 0)

    # Position 8 needs a third block each; none is free, so b (the later one) goes.
    out, _ = step(s)
    assert shape(out) == (["a"], [])
    assert out.preempted == [b]
    assert (b.status, b.block_ids, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.WAITING, [], 0, 1)
    assert (ids(s.running), ids(s.waiting)) == (["a"], ["b"])
    assert b.num_tokens == 9  # prompt and 5 outputs, kept for recomputation
    assert a.block_ids == [0, 2, 3]
    assert [s.blocks.ref_count(i) for i in range(4)] == [1, 0, 1, 1]
    assert s.blocks.free_block_ids() == [1]

    # b's first block is still cached but a new chunk needs 2 more blocks: b waits.
    out, _ = step(s)
    assert (shape(out), out.preempted) == ((["a"], []), [])
    out, finished = step(s)
    assert (shape(out), finished) == ((["a"], []), [a])
    assert a.num_output_tokens == 8

    out, _ = step(s)
    assert shape(out) == ([], [("b", 5)])  # block 0 of b came back from the cache
    assert b.block_ids[0] == 1
    assert (b.status, b.num_computed_tokens, b.num_cached_tokens) == (RequestStatus.RUNNING, 9, 0)
    _, finished = step(s)
    _, finished = step(s)
    assert finished == [b]
    assert b.finish_reason is FinishReason.LENGTH
    assert b.output_token_ids == [1004 + i for i in range(8)]
    assert a.output_token_ids == b.output_token_ids
    assert_all_free(s)


def test_preemption_victim_is_the_lowest_priority_even_if_older():
    s = make_scheduler(num_blocks=4)
    low, high = req("low", 4, max_tokens=8), req("high", 4, max_tokens=8, priority=1)
    s.add(low)
    s.add(high)
    out, _ = step(s)
    assert shape(out) == ([], [("high", 4), ("low", 4)])
    for _ in range(4):
        step(s)
    out, _ = step(s)
    assert out.preempted == [low]
    assert shape(out) == (["high"], [])
    assert (ids(s.running), ids(s.waiting), low.block_ids) == (["high"], ["low"], [])
    run_until_done(s)
    assert (high.num_output_tokens, low.num_output_tokens) == (8, 8)
    assert (high.finish_reason, low.finish_reason) == (FinishReason.LENGTH, FinishReason.LENGTH)
    assert_all_free(s)


def test_last_request_preempts_itself_rather_than_an_earlier_one():
    s = make_scheduler(num_blocks=4)
    a, b = req("a", 5, max_tokens=6), req("b", 7, max_tokens=6)
    s.add(a)
    s.add(b)
    step(s)
    assert (a.block_ids, b.block_ids, s.blocks.num_free_blocks) == ([0, 1], [2, 3], 0)
    step(s)  # a computes position 5, b position 7: both fit
    out, _ = step(s)  # b needs a third block for position 8, a does not need one
    assert shape(out) == (["a"], [])
    assert out.preempted == [b]
    assert (a.block_ids, b.block_ids) == ([0, 1], [])
    run_until_done(s)
    assert (a.num_output_tokens, b.num_output_tokens) == (6, 6)
    assert_all_free(s)


def test_preemption_frees_shared_blocks_by_one_reference():
    s = make_scheduler(num_blocks=5, budget=16)
    shared = list(range(10, 18))
    a = req("a", shared + [1], max_tokens=8)
    s.add(a)
    step(s)
    b = req("b", shared + [2], max_tokens=8)
    s.add(b)
    step(s)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [0, 1, 3])
    assert s.blocks.num_free_blocks == 1
    for _ in range(2):  # positions 10, 11 for a; 9, 10 for b
        out, _ = step(s)
        assert out.preempted == []
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [0, 1, 3])
    out, _ = step(s)  # a needs a fourth block (position 12) and takes the last free one
    assert out.preempted == []
    assert (a.block_ids, s.blocks.num_free_blocks) == ([0, 1, 2, 4], 0)
    out, _ = step(s)  # b needs a fourth block (position 12): none left, b preempts itself
    assert out.preempted == [b]
    assert shape(out) == (["a"], [])
    assert [s.blocks.ref_count(i) for i in range(5)] == [1, 1, 1, 0, 1]
    run_until_done(s)
    assert (a.num_output_tokens, b.num_output_tokens) == (8, 8)
    assert_all_free(s)


# -- cancellation ---------------------------------------------------------------------------


def test_abort_running_and_waiting_requests_frees_blocks_at_once():
    s = make_scheduler(num_blocks=6, budget=4)
    a, b, c = req("a", 10, max_tokens=4), req("b", 4, max_tokens=4), req("c", 4, max_tokens=4)
    for r in (a, b, c):
        s.add(r)
    step(s)
    step(s)
    assert (ids(s.running), ids(s.waiting), a.block_ids) == (["a"], ["b", "c"], [0, 1])

    assert s.abort("a") is a
    assert (a.status, a.finish_reason, a.block_ids) == (RequestStatus.FINISHED, FinishReason.ABORT, [])
    assert s.blocks.num_free_blocks == 6
    assert s.abort("c") is c
    assert (c.finish_reason, ids(s.waiting), s.running) == (FinishReason.ABORT, ["b"], [])
    assert s.abort("c") is None
    assert s.abort("nope") is None

    out, _ = step(s)
    assert shape(out) == ([], [("b", 4)])
    assert s.abort("b") is b
    assert s.blocks.num_free_blocks == 6
    assert s.schedule().is_empty
    assert_all_free(s)


def test_abort_one_of_two_sharers_keeps_the_other_ref():
    s = make_scheduler(num_blocks=8)
    shared = list(range(10, 18))
    a = req("a", shared + [1], max_tokens=4)
    s.add(a)
    step(s)
    b = req("b", shared + [2], max_tokens=4)
    s.add(b)
    step(s)
    assert [s.blocks.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    s.abort("a")
    assert [s.blocks.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    assert s.blocks.num_free_blocks == 5
    run_until_done(s)
    assert b.num_output_tokens == 4
    assert_all_free(s)


def test_aborted_preempted_request_leaves_waiting():
    s = make_scheduler(num_blocks=4)
    a, b = req("a", 4, max_tokens=8), req("b", 4, max_tokens=8)
    s.add(a)
    s.add(b)
    for _ in range(6):
        out, _ = step(s)
    assert out.preempted == [b]
    s.abort("b")
    assert (s.waiting, b.finish_reason) == ([], FinishReason.ABORT)
    run_until_done(s)
    assert_all_free(s)


# -- refusals -------------------------------------------------------------------------------


def test_check_refuses_requests_that_could_never_run():
    s = make_scheduler(num_blocks=4, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        s.add(req("empty", []))
    with pytest.raises(InvalidRequestError, match="prompt has 32 tokens but the model's context is 32 tokens"):
        s.add(req("long", 32, max_tokens=1))
    with pytest.raises(InvalidRequestError, match="prompt has 40 tokens"):
        s.add(req("longer", 40, max_tokens=1))
    with pytest.raises(InvalidRequestError, match=r"needs 5 KV blocks but the cache has 4.*lower max_tokens"):
        s.add(req("big", 10, max_tokens=10))
    assert (s.waiting, s.requests) == ([], {})

    # The context cap bounds what a request can need: 31 + anything fits in 32 tokens = 8 blocks.
    roomy = make_scheduler(num_blocks=8, max_model_len=32)
    roomy.add(req("capped", 31, max_tokens=1000))
    # Exactly the cache's size is fine.
    s.add(req("fits", 10, max_tokens=6))
    assert ids(s.waiting) == ["fits"]


def test_check_refuses_a_duplicate_id_while_it_is_in_use():
    s = make_scheduler()
    s.add(req("a", 3, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request id 'a' is already in use"):
        s.add(req("a", 5))
    step(s)  # running now
    with pytest.raises(InvalidRequestError, match="already in use"):
        s.check(req("a", 5))
    run_until_done(s)
    s.add(req("a", 5, max_tokens=1))  # free again once finished
    run_until_done(s)
    assert_all_free(s)


# -- finish reasons -------------------------------------------------------------------------


def test_eos_stops_unless_ignore_eos():
    s = make_scheduler()
    a = req("a", 3, max_tokens=10)
    b = req("b", 3, max_tokens=3, ignore_eos=True)
    s.add(a)
    s.add(b)
    step(s)
    _, finished = step(s, tokens={"a": EOS, "b": EOS})
    assert finished == [a]
    assert (a.finish_reason, a.output_token_ids) == (FinishReason.STOP, [1003, EOS])
    _, finished = step(s, tokens={"b": EOS})
    assert finished == [b]
    assert (b.finish_reason, b.output_token_ids) == (FinishReason.LENGTH, [1003, EOS, EOS])
    assert_all_free(s)


def test_stop_token_ids_stop_even_with_ignore_eos():
    s = make_scheduler()
    a = req("a", 3, max_tokens=10, ignore_eos=True, stop_token_ids=[7, 8])
    s.add(a)
    _, finished = step(s, tokens={"a": 8})
    assert finished == [a]
    assert (a.finish_reason, a.output_token_ids) == (FinishReason.STOP, [8])
    assert_all_free(s)


def test_max_model_len_ends_with_length():
    s = make_scheduler(max_model_len=8)
    a = req("a", 6, max_tokens=10)
    s.add(a)
    _, finished = step(s)
    assert finished == []
    _, finished = step(s)
    assert finished == [a]
    assert (a.finish_reason, a.num_tokens, a.num_output_tokens) == (FinishReason.LENGTH, 8, 2)
    assert_all_free(s)


def test_max_tokens_one_finishes_on_the_prefill_step():
    s = make_scheduler()
    a = req("a", 5, max_tokens=1)
    s.add(a)
    out, finished = step(s)
    assert (shape(out), finished, a.finish_reason) == (([], [("a", 5)]), [a], FinishReason.LENGTH)
    assert_all_free(s)


# -- max_num_seqs ---------------------------------------------------------------------------


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2, budget=32)
    for rid, max_tokens in (("a", 2), ("b", 4), ("c", 2)):
        s.add(req(rid, 2, max_tokens=max_tokens))
    out, _ = step(s)
    assert shape(out) == ([], [("a", 2), ("b", 2)])
    assert (ids(s.running), ids(s.waiting)) == (["a", "b"], ["c"])
    out, finished = step(s)
    assert shape(out) == (["a", "b"], [])
    assert ids(finished) == ["a"]
    out, _ = step(s)
    assert shape(out) == (["b"], [("c", 2)])
    assert len(s.running) == 2
    run_until_done(s)
    assert_all_free(s)


# -- many requests, with a fake KV cache checking every block's content --------------------


def _check_kv(sched: Scheduler, out: SchedulerOutput, kv: dict[int, int]) -> None:
    """Writes the scheduled tokens into a fake KV cache (slot -> token id) as the model would,
    then checks every request's view of its context through its block table."""
    bm = sched.blocks
    for source, destination in out.block_copies:  # partial hits: the step copies these blocks first
        assert bm.ref_count(source) >= 1 and bm.ref_count(destination) == 1
        for offset in range(BS):
            kv[destination * BS + offset] = kv.get(source * BS + offset)
    for r, n in out.scheduled():
        assert len(r.block_ids) == -(-(r.num_computed_tokens + n) // BS)
        for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
            block = r.block_ids[p // BS]
            assert bm.ref_count(block) == 1, "writing into a shared block"
            kv[block * BS + p % BS] = r.token_ids[p]
    for r, n in out.scheduled():
        for p in range(r.num_computed_tokens + n):
            assert kv.get(r.block_ids[p // BS] * BS + p % BS) == r.token_ids[p], (r.request_id, p)


def _check_refs(sched: Scheduler) -> None:
    bm = sched.blocks
    holders = [0] * bm.num_blocks
    for r in sched.running:
        assert len(r.block_ids) == len(set(r.block_ids))
        for b in r.block_ids:
            holders[b] += 1
    for r in sched.waiting:
        assert r.block_ids == []
    assert holders == [bm.ref_count(b) for b in range(bm.num_blocks)]
    assert bm.num_free_blocks == holders.count(0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workload_keeps_the_books(seed, chunked, prefix_caching):
    rng = random.Random(seed)
    budget, max_num_seqs, max_model_len = 12, 4, 40
    s = make_scheduler(num_blocks=10, budget=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       chunked=chunked, prefix_caching=prefix_caching)
    prefixes = [[rng.randrange(10, 50) for _ in range(8)] for _ in range(3)]
    kv: dict[int, int] = {}
    expected: dict[str, int] = {}
    all_requests: list[Request] = []
    aborted: set[str] = set()
    preemptions = copies = 0
    for i in range(40 * 10):
        if i < 200 and rng.random() < 0.3:
            n = rng.randrange(1, 20)
            prompt = (rng.choice(prefixes) + [rng.randrange(10, 50) for _ in range(n)])[: rng.randrange(1, 26)]
            r = req(f"r{i}", prompt, max_tokens=rng.randrange(1, 12), priority=rng.randrange(3))
            s.add(r)
            all_requests.append(r)
            expected[r.request_id] = min(r.params.max_tokens, max_model_len - len(prompt))
        if s.num_unfinished and rng.random() < 0.03:
            victim = rng.choice(s.running + s.waiting)
            s.abort(victim.request_id)
            aborted.add(victim.request_id)
            _check_refs(s)
        out = s.schedule()
        preemptions += len(out.preempted)
        copies += len(out.block_copies)
        if chunked:
            assert out.num_tokens <= budget
        elif out.num_tokens > budget:  # a prompt too long for the budget runs whole and alone
            assert out.decodes == [] and len(out.prefills) == 1
        assert all(r.num_output_tokens > 0 for r in out.decodes)
        assert len(s.running) <= max_num_seqs
        assert {r.request_id for r in out.decodes}.isdisjoint(r.request_id for r, _ in out.prefills)
        _check_kv(s, out, kv)
        sampled = {r.request_id: fake_token(r) for r, n in out.scheduled()
                   if r.num_computed_tokens + n == r.num_tokens}
        s.update(out, sampled)
        _check_refs(s)
        if i >= 200 and not s.num_unfinished:
            break
    assert_all_free(s)
    for r in all_requests:
        assert r.finished
        if r.request_id in aborted:
            assert r.finish_reason is FinishReason.ABORT
        else:
            assert r.finish_reason is FinishReason.LENGTH
            assert r.num_output_tokens == expected[r.request_id]
            assert r.output_token_ids == [1000 + r.num_prompt_tokens + k for k in range(r.num_output_tokens)]
    assert preemptions > 0  # the small cache does force preemption
    assert aborted
    if prefix_caching:
        assert any(r.num_cached_tokens for r in all_requests)
        assert copies  # partial hits, their copies checked through every block table (_check_kv)


# -- decode side of disaggregation ---------------------------------------------------------


def test_transferred_prompt_holds_blocks_then_joins_as_a_decode():
    sched = make_scheduler(num_blocks=8)
    r = req("t", 10, max_tokens=3)
    assert sched.reserve_for_transfer(r) == 0
    assert r.block_ids == [0, 1, 2] and r.status is RequestStatus.RECEIVING
    assert sched.blocks.num_free_blocks == 5
    assert shape(sched.schedule()) == ([], [])  # nothing to run while the KV is on its way
    sched.admit_transferred("t", 1234)
    assert r.num_computed_tokens == 10 and r.token_ids[-1] == 1234
    assert [sched.blocks.block_hash_of(b) is not None for b in r.block_ids] == [True, True, False]
    out, _ = step(sched)
    assert shape(out) == (["t"], [])
    step(sched)
    assert r.finished and r.num_output_tokens == 3
    assert sched.blocks.num_free_blocks == 8


def test_second_turn_receives_only_the_blocks_it_lacks():
    sched = make_scheduler(num_blocks=12)
    first = req("turn1", 9, max_tokens=1)
    assert sched.reserve_for_transfer(first) == 0
    sched.admit_transferred("turn1", 7)  # max_tokens=1: done at once; its full blocks stay cached
    assert first.finished and sched.blocks.num_free_blocks == 12
    second = req("turn2", first.prompt_token_ids[:8] + [5, 6, 7, 8, 9], max_tokens=4)
    assert sched.reserve_for_transfer(second) == 2  # two full blocks of the first turn are here
    assert second.num_cached_tokens == 8 and len(second.block_ids) == 4


def test_abort_while_receiving_frees_the_blocks():
    sched = make_scheduler(num_blocks=4)
    r = req("a", 12, max_tokens=4)
    assert sched.reserve_for_transfer(r) == 0
    assert sched.reserve_for_transfer(req("b", 8, max_tokens=4)) is None  # no room: the caller retries or refuses
    assert sched.num_unfinished == 1
    sched.abort("a")
    assert r.finish_reason is FinishReason.ABORT and sched.blocks.num_free_blocks == 4
    assert sched.num_unfinished == 0 and not sched.receiving
