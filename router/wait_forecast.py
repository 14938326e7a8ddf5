"""The predicted wait of a request that cannot be placed now: when the queue ahead of it drains
enough to place it, from the workers' step-time models. It decides whether a request that may
wait is held or refused at once, and the ``Retry-After`` of a refusal.

Two things hold a request back, and each drains at a rate the cost model gives:

- **Decode slots.** A generating worker takes at most ``max_num_seqs`` sequences, fewer where
  a larger batch would break the class's TPOT objective, and no more than its free KV blocks
  hold. Slots free as sequences finish: by Little's law a worker holding ``n`` sequences
  (decoding, or placed there and about to) of ``L`` output tokens each, at a step of
  ``step(n)`` seconds, ends ``n / (L * step(n))`` of them a second (``L`` the mean output length
  the router learned from finished requests). The first to end, the running one closest to its
  end, does so in ``next_slot_tokens`` steps. The request needs
  a slot after every request waiting ahead of it.
- **Prefill backlog.** Prompt tokens queued on the prefill side, and those of the requests
  waiting ahead, are worked through in real time: holding the request does not make its first
  token sooner, so a backlog beyond its TTFT objective is refused at once.

A request held ``wait_s`` has its first token ``max(wait_s, backlog_s) + after_s`` from now
(``after_s``: its own prefill and transfer on an idle pair). A fresh request sent
``retry_after_s`` from now would meet its TTFT objective, if nothing else arrived meanwhile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cluster.registry.load import WorkerLoad
from router.cost_model import StepTimeModel


FIT_ROUNDING = 1e-9  # of a sequence: below any step the fits resolve


@dataclass(frozen=True)
class DecodeSlots:
    """What one generating worker offers a request that waits for a slot."""

    room: int  # sequences it could take now within the objectives and its blocks
    departures_per_s: float  # sequences it finishes a second at its current batch
    first_departure_s: float  # until its sequence closest to its end finishes (inf: none running)
    over: int = 0  # sequences it holds beyond what the objective allows: they end before a slot frees
    releasing: int = 0  # room it gains once the blocks its report shows held by no sequence are freed


def decode_slots(load: WorkerLoad, model: StepTimeModel, pending_prompt_tokens: Sequence[int],
                 blocks_per_request: int, tpot_objective_s: float | None, output_tokens: float,
                 report_age_s: float = 0.0, step_scale: float = 1.0) -> DecodeSlots:
    """A worker's slots as its report shows them plus the placements since (``pending_prompt_tokens``,
    one per request its report cannot show yet); its first sequence to end is that much nearer
    its end for every second since the report (``report_age_s``). ``step_scale``: how much slower
    than the fit steps are measured to run (the router's learned TPOT scale)."""
    sequences = load.running + load.receiving + load.waiting + len(pending_prompt_tokens)
    context = load.decode_context_tokens + sum(pending_prompt_tokens)
    capacity = load.max_num_seqs
    if tpot_objective_s is not None and model.decode is not None:
        a, b, c = model.decode
        per_sequence = b * (1.0 + model.guesses_per_sequence) + c * (context / sequences if sequences else 0.0)
        budget = tpot_objective_s / step_scale * model.tokens_per_step - a  # a step within the objective
        # A batch that meets the objective exactly fits: the fit's rounding (a scale of 1 + 4e-15)
        # is not a sequence less, which is what the same fit on another CPU's BLAS gave.
        capacity = min(capacity, max(0, math.floor(budget / per_sequence + FIT_ROUNDING)) if per_sequence > 0
                       else capacity)
    free_blocks = load.free_blocks - sum(-(-tokens // load.block_size) for tokens in pending_prompt_tokens)
    by_blocks = max(0, free_blocks) // max(1, blocks_per_request)
    room = max(0, min(capacity - sequences, by_blocks))
    step = model.decode_step_seconds(sequences, context) * step_scale
    per_sequence_s = output_tokens * step / model.tokens_per_step  # a sequence's time in the batch
    departures = sequences / per_sequence_s if sequences and per_sequence_s > 0 else 0.0
    first = (max(0.0, step / model.tokens_per_step * load.next_slot_tokens - report_age_s)
             if load.running and load.next_slot_tokens else math.inf)
    # Blocks in use with no sequence to hold them belong to requests that ended while the report
    # was taken (a deadline or a cancel mid-transfer): the worker is releasing them. Counted as
    # nothing to wait for, a request that came right after 8 deadline-ended calls was refused at
    # once on an idle cluster ("no end in sight").
    releasing = 0
    if not sequences and load.free_blocks < load.num_blocks:
        releasing = max(0, min(capacity, load.num_blocks // max(1, blocks_per_request)) - room)
    return DecodeSlots(room, departures, first, max(0, sequences - capacity), releasing)


def slot_wait_s(slots: Sequence[DecodeSlots], needed: int) -> float:
    """Until ``needed`` slots are free across the workers (this request's and those ahead of
    it): the slots free now, then those that finishing sequences free at the workers'
    combined rate, after those holding a worker past the objective (a tighter class filled it
    past a looser one's limit), never sooner than the first sequence ends. Inf when nothing
    decodes, unless blocks being released make the room (then 0: the next report shows it)."""
    free = sum(s.room for s in slots)
    if free + sum(s.releasing for s in slots) >= needed:
        return 0.0
    rate = sum(s.departures_per_s for s in slots)
    if rate <= 0:
        return math.inf
    first = min(s.first_departure_s for s in slots)
    return max(first if math.isfinite(first) else 0.0, (needed - free + sum(s.over for s in slots)) / rate)


@dataclass(frozen=True)
class WaitForecast:
    wait_s: float  # until a slot is free for it (after the requests ahead)
    backlog_s: float  # prefill work before its own, on the fastest candidate's prefill side
    after_s: float  # its own prefill and transfer once its turn comes (idle pair, corrected)

    def first_token_s(self, spent_s: float) -> float:
        """Its first token, counted from arrival (``spent_s`` ago), if it is held."""
        return spent_s + max(self.wait_s, self.backlog_s) + self.after_s

    def retry_after_s(self, ttft_objective_s: float | None) -> float:
        """When a fresh request could be placed and meet ``ttft_objective_s``: its slot is free
        and the backlog has drained enough for its first token to come in time."""
        late = self.backlog_s + self.after_s - ttft_objective_s if ttft_objective_s is not None else 0.0
        return max(self.wait_s, late, 0.0)
