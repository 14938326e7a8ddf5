"""Where a draft's KV of a prompt is built (``speculative/prompt_kv.py``), with exact figures:
the decode worker's catch-up (a row of its draft's step per token) against the prefill worker's
draft per prompt token plus the draft's blocks over the measured transfer rate."""

import pytest

from cluster.engine.speculative.prompt_kv import DraftPromptCosts, build_on_prefill

# Powers of two: every sum below is exact in floats.
COSTS = DraftPromptCosts(catch_up_s_per_token=2**-10, prefill_s_per_token=2**-12, block_bytes=2**16,
                         transfer_bytes_per_s=2**26)


def test_auto_builds_on_the_prefill_worker_where_its_draft_and_the_transfer_cost_less_than_the_catch_up():
    # 64 tokens in 4 blocks: here 64 / 1024 = 1/16 s; there 64 / 4096 + 4 * 65536 / 2^26 = 1/64 + 1/256 s.
    assert build_on_prefill("auto", 64, 4, COSTS)
    # A transfer 16 times slower: there 1/64 + 1/16 s > 1/16 s.
    slow = DraftPromptCosts(2**-10, 2**-12, 2**16, 2**22)
    assert not build_on_prefill("auto", 64, 4, slow)
    # At equal cost the decode worker keeps it: 1/16 s here, 1/64 + 3 * 2^16 / 2^22 = 1/64 + 3/64 s there.
    tie = DraftPromptCosts(2**-10, 2**-12, 2**16, 2**22)
    assert 64 * 2**-12 + 3 * 2**16 / 2**22 == 64 * 2**-10
    assert not build_on_prefill("auto", 64, 3, tie)
    assert build_on_prefill("auto", 64, 2, tie)  # a block fewer to send: 1/64 + 2/64 s
    # A prefill worker whose draft is dearer per token than the catch-up never pays, whatever the transfer.
    assert not build_on_prefill("auto", 64, 0, DraftPromptCosts(2**-10, 2**-9, 2**16, 2**30))


def test_auto_sends_the_work_to_the_prefill_worker_until_both_costs_are_measured():
    assert build_on_prefill("auto", 10, 1, DraftPromptCosts(2**-10, None, 2**16, 2**26))
    assert build_on_prefill("auto", 10, 1, DraftPromptCosts(None, 2**-12, 2**16, 2**26))
    # No transfer measured yet: the blocks count as free.
    assert build_on_prefill("auto", 10, 1, DraftPromptCosts(2**-10, 2**-12, 2**16, None))


def test_fixed_places_and_nothing_to_build():
    assert build_on_prefill("prefill", 64, 4, DraftPromptCosts(2**-12, 2**-10, 2**16, 2**20))
    assert not build_on_prefill("decode", 64, 4, COSTS)
    assert not build_on_prefill("auto", 0, 0, COSTS)  # the decode worker's draft holds the whole prompt
    with pytest.raises(ValueError, match="draft_prompt_kv must be one of auto, decode, prefill, got 'both'"):
        build_on_prefill("both", 64, 4, COSTS)
