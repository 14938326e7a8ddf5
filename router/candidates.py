"""Candidates and their predictions: the ways one request could be placed now, each with the
TTFT and TPOT its workers' step-time models predict.

A candidate is a (prefill worker, decode worker) pair, or a decode worker alone when it would
prefill the prompt itself (``prefill is None``). What a prefill worker contributes to a pair
(its queue and prefill time) does not depend on the decode worker, nor what a decode worker
contributes (its step time, room, waits) on the prefill worker: each side is predicted once per
worker (``PrefillSide``, ``DecodeSide``) and the pairs only add them up.

A worker's prefix hits come by tier (``TierHits``): device blocks cost nothing, host-tier blocks
their load (the worker's measured load time per block), the rest are computed; a decode worker's
host blocks are loaded when it reserves (before it asks for the KV) and do not travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from cluster.engine.block_hash import cacheable_prefix_blocks
from cluster.registry.kv_index import TierHits
from cluster.registry.load import WorkerLoad
from router.cost_model import StepTimeModel
from router.filters import first_in_line, has_room

MIN_TTFT_S = 0.001  # the least TTFT any prediction gives


@dataclass
class Candidate:
    prefill: str | None
    decode: str
    prefill_hit_blocks: int  # of the prompt, cached where it will be prefilled (either tier)
    decode_hit_blocks: int  # of the prompt, cached on the decode worker (those blocks do not travel)
    cacheable_blocks: int
    prefill_queue_tokens: int
    decode_load: float  # share of sequence slots plus share of KV blocks in use
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    call_s: float = 0.0  # the decode worker's call to the prefill worker, beyond the prefill's work (remote only)
    correction_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    idle_ttft_s: float = 0.0  # the same prediction with empty queues: what this pair could ever do
    idle_tpot_s: float = 0.0
    tpot_scale: float = 1.0  # what the decode worker's predicted steps were multiplied by (Router.step_scale)
    tpot_limit_s: float | None = None  # below the class's objective: headroom kept for a tighter class
    decode_has_room: bool = True
    decode_room_later: bool = False  # no room now, but some once a request its decode worker holds ends
    rotation_slot: bool = False  # this request's turn in the round-robin order
    scores: dict[str, float] = field(default_factory=dict)
    score: float = 0.0
    prefill_host_blocks: int = 0  # of prefill_hit_blocks, those in the host tier (loaded, not computed) ...
    prefill_host_worth: float = 0.0  # ... and what each is worth against a device hit (cost_model.host_block_worth)
    decode_host_blocks: int = 0  # the same on the decode side
    decode_host_worth: float = 0.0
    kv_source: str | None = None  # a local prefill that first pulls the prompt's prefix from this peer ...
    kv_source_blocks: int = 0  # ... until it holds this many leading blocks (router/peer_pull.py)

    @property
    def label(self) -> str:
        return f"{self.prefill or '(local prefill)'} -> {self.decode}"


@dataclass(frozen=True)
class Prompt:
    """What placement needs of a request's prompt, counted in the topology's blocks."""

    tokens: int
    max_tokens: int
    block_size: int
    cacheable_blocks: int  # full blocks that may hit a cache (never the one holding the last token)
    blocks: int  # blocks the prompt fills, the last one partly

    @classmethod
    def of(cls, tokens: int, max_tokens: int, block_size: int) -> "Prompt":
        return cls(tokens, max_tokens, block_size, cacheable_prefix_blocks(tokens, block_size),
                   -(-tokens // block_size))

    def hit_blocks(self, hits: Mapping[str, TierHits], worker: str) -> TierHits:
        """Leading blocks of the prompt ``worker`` caches, by tier, counting only those that may hit."""
        got = hits.get(worker, NO_HITS)
        device = min(got.device, self.cacheable_blocks)
        return TierHits(device, min(got.host, self.cacheable_blocks - device))

    def uncached_tokens(self, hit_blocks: int) -> int:
        """The prompt tokens left to compute past ``hit_blocks`` cached ones."""
        return self.tokens - hit_blocks * self.block_size


NO_HITS = TierHits(0)


class PrefillSide(NamedTuple):
    """What a prefill worker contributes to every pair it is in."""

    model: StepTimeModel
    hit_blocks: TierHits
    queue_s: float
    prefill_s: float  # host-tier loads included
    host_worth: float
    draft_s: float  # its draft model over the prompt's uncached tokens, where a decode worker asks for its KV


def prefill_side(model: StepTimeModel, queued_tokens: int, hit_blocks: TierHits, prompt: Prompt) -> PrefillSide:
    return PrefillSide(model, hit_blocks, model.queue_seconds(queued_tokens),
                       model.tiered_prefill_seconds(prompt.tokens, prompt.block_size, hit_blocks),
                       model.host_block_worth(prompt.tokens, prompt.block_size, hit_blocks),
                       model.draft_prompt_seconds(prompt.tokens - hit_blocks.blocks * prompt.block_size))


class DecodeSide(NamedTuple):
    """What a decode (or colocated) worker contributes to every candidate it is in (a tuple:
    one is built per worker and placement, and a frozen dataclass is slower to build)."""

    model: StepTimeModel
    hit_blocks: TierHits
    load: float  # share of sequence slots plus share of KV blocks in use, this request included
    tpot_s: float
    idle_tpot_s: float
    has_room: bool
    room_later: bool  # no room now, but some when a request it holds ends (the request fits the worker idle)
    slot_wait_s: float  # first in a full worker's line: until the sequence closest to its end finishes
    reserve_wait_s: float  # a call waits for the step in progress
    host_load_s: float  # its host-tier blocks loaded as it reserves
    host_worth: float
    call_s: float  # its call to a prefill worker costs this beyond the prefill's work (measured, reported)
    draft_prompt_share: float  # of its remote prefills, those that ask for the draft's KV too (reported)


def tier_fields(prefill: TierHits, prefill_worth: float, decode: TierHits, decode_worth: float) -> dict:
    """A candidate's host-tier fields."""
    return dict(prefill_host_blocks=prefill.host, prefill_host_worth=prefill_worth, decode_host_blocks=decode.host,
                decode_host_worth=decode_worth)


def decode_side(load: WorkerLoad, model: StepTimeModel, pending_prompt_tokens: Sequence[int], hit_blocks: TierHits,
                prompt: Prompt, on_overload: str) -> DecodeSide:
    """The worker's load as reported plus the placements since (``pending_prompt_tokens``, one
    per request its report cannot show yet) plus this request."""
    bs = prompt.block_size
    sequences = load.running + load.receiving + load.waiting + len(pending_prompt_tokens) + 1
    context = load.decode_context_tokens + sum(pending_prompt_tokens) + prompt.tokens
    # Its uncached blocks: a cached block no running request holds counts as free in the report
    # and stops being free when reused, so this can be short by the prompt's device hits. (Counting
    # them too left an e2e test's request, 61 of a 64-block worker's blocks, 3 blocks of slack
    # against a report from just before 8 requests ended: refused at once; left as it was.)
    needed = -(-(prompt.tokens + prompt.max_tokens) // bs) - hit_blocks.device  # host hits load into fresh blocks
    free = load.free_blocks - sum(-(-tokens // bs) for tokens in pending_prompt_tokens)
    share = sequences / load.max_num_seqs + 1 - free / max(1, load.num_blocks)
    step = model.decode_step_seconds(sequences, context)
    tpot = step / model.tokens_per_step
    in_line = first_in_line(sequences, load.max_num_seqs, on_overload)
    return DecodeSide(model, hit_blocks, share, tpot, idle_tpot_s=model.tpot_seconds(1, prompt.tokens),
                      has_room=has_room(free, needed, sequences, load.max_num_seqs, in_line),
                      room_later=sequences > 1 and needed <= load.num_blocks,
                      slot_wait_s=tpot * load.next_slot_tokens if in_line else 0.0,
                      reserve_wait_s=step if load.running else 0.0,
                      host_load_s=model.host_load_seconds(hit_blocks.host),
                      host_worth=model.host_block_worth(prompt.tokens, bs, hit_blocks), call_s=load.prefill_call_s,
                      draft_prompt_share=load.draft_prompt_share)


def corrected(predicted_s: float, correction_s: float) -> float:
    """A TTFT prediction with the learned correction: a correction that the model over-predicts
    may take off at most half of the prediction, and no prediction is under MIN_TTFT_S (no
    request crosses two hops and a model step faster)."""
    return max(predicted_s + correction_s, predicted_s / 2, MIN_TTFT_S)


def remote_candidates(decode: str, d: DecodeSide, paired: Sequence[str], prefill_sides: Mapping[str, PrefillSide],
                      queued_tokens: Mapping[str, int], prompt: Prompt, correction_s: float,
                      rotation_prefill: str | None) -> list[Candidate]:
    """The decode worker's pairs with ``paired``: each prefill worker computes the KV and sends
    the blocks the decode worker lacks, after the decode worker's call reached it (``call_s``:
    the hop a local prefill does not make). The KV may land before a slot frees: TTFT is at
    least the wait for the slot. ``rotation_prefill`` is the prefill worker whose pair with this
    decode worker has the round-robin turn (None: no pair of it has). A decode worker drafting with
    a model may ask the prefill worker to build the draft's KV of the prompt too: its prefill then
    counts that work, by the share of its remote prefills that asked for it (its measured choice,
    ``decode_worker/draft_prompt_kv.py``). The blocks it holds in its host tier load beside all
    that (``scheduler.reserve_for_transfer``). One call per decode worker, not per pair: the pairs
    are a placement's inner loop."""
    out = []
    missing_blocks, cacheable = prompt.blocks - d.hit_blocks.blocks, prompt.cacheable_blocks
    hit_d, load, tpot_s, idle_tpot_s = d.hit_blocks, d.load, d.tpot_s, d.idle_tpot_s  # locals: the inner loop
    has_room, slot_wait_s, reserve_s, call_s = d.has_room, d.slot_wait_s, d.reserve_wait_s, d.call_s
    host_load_s, draft_share = d.host_load_s, d.draft_prompt_share
    for prefill in paired:
        model, hit_p, queue_s, prefill_s, worth_p, draft_s = prefill_sides[prefill]
        prefill_s += draft_s * draft_share
        c = Candidate(prefill, decode, hit_p.blocks, hit_d.blocks, cacheable, queued_tokens[prefill], load,
                      queue_s=queue_s, prefill_s=prefill_s, transfer_s=model.transfer_seconds(missing_blocks),
                      call_s=call_s, tpot_s=tpot_s, decode_has_room=has_room, decode_room_later=d.room_later,
                      rotation_slot=prefill == rotation_prefill, **tier_fields(hit_p, worth_p, hit_d, d.host_worth))
        c.correction_s = correction_s
        # The decode worker's host-tier blocks load in the background from its reservation on,
        # while its call, the prefill and the transfer go on: the longer of the two counts.
        c.ttft_s = corrected(reserve_s + max(c.queue_s + c.prefill_s + c.transfer_s + call_s, host_load_s),
                             c.correction_s)
        c.ttft_s = max(c.ttft_s, slot_wait_s + c.correction_s)
        c.idle_ttft_s = corrected(max(c.prefill_s + c.transfer_s + call_s, host_load_s), c.correction_s)
        c.idle_tpot_s = idle_tpot_s
        out.append(c)
    return out


def local_candidate(decode: str, d: DecodeSide, queued_tokens: int, prompt: Prompt, correction_s: float,
                    rotation_slot: bool, pull=None) -> Candidate:
    """The worker prefills the prompt itself: it waits for the step in progress, then its
    prefill runs in a step with the decodes; with ``pull`` (a ``router.peer_pull.PeerPull``) it
    first pulls the prefix a peer caches, and computes only the rest."""
    local_prefill = (pull.seconds if pull is not None else
                     d.model.tiered_prefill_seconds(prompt.tokens, prompt.block_size, d.hit_blocks))
    hits = d.hit_blocks
    c = Candidate(None, decode, hits.blocks, hits.blocks, prompt.cacheable_blocks, queued_tokens, d.load,
                  queue_s=d.model.queue_seconds(queued_tokens) + d.reserve_wait_s + d.slot_wait_s,
                  prefill_s=local_prefill + d.reserve_wait_s,
                  tpot_s=d.tpot_s, decode_has_room=d.has_room, decode_room_later=d.room_later,
                  rotation_slot=rotation_slot,
                  **tier_fields(hits, d.host_worth, hits, d.host_worth))
    if pull is not None:
        c.kv_source, c.kv_source_blocks = pull.source, pull.blocks
    c.correction_s = correction_s
    c.ttft_s = corrected(c.queue_s + c.prefill_s, c.correction_s)
    c.idle_ttft_s, c.idle_tpot_s = corrected(local_prefill, c.correction_s), d.idle_tpot_s
    return c
