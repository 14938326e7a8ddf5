"""The router's placement stages one by one: each filter, the local-or-remote prefill decision,
the candidates' predictions and the picker (tests/unit/test_router.py routes through them all)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.registry.kv_index import TierHits
from cluster.registry.load import StepSample, WorkerLoad
from router.candidates import (MIN_TTFT_S, Candidate, Prompt, corrected, decode_side, local_candidate, prefill_side,
                               remote_candidates)
from router.config import SCORERS, RouterConfig, SloClass
from router.cost_model import StepTimeModel
from router.filters import (LivePools, cut_off, first_in_line, has_room, not_failed, paired_prefill, reporting,
                            soonest_prefill)
from router.picker import explain, fastest, first_meeting, meets, never_meets, rank, with_room
from router.prefill_choice import mostly_cached, prefills_itself
from router.scorers import SCORER_FUNCTIONS

pytestmark = pytest.mark.unit

BS = 4
# prefill step = 10 ms + 1 ms per token; decode step = 20 ms + 5 ms per sequence + 0.1 ms per context token
MODEL = StepTimeModel(prefill=(0.010, 0.001, 0.0), decode=(0.020, 0.005, 0.0001), transfer_s_per_block=0.002,
                      max_num_batched_tokens=2048)
INTERACTIVE = SloClass("interactive", ttft_s=1.0, tpot_s=0.1, on_overload="reject")


def load(worker: str, running: int = 0, waiting: int = 0, free: int = 100, max_num_seqs: int = 4,
         next_slot: int = 0, unpaired: tuple[str, ...] = ()) -> WorkerLoad:
    return WorkerLoad(worker, "decode", waiting, running, 0, 0, 0, free, 100, BS, 2048, max_num_seqs, (), 0.0,
                      next_slot, unpaired)


def candidate(prefill: str | None, decode: str, ttft: float, tpot: float = 0.05, room: bool = True,
              **kw) -> Candidate:
    return Candidate(prefill, decode, 0, 0, 8, 0, 0.0, ttft_s=ttft, tpot_s=tpot, idle_ttft_s=ttft, idle_tpot_s=tpot,
                     decode_has_room=room, **kw)


# -- filters ---------------------------------------------------------------------------------

def test_live_workers_report_their_load_and_have_not_failed_in_pool_order():
    loads = {w: load(w) for w in ("p1", "p0", "d0", "d1", "c0")}
    assert reporting(["p0", "p1", "p2"], loads) == ["p0", "p1"]
    assert not_failed(["p0", "p1", "p2"], {"p1"}) == ["p0", "p2"]
    live = LivePools.of(("p0", "p1", "p2"), ("d0", "d1"), ("c0",), loads, {"d0"})
    assert (live.prefill, live.decode, live.colocated) == (["p0", "p1"], ["d1"], ["c0"])
    assert live.generating == ["d1", "c0"] and live.everyone == ["p0", "p1", "d1", "c0"]


def test_pairs_are_cut_off_where_unpaired_or_avoided_among_the_live_prefill_workers():
    d0 = load("d0", unpaired=("p0", "p9"))
    live = {"p0": None, "p1": None, "p2": None}
    assert cut_off("d0", d0, (), live) == {"p0"}  # p9 is not live
    assert cut_off("d0", d0, (("p1", "d0"), ("p2", "d1")), live) == {"p0", "p1"}  # p2 is avoided with d1 only


def test_the_shortlist_and_its_fallback_when_all_of_it_is_cut_off():
    side = {"p0": (None, TierHits(0), 0.300, 0.043), "p1": (None, TierHits(0), 0.000, 0.043),
            "p2": (None, TierHits(8), 0.000, 0.011)}
    pool = ["p0", "p1", "p2"]
    assert soonest_prefill(pool, side, 1) == ["p2"]
    assert paired_prefill(["p2"], pool, set(), side, 1) == ["p2"]
    assert paired_prefill(["p2"], pool, {"p2"}, side, 1) == ["p1"]  # the soonest of those not cut off
    assert paired_prefill(["p2"], pool, {"p0", "p1", "p2"}, side, 1) == []


def test_room_is_blocks_and_a_slot_or_the_first_place_in_line_for_a_class_that_may_not_wait():
    assert first_in_line(5, 4, "reject") and not first_in_line(5, 4, "queue") and not first_in_line(6, 4, "reject")
    assert has_room(10, 10, 4, 4, False) and not has_room(9, 10, 4, 4, False)
    assert not has_room(10, 10, 5, 4, False) and has_room(10, 10, 5, 4, True)
    full, free = candidate("p0", "d0", 0.1, room=False), candidate("p0", "d1", 0.2)
    assert with_room([full, free]) == [free] and with_room([full]) == []


# -- the local-or-remote prefill decision ------------------------------------------------------

def test_a_worker_prefills_itself_when_colocated_mostly_cached_short_or_without_a_pair():
    config = RouterConfig(skip_prefill_fraction=0.9, local_prefill_max_tokens=16)

    def local(colocated=False, hit=0, cacheable=10, uncached=100, cut=False):
        return prefills_itself(colocated=colocated, hit_blocks=hit, cacheable_blocks=cacheable,
                               uncached_tokens=uncached, every_pair_cut_off=cut, config=config)

    assert not local()
    assert local(colocated=True)
    assert local(hit=9) and not local(hit=8)  # 9 of 10 blocks: at least 0.9 of them
    assert local(uncached=16) and not local(uncached=17)
    assert local(cut=True)
    assert not mostly_cached(0, 0, 0.0)  # a prompt with no cacheable block is never mostly cached


# -- candidates and their predictions -----------------------------------------------------------

def test_the_prompt_in_blocks():
    prompt = Prompt.of(33, 8, BS)
    assert (prompt.cacheable_blocks, prompt.blocks) == (8, 9)
    hits = {"p0": TierHits(12), "d0": TierHits(3), "h0": TierHits(5, 7)}
    assert prompt.hit_blocks(hits, "p0") == TierHits(8) and prompt.hit_blocks({}, "p0") == TierHits(0)
    assert prompt.hit_blocks(hits, "h0") == TierHits(5, 3)  # the host run clipped to the cacheable blocks
    assert prompt.uncached_tokens(2) == 25


def test_each_side_is_predicted_once_per_worker():
    prompt = Prompt.of(33, 8, BS)
    p = prefill_side(MODEL, 100, TierHits(2), prompt)
    assert p.hit_blocks == TierHits(2)
    assert (p.queue_s, p.prefill_s) == pytest.approx((0.010 + 0.100, 0.010 + 0.025))
    d = decode_side(load("d0", running=2, waiting=1, free=20, next_slot=0), MODEL, [10], TierHits(1), prompt, "queue")
    sequences, context = 2 + 1 + 1 + 1, 10 + 33  # running, waiting, one placed since its report, this one
    assert d.tpot_s == pytest.approx(0.020 + 0.005 * sequences + 0.0001 * context)
    assert d.idle_tpot_s == pytest.approx(0.020 + 0.005 + 0.0001 * 33)
    assert d.load == pytest.approx(sequences / 4 + 1 - (20 - 3) / 100)
    assert (d.has_room, d.slot_wait_s, d.reserve_wait_s) == (False, 0.0, d.tpot_s)  # 5 sequences, 4 slots
    first = decode_side(load("d0", running=3, free=20, next_slot=7), MODEL, [10], TierHits(1), prompt, "reject")
    assert first.has_room and first.slot_wait_s == pytest.approx(7 * first.tpot_s)


def test_a_remote_pair_adds_queue_prefill_transfer_and_the_wait_for_the_step_in_progress():
    prompt = Prompt.of(33, 8, BS)
    p = prefill_side(MODEL, 0, TierHits(0), prompt)
    d = decode_side(load("d0", running=1), MODEL, [], TierHits(2), prompt, "queue")
    sides, queued = {"p0": p, "p1": p}, {"p0": 0, "p1": 0}
    c, other = remote_candidates("d0", d, ["p0", "p1"], sides, queued, prompt, 0.0, rotation_prefill="p0")
    transfer = 0.002 * (9 - 2)
    assert (c.prefill, c.decode, c.prefill_hit_blocks, c.decode_hit_blocks, c.rotation_slot) == ("p0", "d0", 0, 2, True)
    assert (other.prefill, other.rotation_slot) == ("p1", False)
    assert c.transfer_s == pytest.approx(transfer)
    assert c.ttft_s == pytest.approx(0.043 + transfer + d.tpot_s)
    assert c.idle_ttft_s == pytest.approx(0.043 + transfer)
    [less] = remote_candidates("d0", d, ["p0"], sides, queued, prompt, -1.0, rotation_prefill=None)
    assert less.ttft_s == pytest.approx(c.ttft_s / 2) and not less.rotation_slot
    [hop] = remote_candidates("d0", d._replace(call_s=0.003), ["p0"], sides, queued, prompt, 0.0, None)
    assert (hop.call_s, hop.ttft_s, hop.idle_ttft_s) == pytest.approx((0.003, c.ttft_s + 0.003, c.idle_ttft_s + 0.003))


def test_a_prefill_workers_draft_work_is_fitted_apart_and_counted_by_the_decode_workers_share_asking_for_it():
    """Steps whose draft model built prompts' draft KV report its seconds apart: the prefill line
    is fitted without them (10 ms + 1 ms a token) and the draft costs 0.25 ms a token fed; a
    decode worker that asks for the draft's KV in half its remote prefills gets half of that
    added to a pair's prefill: 25 uncached tokens (2 blocks of 4 cached of 33) -> 3.125 ms."""
    steps = [StepSample(n, 0, 0, 0, 0.010 + 0.001 * n + 0.00025 * d, draft_tokens=d, draft_s=0.00025 * d)
             for n, d in ((8, 8), (16, 0), (32, 32), (64, 64), (128, 0))]
    model = StepTimeModel.fit(steps, 2048)
    assert model.prefill == pytest.approx((0.010, 0.001, 0.0))
    assert model.draft_s_per_token == pytest.approx(0.00025)
    prompt = Prompt.of(33, 8, BS)
    p = prefill_side(model, 0, TierHits(2), prompt)
    assert p.draft_s == pytest.approx(0.00025 * 25)
    d = decode_side(replace(load("d0"), draft_prompt_share=0.5), MODEL, [], TierHits(0), prompt, "queue")
    [c] = remote_candidates("d0", d, ["p0"], {"p0": p}, {"p0": 0}, prompt, 0.0, None)
    assert c.prefill_s == pytest.approx(p.prefill_s + 0.5 * 0.00025 * 25)
    [without] = remote_candidates("d0", d._replace(draft_prompt_share=0.0), ["p0"], {"p0": p}, {"p0": 0}, prompt,
                                  0.0, None)
    assert without.prefill_s == pytest.approx(p.prefill_s) and c.ttft_s - without.ttft_s == pytest.approx(0.003125)


def test_a_local_prefill_waits_for_the_step_in_progress_then_prefills_what_is_not_cached():
    prompt = Prompt.of(33, 8, BS)
    d = decode_side(load("d0", running=1), MODEL, [], TierHits(8), prompt, "queue")
    c = local_candidate("d0", d, 0, prompt, 0.25, rotation_slot=False)
    assert (c.prefill, c.prefill_hit_blocks, c.decode_hit_blocks, c.label) == (None, 8, 8, "(local prefill) -> d0")
    assert c.prefill_s == pytest.approx(0.010 + 0.001 + d.tpot_s)
    assert c.ttft_s == pytest.approx(c.queue_s + c.prefill_s + 0.25)
    assert c.idle_ttft_s == pytest.approx(0.011 + 0.25)


def test_a_prefix_costs_nothing_on_the_device_its_loads_in_the_host_tier_and_its_compute_elsewhere():
    """33 tokens, 8 cacheable blocks of 4; prefill 10 ms + 1 ms a token; loads 3 ms a block (the
    stated default until a worker measures one)."""
    assert MODEL.host_load_s_per_block == 0.003
    options = {"device": TierHits(8), "host": TierHits(0, 8), "mixed": TierHits(3, 5), "recompute": TierHits(0)}
    seconds = {name: MODEL.tiered_prefill_seconds(33, BS, hits) for name, hits in options.items()}
    assert seconds == pytest.approx({"device": 0.010 + 0.001, "host": 8 * 0.003 + 0.011,
                                     "mixed": 5 * 0.003 + 0.011, "recompute": 0.010 + 0.033})
    # A host block saves its recompute less its load: 8 blocks recompute in 32 ms and load in 24 ms.
    assert MODEL.host_block_worth(33, BS, TierHits(0, 8)) == pytest.approx(1 - 0.024 / 0.032)
    assert MODEL.host_block_worth(33, BS, TierHits(3, 5)) == pytest.approx(1 - 0.015 / 0.020)
    assert MODEL.host_block_worth(33, BS, TierHits(8)) == 0.0
    slow = replace(MODEL, host_load_s_per_block=0.010)  # loading slower than computing: worth nothing
    assert slow.host_block_worth(33, BS, TierHits(0, 8)) == 0.0


def test_the_load_time_per_block_is_what_the_workers_steps_measured():
    steps = [StepSample(64, 0, 0, 0, 0.07), StepSample(32, 0, 0, 0, 0.04, host_loaded_blocks=4, host_load_s=0.004),
             StepSample(16, 0, 0, 0, 0.03, host_loaded_blocks=2, host_load_s=0.008), StepSample(8, 0, 0, 0, 0.02)]
    assert StepTimeModel.fit(steps, 2048).host_load_s_per_block == pytest.approx(0.012 / 6)
    assert StepTimeModel.fit(steps[:1], 2048).host_load_s_per_block == 0.003


def test_device_hits_beat_host_hits_beat_recomputation_in_ttft_and_prefix_affinity():
    prompt = Prompt.of(33, 8, BS)
    hits = {"dev": TierHits(8), "host": TierHits(0, 8), "none": TierHits(0)}
    local = {w: local_candidate(w, decode_side(load(w), MODEL, [], prompt.hit_blocks(hits, w), prompt, "queue"), 0,
                                prompt, 0.0, rotation_slot=False) for w in hits}
    assert {w: c.prefill_s for w, c in local.items()} == pytest.approx({"dev": 0.011, "host": 0.035, "none": 0.043})
    assert (local["host"].prefill_hit_blocks, local["host"].prefill_host_blocks) == (8, 8)
    assert fastest(list(local.values())).decode == "dev"
    affinity = {w: SCORER_FUNCTIONS["prefix_affinity"](c, None, None) for w, c in local.items()}
    assert affinity == pytest.approx({"dev": 1.0, "host": 0.25, "none": 0.0})
    # A decode worker's host blocks are loaded from its reservation on: they do not travel, and
    # their load runs beside the prefill and the transfer; the longer of the two is waited for.
    p = prefill_side(MODEL, 0, TierHits(0), prompt)
    d = decode_side(load("d0"), MODEL, [], TierHits(2, 3), prompt, "queue")
    assert (d.host_load_s, d.has_room) == (pytest.approx(0.009), True)
    [c] = remote_candidates("d0", d, ["p0"], {"p0": p}, {"p0": 0}, prompt, 0.0, rotation_prefill=None)
    assert c.transfer_s == pytest.approx(0.002 * (9 - 5))
    assert c.ttft_s == pytest.approx(0.043 + 0.008)  # prefill 43 ms + transfer 8 ms, the 9 ms load beside them
    assert (c.decode_hit_blocks, c.decode_host_blocks) == (5, 3)
    slow = decode_side(load("d0"), replace(MODEL, host_load_s_per_block=0.030), [], TierHits(2, 3), prompt, "queue")
    [c] = remote_candidates("d0", slow, ["p0"], {"p0": p}, {"p0": 0}, prompt, 0.0, rotation_prefill=None)
    assert c.ttft_s == c.idle_ttft_s == pytest.approx(3 * 0.030)  # a load longer than the prefill: the load


def test_a_correction_takes_off_at_most_half_and_never_goes_under_the_floor():
    assert corrected(0.1, 0.05) == pytest.approx(0.15)
    assert corrected(0.1, -0.08) == pytest.approx(0.05)
    assert corrected(0.0, 0.0) == MIN_TTFT_S


# -- scorers and the picker ---------------------------------------------------------------------

def test_every_configurable_scorer_has_a_function():
    assert tuple(SCORER_FUNCTIONS) == SCORERS


def test_the_picker_ranks_those_with_room_by_score_then_first_token_then_fewer_hops():
    remote, local = candidate("p0", "d0", 0.2), candidate(None, "d0", 0.2)
    slower, full = candidate("p1", "d0", 0.3), candidate("p2", "d1", 0.1, room=False)
    ranked = rank([remote, slower, full, local], {"round_robin": 1.0}, INTERACTIVE)  # every score 0
    assert ranked == [local, remote, slower]
    assert rank([full], {"round_robin": 1.0}, INTERACTIVE) == [full]  # none has room: all of them


def test_admission_picks_the_best_that_meets_and_explains_when_none_does():
    late, ok = candidate("p0", "d0", 1.2), candidate("p1", "d0", 0.7)
    assert meets(1.0, 0.1, INTERACTIVE) and not meets(1.0, 0.11, INTERACTIVE)
    assert first_meeting([late, ok], INTERACTIVE, 0.0) is ok
    assert first_meeting([late, ok], INTERACTIVE, 0.4) is None  # 0.4 s already spent
    assert not never_meets([late, ok], INTERACTIVE, 0.0) and never_meets([late, ok], INTERACTIVE, 0.4)
    assert fastest([late, ok]) is ok
    assert explain(INTERACTIVE, ok, never=True, spent=0.4) == (
        "even an idle cluster cannot meet slo_class 'interactive' (TTFT <= 1000 ms, TPOT <= 100 ms): the best, "
        "p1 -> d0, predicts TTFT waited 400 ms + 700 ms (queue 0 ms + prefill 0 ms + transfer 0 ms) and TPOT 50 ms; "
        "idle, TTFT 700 ms and TPOT 50 ms")
    assert explain(INTERACTIVE, ok, never=False, full=True).startswith(
        "no decode worker has a free slot and KV blocks now for slo_class 'interactive'")
