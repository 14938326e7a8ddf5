"""Draft-model guesses: a smaller checkpoint with the target's tokenizer, run in the engine's own
process by its own model runner, with its own KV tensors.

Its KV cache has the target's number of blocks and block size and is indexed by the target's
block tables, so there is no second block manager: the look-ahead slots the engine holds for a
request's guesses are where the draft writes their KV. It computes KV for every token the target
computes (each step's prompt chunks, decodes and kept guesses, in one forward after the target's
step), so a block in the prefix cache holds the draft's KV too, and a request whose prompt's KV
arrived from a prefill worker has the draft's KV for it built here, in its first step, before its
first guess. Per request (``Request.proposer_state``) it tracks how many leading tokens its KV
holds. A round of guesses: that forward also feeds each guessing request the tokens its KV lacks
(the step's new token, and the last guess where every guess was kept) and samples its first
guess; then k-1 decode steps, batched across the guessing requests, each sample the next. Guesses
are greedy. A guess not kept leaves stale KV past the kept tokens, overwritten when the real
tokens are fed (every position read is below the request's tracked count).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import chain
from typing import Mapping, Sequence

from cluster.engine.model_runner import ModelRunner, PrefillPlan, StepPlan
from cluster.engine.request import Request
from cluster.engine.scheduler import SchedulerOutput
from cluster.engine.speculative.policy import FITTED_STEPS, MIN_FITTED_STEPS, REFIT_STEPS, StepCost


@dataclass
class DraftState:
    computed: int  # leading tokens of the request whose draft KV is in its blocks


@dataclass(frozen=True)
class _Span:
    request: Request
    start: int
    end: int
    blocks: list[int]


class DraftProposer:
    writes_kv = True

    def __init__(self, runner: ModelRunner, max_rows_fitted: int):
        """``runner``: the draft's (its KV cache allocated by :meth:`allocate`); its forwards of up
        to ``max_rows_fitted`` rows are what its step cost is fitted to (the engine's own rule)."""
        self.runner = runner
        self.block_size = runner.block_size
        self.max_rows_fitted = max_rows_fitted
        self.forwards: deque[tuple[int, float]] = deque(maxlen=FITTED_STEPS)  # (rows, seconds)
        self._cost: StepCost | None = None
        self._fitted_at = -REFIT_STEPS
        self._count = 0

    @property
    def block_bytes(self) -> int:
        return self.runner.block_bytes

    def allocate(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def available(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[int]:
        return list(rooms)

    def round_cost(self) -> StepCost | None:
        """A line fitted to the draft's recent forwards, as the engine fits its own steps; where
        they all had one width (batch 1), their mean as a fixed cost."""
        if self._count - self._fitted_at >= REFIT_STEPS:
            points = list(self.forwards)
            self._cost = StepCost.fit(points)
            if self._cost is None and len(points) >= MIN_FITTED_STEPS:
                self._cost = StepCost(sum(s for _, s in points) / len(points), 0.0)
            self._fitted_at = self._count
        return self._cost

    def propose(self, step: SchedulerOutput, held: Mapping[int, list[int]], requests: Sequence[Request],
                counts: Sequence[int]) -> list[list[int]]:
        for request in step.preempted:
            request.proposer_state = None  # its blocks went back: its KV is rebuilt from its new ones
        wanted = {id(r): n for r, n in zip(requests, counts) if n > 0}
        spans = self._catch_up(step, held, requests, wanted)
        if not spans:
            return [[] for _ in requests]
        guessing = [s for s in spans if id(s.request) in wanted]
        guesses = {id(s.request): [token] for s, token in zip(guessing, self._run_spans(spans, wanted))}
        for depth in range(1, max(wanted.values(), default=0)):
            rows = [s for s in guessing if wanted[id(s.request)] > depth]
            for span, token in zip(rows, self._run_decodes(rows, guesses, depth)):
                guesses[id(span.request)].append(token)
        return [guesses.get(id(r), []) for r in requests]

    def _catch_up(self, step: SchedulerOutput, held: Mapping[int, list[int]], requests: Sequence[Request],
                  wanted: Mapping[int, int]) -> list[_Span]:
        """Per request of the step (and each guessing one): the tokens whose KV the target has
        and the draft lacks, and for a guessing request its newest token too."""
        chunk_starts = {id(r): r.num_computed_tokens - n for r, n in step.prefills}  # counts are past the step
        spans, seen = [], set()
        for request in chain((r for r, _ in step.scheduled()), requests):
            if id(request) in seen:
                continue
            seen.add(id(request))
            state = request.proposer_state
            if state is None:  # new here: a prompt's first chunk (after any cached prefix), or KV that arrived
                state = request.proposer_state = DraftState(chunk_starts.get(id(request), request.num_cached_tokens))
            state.computed = min(state.computed, request.num_computed_tokens)  # guesses not kept: stale past here
            if request.finished:  # its blocks went back in this step: only those now cached are worth filling
                end, blocks = min(request.num_computed_tokens, request.num_registered_blocks * self.block_size), \
                    held.get(id(request), [])
            else:
                end = request.num_tokens if id(request) in wanted else request.num_computed_tokens
                blocks = request.block_ids
            if end > state.computed:
                spans.append(_Span(request, state.computed, end, blocks))
                state.computed = end
        return spans

    def _run_spans(self, spans: list[_Span], wanted: Mapping[int, int]) -> list[int]:
        """One forward over every span; the greedy token after each guessing request's span."""
        bs = self.block_size
        ids, positions, slots, prefills, sample_rows = [], [], [], [], []
        for span in spans:
            prefills.append(PrefillPlan(len(ids), span.end - span.start, span.end,
                                        tuple(span.blocks[: -(-span.end // bs)])))
            ids.extend(span.request.token_ids[span.start: span.end])
            positions.extend(range(span.start, span.end))
            slots.extend(span.blocks[p // bs] * bs + p % bs for p in range(span.start, span.end))
            if id(span.request) in wanted:
                sample_rows.append(len(ids) - 1)
        return self._forward(StepPlan(ids, positions, slots, [], [], prefills, sample_rows))

    def _run_decodes(self, rows: list[_Span], guesses: Mapping[int, list[int]], depth: int) -> list[int]:
        """One decode step feeding each request its latest guess (at position ``num_tokens + depth - 1``)."""
        bs = self.block_size
        ids, positions, slots, lens, table = [], [], [], [], []
        for span in rows:
            request = span.request
            position = request.num_tokens + depth - 1
            ids.append(guesses[id(request)][-1])
            positions.append(position)
            slots.append(request.block_ids[position // bs] * bs + position % bs)
            lens.append(position + 1)
            table.append(request.block_ids[: -(-(position + 1) // bs)])
            request.proposer_state.computed = position + 1
        widest = max(len(t) for t in table)
        table = [t + [0] * (widest - len(t)) for t in table]
        return self._forward(StepPlan(ids, positions, slots, lens, table, [], list(range(len(rows)))))

    def _forward(self, plan: StepPlan) -> list[int]:
        started = time.perf_counter()
        runner = self.runner
        logits = runner.execute(runner.build_inputs(plan))
        tokens = logits.argmax(dim=-1).tolist() if plan.sample_rows else []
        rows = len(plan.input_ids)
        if rows <= self.max_rows_fitted:
            self.forwards.append((rows, time.perf_counter() - started))
            self._count += 1
        return tokens
