"""Draft-model guesses: a smaller checkpoint with the target's tokenizer, run in the engine's own
process by its own model runner, with its own KV tensors.

Its KV cache has the target's number of blocks and block size and is indexed by the target's
block tables, so there is no second block manager: the look-ahead slots the engine holds for a
request's guesses are where the draft writes their KV. Per request (``Request.proposer_state``)
it tracks how many leading tokens its KV holds, and it computes nothing for a request until the
request is given guesses: then one forward feeds each guessing request every token its KV lacks
(the prompt, or the tokens made while it did not guess, and the step's new token) and samples
its first guess; then k-1 decode steps, batched across the guessing requests, each sample the
next. While the policy gives no guesses (a wide batch, a draft that does not pay) the draft runs
nothing at all. Guesses are greedy. A guess not kept leaves stale KV past the kept tokens,
overwritten when the real tokens are fed (every position read is below the request's tracked
count).

A block in the prefix cache holds the draft's KV only if the draft computed it: the draft keeps,
for each block whose KV it completed for real tokens, the hash the block was cached under, and a
request starting on cached blocks trusts the draft's KV of its leading blocks whose hashes still
match (a block the draft writes again is dropped from that record until completed again).

An engine that only prefills (a prefill worker beside decode workers drafting with this
checkpoint) runs the draft over the same prompt chunks as the model, for the requests whose KV
transfer asks for it (:meth:`DraftProposer.build_prompts`), and sends those blocks with the
model's; the decode side then marks the prompt's draft KV as there (:meth:`received`), and its
first guess for the request needs no catch-up.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from cluster.engine.model_runner import ModelRunner, PrefillPlan, StepPlan
from cluster.engine.request import Request
from cluster.engine.scheduler import SchedulerOutput
from cluster.engine.speculative.policy import FITTED_STEPS, MIN_FITTED_STEPS, REFIT_STEPS, StepCost


@dataclass
class DraftState:
    computed: int  # leading tokens of the request whose draft KV is in its blocks
    recorded: int = 0  # leading blocks recorded in ``DraftProposer.filled`` (a block is hashed a step after it fills)


@dataclass(frozen=True)
class _Span:
    request: Request
    start: int
    end: int


class DraftProposer:
    writes_kv = True

    def __init__(self, runner: ModelRunner, max_rows_fitted: int, target_weight_bytes: int):
        """``runner``: the draft's (its KV cache allocated by :meth:`allocate`); its forwards of up
        to ``max_rows_fitted`` rows are what its step cost is fitted to (the engine's own rule);
        ``target_weight_bytes``: the target's weights, to scale the target's step cost into an
        estimate of the draft's until the draft's own forwards are measured."""
        self.runner = runner
        self.block_size = runner.block_size
        self.max_rows_fitted = max_rows_fitted
        self.size_ratio = runner.weight_bytes / max(1, target_weight_bytes)
        self.forwards: deque[tuple[int, float]] = deque(maxlen=FITTED_STEPS)  # (rows, seconds)
        self.forward_seconds = 0.0  # every forward's, summed
        self.forward_count = 0
        self.filled: dict[int, bytes] = {}  # block id -> the hash of the content whose draft KV it holds
        self.prompt_tokens = 0  # tokens fed by build_prompts ...
        self.prompt_seconds = 0.0  # ... and the seconds its forwards took
        self.prompt_tokens_fed = 0  # prompt tokens fed, by build_prompts or a guessing request's catch-up
        self.prompts_received = 0  # requests whose draft KV of the prompt arrived with the model's
        self._fitted: StepCost | None = None
        self._fitted_at = -REFIT_STEPS
        self._count = 0

    @property
    def block_bytes(self) -> int:
        return self.runner.block_bytes

    def allocate(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def available(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[int]:
        return list(rooms)

    def first_odds(self, requests: Sequence[Request]) -> list[float]:
        return [r.acceptance for r in requests]

    def best_first_odds(self, requests: Sequence[Request]) -> float:
        return max((r.acceptance for r in requests), default=0.0)

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        pass  # the request's own odds are all the policy uses

    def catch_up(self, requests: Sequence[Request]) -> list[int]:
        return [max(0, r.num_tokens - self._track(r).computed - 1) for r in requests]

    def round_cost(self, target: StepCost | None) -> StepCost | None:
        """A line fitted to the draft's recent forwards, as the engine fits its own steps. Until
        their widths spread (at batch 1 every measured forward has one row), the target's line
        scaled by the draft's share of the weights (it runs the same step on fewer weights) gives
        the cost of a row, under the measured mean of the draft's one-row forwards where there are
        enough; before any forward, the scaled line alone. A draft is thus judged from its first
        guess, never counted free (a self-draft, as dear as the target, then guesses nothing)."""
        if self._count - self._fitted_at >= REFIT_STEPS:
            self._fitted = StepCost.fit(self.forwards)
            self._fitted_at = self._count
        if self._fitted is not None:
            return self._fitted
        if target is None:
            return None
        per_row = target.per_row_s * self.size_ratio
        ones = [s for rows, s in self.forwards if rows == 1]
        if len(ones) >= MIN_FITTED_STEPS:
            return StepCost(max(sum(ones) / len(ones) - per_row, 1e-6), per_row)
        return StepCost(target.fixed_s * self.size_ratio, per_row)

    def catch_up_s_per_token(self, target: StepCost | None) -> float | None:
        """What the policy charges a token this draft must catch up on: a row of its step (None
        before the engine has a step cost to scale, or a fit of its own)."""
        cost = self.round_cost(target)
        return cost.per_row_s if cost is not None else None

    def prompt_s_per_token(self) -> float | None:
        """Measured seconds per prompt token of :meth:`build_prompts` (None before any)."""
        return self.prompt_seconds / self.prompt_tokens if self.prompt_tokens else None

    def build_prompts(self, step: SchedulerOutput, chunks: Sequence[tuple[Request, int]]) -> None:
        """Feeds the draft, in one forward, each request's tokens its draft KV lacks up to the end
        of the chunk the model computes of it in ``step`` (``count`` tokens from its computed
        ones: call before the scheduler moves them on), so its blocks hold the draft's KV of the
        prompt as they hold the model's."""
        for request in step.preempted:
            request.proposer_state = None
        spans = [_Span(r, self._track(r).computed, r.num_computed_tokens + count) for r, count in chunks]
        spans = [s for s in spans if s.end > s.start]
        if not spans:
            return
        started = time.perf_counter()
        self._run_spans(spans)
        self.prompt_seconds += time.perf_counter() - started
        self.prompt_tokens += sum(s.end - s.start for s in spans)

    def filled_blocks(self, request: Request) -> int:
        """Leading blocks of a request (its cached ones) whose draft KV this draft holds: what a
        prefill worker need not send of the draft's KV."""
        return self._filled_prefix(request) // self.block_size

    def received(self, request: Request, first_block: int) -> None:
        """The draft's KV of the request's prompt arrived (its blocks from ``first_block`` on;
        those before held it already): nothing of the prompt is left to catch up on, and its full
        blocks are recorded as holding the draft's KV, for the prefix cache."""
        bs = self.block_size
        self._written(request.block_ids[first_block:])
        full = min(request.num_prompt_tokens // bs, len(request.block_hashes))
        for i in range(full):
            self.filled[request.block_ids[i]] = request.block_hashes[i]
        request.proposer_state = DraftState(request.num_prompt_tokens, full)
        self.prompts_received += 1

    def propose(self, step: SchedulerOutput, requests: Sequence[Request], counts: Sequence[int]) -> list[list[int]]:
        for request in step.preempted:
            request.proposer_state = None  # its blocks went back: its KV is rebuilt from its new ones
        for request, _ in step.scheduled():
            self._track(request)
        wanted = {id(r): n for r, n in zip(requests, counts) if n > 0}
        if not wanted:
            return [[] for _ in requests]
        spans = [self._behind(r) for r in requests if id(r) in wanted]
        guesses = {id(s.request): [token] for s, token in zip(spans, self._run_spans(spans))}
        for depth in range(1, max(wanted.values())):
            rows = [s for s in spans if wanted[id(s.request)] > depth]
            for span, token in zip(rows, self._run_decodes(rows, guesses, depth)):
                guesses[id(span.request)].append(token)
        return [guesses.get(id(r), []) for r in requests]

    def _track(self, request: Request) -> DraftState:
        """The request's state, made on first sight from its cached blocks whose draft KV is
        known to be there; guesses not kept are stale past its computed tokens."""
        state = request.proposer_state
        if state is None:
            start = self._filled_prefix(request)
            state = request.proposer_state = DraftState(start, start // self.block_size)
        state.computed = min(state.computed, request.num_computed_tokens)
        return state

    def _filled_prefix(self, request: Request) -> int:
        """Leading tokens of the request's cached blocks whose draft KV the draft completed."""
        bs, blocks = self.block_size, 0
        for block_id, block_hash in zip(request.block_ids[: request.num_cached_tokens // bs], request.block_hashes):
            if self.filled.get(block_id) != block_hash:
                break
            blocks += 1
        return blocks * bs

    def _behind(self, request: Request) -> _Span:
        """A guessing request's tokens whose draft KV is missing, its newest token included."""
        state = self._track(request)
        return _Span(request, state.computed, request.num_tokens)

    def _written(self, blocks: Sequence[int]) -> None:
        for block_id in blocks:
            self.filled.pop(block_id, None)

    def _run_spans(self, spans: list[_Span]) -> list[int]:
        """One forward over every span; the greedy token after each. The blocks the spans fill
        with real tokens are recorded as holding the draft's KV of their content."""
        bs = self.block_size
        ids, positions, slots, prefills, sample_rows = [], [], [], [], []
        for span in spans:
            blocks = span.request.block_ids
            self.prompt_tokens_fed += max(0, min(span.end, span.request.num_prompt_tokens) - span.start)
            prefills.append(PrefillPlan(len(ids), span.end - span.start, span.end, tuple(blocks[: -(-span.end // bs)])))
            ids.extend(span.request.token_ids[span.start: span.end])
            positions.extend(range(span.start, span.end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(span.start, span.end))
            sample_rows.append(len(ids) - 1)
            self._written(blocks[span.start // bs: -(-span.end // bs)])
        tokens = self._forward(StepPlan(ids, positions, slots, [], [], prefills, sample_rows))
        for span in spans:
            request, state = span.request, span.request.proposer_state
            state.computed = span.end
            full = min(span.end // bs, len(request.block_hashes))
            for i in range(min(state.recorded, span.start // bs), full):
                self.filled[request.block_ids[i]] = request.block_hashes[i]
            state.recorded = full
        return tokens

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
            self._written([request.block_ids[position // bs]])
        widest = max(len(t) for t in table)
        table = [t + [0] * (widest - len(t)) for t in table]
        return self._forward(StepPlan(ids, positions, slots, lens, table, [], list(range(len(rows)))))

    def _forward(self, plan: StepPlan) -> list[int]:
        started = time.perf_counter()
        runner = self.runner
        logits = runner.execute(runner.build_inputs(plan))
        tokens = logits.argmax(dim=-1).tolist() if plan.sample_rows else []
        rows, seconds = len(plan.input_ids), time.perf_counter() - started
        self.forward_seconds += seconds
        self.forward_count += 1
        if rows <= self.max_rows_fitted:
            self.forwards.append((rows, seconds))
            self._count += 1
        return tokens
