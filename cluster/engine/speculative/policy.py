"""How many guesses each request gets in the next step: as many as raise the step's expected
tokens per second, from the engine's measured step times and the measured odds of guesses.

A guess's odds are two numbers: ``first``, that a request's first guess is kept, and ``then``,
that a guess is kept once the one before it was. Kept guesses come in runs (on text that repeats
its prompt a guess after a kept one was kept 85-94% of the time, a first guess 24% after a
1-token match and 87% after a 4-token one), so a request with odds ``(f, t)`` gains
``f * t^(j-1)`` expected tokens from its ``j``-th guess, each a row of the step.

A step's seconds for ``R`` rows are measured: the median of the recent steps of that width where
there are enough of them, else a line ``fixed + per_row * R`` fitted to the engine's recent
steps (start-up profile included). The CPU's fused step widens each q4 weight once per tile of up
to eight rows (four for q8 weights, and before 8-row tiles for q4 too a fifth row cost about three
of the others): where the line misses such a jump, the measured widths catch it. The guesses
are taken best first and the step gets the number of them whose expected tokens per second is
highest, none where that is not ``MIN_GAIN`` above the step without guesses (the cost is a
measurement and the odds an estimate: a plan predicted to gain 1% is as likely to lose; on this
CPU, about 6 ms a step and 0.8 ms a row, a sure guess adds 0.6% to a step of 32 decodes, a
4-token match's guesses 100% or more to a step of one):
at batch 1 on a CPU a row is cheap against the step's fixed cost and a well-guessed request gets
several; in a wide batch the step is already compute-bound and a guess must be nearly sure to
be made. A draft model's guesses also cost its own steps (``round_cost`` in :func:`plan_guesses`),
its first guess for a request the tokens it must feed first (``catch_up``: the prompt, or what
was made while the request did not guess), charged as :func:`catch_up_share` of them.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import median
from typing import Iterable, Mapping, Sequence

ACCEPTANCE_PRIOR = 0.5  # a request's odds of a first guess kept before any of its guesses were checked
CONTINUATION_PRIOR = 0.7  # ... and of a guess kept after a kept one
ACCEPTANCE_WEIGHT = 0.3  # weight of the latest step in a request's running odds
RECOVERY = 0.05  # per step without guesses, of the gap back to the prior
FITTED_STEPS = 256  # the most recent steps the step cost is fitted to ...
REFIT_STEPS = 16  # ... every this many steps
MIN_FITTED_STEPS = 4  # ... and the fewest of one width whose median stands for that width
CATCH_UP_STEPS = 32  # a draft's catch-up is charged to a step as 1/min(this, the request's steps left) of it
MIN_GAIN = 0.05  # a step guesses only where its guesses raise its expected tokens per second by this much


@dataclass(frozen=True)
class StepCost:
    fixed_s: float
    per_row_s: float
    widths: Mapping[int, float] = field(default_factory=dict)  # rows -> median seconds, where measured enough

    def seconds(self, rows: int) -> float:
        """A step of ``rows`` rows: its measured median, else the line, and never less than a
        narrower width measured (a row more never makes a step shorter)."""
        measured = self.widths.get(rows)
        if measured is not None:
            return measured
        narrower = [s for r, s in self.widths.items() if r < rows]
        return max([self.fixed_s + self.per_row_s * rows, *narrower])

    @classmethod
    def fit(cls, steps: Iterable[tuple[int, float]]) -> "StepCost | None":
        """The line of seconds on rows, least squares through each width's median weighted by
        its number of steps (the caller picks the steps: the latest ``FITTED_STEPS``), and the
        median of each width with ``MIN_FITTED_STEPS`` steps. Medians, so that a step slowed by
        another process on a shared CPU does not move them: through the raw steps, one wide
        step caught in a load spike raised the line's cost of a row enough that an n-gram
        engine stopped guessing. None with too few steps or a single width (then nothing says
        what a row costs)."""
        points = list(steps)
        if len(points) < MIN_FITTED_STEPS:
            return None
        by_width: dict[int, list[float]] = defaultdict(list)
        for rows, seconds in points:
            by_width[rows].append(seconds)
        medians = {rows: median(s) for rows, s in by_width.items()}
        n = len(points)
        mean_rows = sum(r * len(s) for r, s in by_width.items()) / n
        mean_s = sum(medians[r] * len(s) for r, s in by_width.items()) / n
        spread = sum(len(s) * (r - mean_rows) ** 2 for r, s in by_width.items())
        if spread == 0:
            return None
        per_row = max(0.0, sum(len(s) * (r - mean_rows) * (medians[r] - mean_s) for r, s in by_width.items()) / spread)
        fixed = max(mean_s - per_row * mean_rows, 1e-6)
        widths = {rows: medians[rows] for rows, s in by_width.items() if len(s) >= MIN_FITTED_STEPS}
        return cls(fixed, per_row, widths)


def update_acceptance(current: float, proposed: int, accepted: int, prior: float = ACCEPTANCE_PRIOR) -> float:
    """A request's running odds of a first guess kept, after a step that checked ``proposed`` of
    its guesses (kept: ``accepted``). A step without guesses moves it back toward the prior by
    ``RECOVERY`` of the gap: a request whose guesses stopped paying is tried again now and then,
    as its text may change."""
    if not proposed:
        return current + RECOVERY * (prior - current) if current < prior else current
    return (1 - ACCEPTANCE_WEIGHT) * current + ACCEPTANCE_WEIGHT * (1.0 if accepted else 0.0)


def update_continuation(current: float, proposed: int, accepted: int) -> float:
    """A request's running odds of a guess kept after a kept one: the guesses checked after a
    kept one are ``min(accepted + 1, proposed) - 1``, of which ``accepted - 1`` were kept."""
    checked = min(accepted + 1, proposed) - 1
    if accepted < 1 or checked < 1:
        return current
    return (1 - ACCEPTANCE_WEIGHT) * current + ACCEPTANCE_WEIGHT * (accepted - 1) / checked


def catch_up_share(rows: int, tokens_left: int) -> float:
    """What a step that starts (or resumes) a draft for a request is charged of the ``rows`` it
    must feed the draft first: paid once, it serves the guesses of the request's later steps too,
    which one step's plan cannot see, so a step carries 1/min(``CATCH_UP_STEPS``, steps left) of
    it (steps left: at most ``tokens_left``); judged against at most 32 steps, so that a draft
    that would pay only over a long future is not started on the promise of ``max_tokens``."""
    return rows / max(1, min(CATCH_UP_STEPS, tokens_left)) if rows > 0 else 0.0


def worth_a_row(gain: float, rows: int, cost: StepCost) -> bool:
    """Whether a guess adding ``gain`` expected tokens to a step of ``rows`` rows pays for its
    row at the line's cost of a row. The engine asks it with the requests' own running odds
    (``Request.acceptance``), before any lookup, and makes none where it says no: a rule of the
    policy, not a bound of the plan (the n-gram plan's odds are the engine's by match length, up
    to 0.8 after text that repeats its prompt; a fresh request's own are 0.5). Side by side on
    a shared 2-core CPU (benchmarks/speculative.py, medians of 4 runs each), without it a batch of 8 guessed
    on chat's 4-token matches at those odds, 0.94-0.99x of off's tokens/s against 0.99-1.01x
    with it, and on (a) 0.98-1.11x against 0.99-1.06x."""
    return gain > cost.per_row_s * rows / (cost.fixed_s + cost.per_row_s * rows)


ODDS_STEP = 64  # the gate's odds are rounded up to 1/this, so that a request's drifting odds ask it again rarely


class GuessGate:
    """Whether any guess could pay in the next step, asked before any proposal is looked up or
    planned: the plan of ``requests`` requests all at the best odds any of them could have
    (``first``, ``then``) and ``room`` guesses each. A plan's expected tokens only grow with its
    odds, its requests and their guesses, and a proposer's own steps only add to its cost, so
    where that plan guesses nothing no plan of the real proposals does: the step does what a step
    without speculation does (a steady batch of 8 on a 2-core CPU: 3 us of speculative work a step
    with the gate closed, 13 us with lookups that find nothing, against a step of 13-14 ms).

    The answer for the last question is kept: a steady batch that guesses nothing asks the same
    one step after step (no verify moves the odds; the cost is refitted every ``REFIT_STEPS``)."""

    def __init__(self) -> None:
        self._asked: tuple | None = None
        self._cost: StepCost | None = None  # held, so that the identity compared is never a new object's
        self._open = True

    def open(self, requests: int, rows: int, first: float, then: float, room: int, cost: StepCost) -> bool:
        asked = (requests, rows, room, math.ceil(first * ODDS_STEP), math.ceil(then * ODDS_STEP))
        if asked != self._asked or cost is not self._cost:
            best_first, best_then = min(1.0, asked[3] / ODDS_STEP), min(1.0, asked[4] / ODDS_STEP)
            self._open = any(plan_guesses([best_first] * requests, [best_then] * requests, [room] * requests,
                                          rows, cost))
            self._asked, self._cost = asked, cost
        return self._open


def plan_guesses(first: Sequence[float], then: Sequence[float], available: Sequence[int], rows: int,
                 cost: StepCost | None, round_cost: StepCost | None = None,
                 catch_up: Sequence[float] | None = None) -> list[int]:
    """Guesses per request: ``first[i]``, ``then[i]`` (request ``i``'s odds) and ``available[i]``
    (the most it can have: its proposal's length) for the requests that may speculate; ``rows``:
    the step's rows without guesses (every decode and prompt token). None unless the best number
    of guesses makes ``MIN_GAIN`` more expected tokens per second than none. Without a fitted cost
    (every step so far had one width), one guess each: the wider steps it makes are what the fit
    needs.

    ``round_cost``: a proposer's own step (a draft model's), None where guessing costs nothing
    worth counting. The draft runs only in steps that guess: the first guess of a step costs the
    draft's forward (its fixed cost, and a row for the request's newest token plus ``catch_up[i]``
    rows: the share of the tokens its KV lacks that this step is charged, :func:`catch_up_share`),
    a request's ``j``-th guess a row in the draft's ``j-1``-th decode step, and the step's fixed
    cost for the first guess that needs that step."""
    guesses = [0] * len(first)
    if cost is None:
        return [min(1, n) for n in available]
    draft_s = 0.0
    plain_rate = rows / cost.seconds(rows)
    best_rate, best_taken = plain_rate, 0
    taken: list[int] = []  # requests in the order their guesses are taken, best first
    tokens = float(rows)
    rounds_run: set[int] = set()
    def first_key(i: int, f: float) -> float:
        """A first guess's place in the order: its odds, over its cost in target rows where the
        draft must catch up first (else a costly first guess taken early spoils the others)."""
        if round_cost is None or catch_up is None or not catch_up[i]:
            return f
        return f * cost.per_row_s / (cost.per_row_s + round_cost.per_row_s * catch_up[i]) if cost.per_row_s else 0.0

    heap = [(-first_key(i, f), i, f) for i, (f, n) in enumerate(zip(first, available)) if n > 0 and f > 0]
    heapq.heapify(heap)
    while heap:
        _, i, gain = heapq.heappop(heap)
        guesses[i] += 1
        taken.append(i)
        tokens += gain
        if round_cost is not None:
            depth = guesses[i]
            behind = catch_up[i] if catch_up is not None and depth == 1 else 0.0
            draft_s += round_cost.per_row_s * (1 + behind) + (round_cost.fixed_s if depth not in rounds_run else 0.0)
            rounds_run.add(depth)
        rate = tokens / (cost.seconds(rows + len(taken)) + draft_s)
        if rate > best_rate:
            best_rate, best_taken = rate, len(taken)
        if guesses[i] < available[i] and then[i] > 0:
            heapq.heappush(heap, (-gain * then[i], i, gain * then[i]))
    guesses = [0] * len(first)
    if best_rate < plain_rate * (1 + MIN_GAIN):
        return guesses
    for i in taken[:best_taken]:
        guesses[i] += 1
    return guesses
