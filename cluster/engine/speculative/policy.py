"""How many guesses each request gets in the next step: as many as raise the step's expected
tokens per second, from the engine's measured step times and each request's measured acceptance.

A step of ``R`` rows takes about ``fixed + per_row * R`` seconds (fitted to the engine's recent
steps, start-up profile included). A request whose guesses are each kept with probability ``a``
emits ``1 + a + a^2 + ... + a^k`` tokens for ``k`` guesses, so its ``j``-th guess adds ``a^j``
expected tokens and one row. Guesses are added best first while each adds more tokens than the
rows it costs are worth at the current rate (``gain > per_row * tokens / seconds``): at batch 1
on a CPU a row is cheap against the step's fixed cost and a well-guessed request gets several;
in a wide batch the step is already compute-bound and a guess must be nearly sure to be made.
A draft model's guesses also cost its own steps (``round_cost`` in :func:`plan_guesses`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence

ACCEPTANCE_PRIOR = 0.5  # a request's acceptance before any of its guesses were checked
ACCEPTANCE_WEIGHT = 0.3  # weight of the latest step in a request's running acceptance
RECOVERY = 0.05  # per step without guesses, of the gap back to the prior
FITTED_STEPS = 256  # the most recent steps the step cost is fitted to ...
REFIT_STEPS = 16  # ... every this many steps
MIN_FITTED_STEPS = 4


@dataclass(frozen=True)
class StepCost:
    fixed_s: float
    per_row_s: float

    @classmethod
    def fit(cls, steps: Iterable[tuple[int, float]]) -> "StepCost | None":
        """Least squares of seconds on rows over ``(rows, seconds)`` (the caller picks the steps:
        the latest ``FITTED_STEPS``); None with too few steps or a single width (then nothing
        says what a row costs)."""
        points = list(steps)
        if len(points) < MIN_FITTED_STEPS:
            return None
        n = len(points)
        mean_rows = sum(r for r, _ in points) / n
        mean_s = sum(s for _, s in points) / n
        spread = sum((r - mean_rows) ** 2 for r, _ in points)
        if spread == 0:
            return None
        per_row = max(0.0, sum((r - mean_rows) * (s - mean_s) for r, s in points) / spread)
        fixed = max(mean_s - per_row * mean_rows, 1e-6)
        return cls(fixed, per_row)


def update_acceptance(current: float, proposed: int, accepted: int) -> float:
    """A request's running acceptance after a step that checked ``proposed`` of its guesses.
    A step without guesses moves it back toward the prior by ``RECOVERY`` of the gap: a request
    whose guesses stopped paying is tried again now and then, as its text may change."""
    if not proposed:
        return current + RECOVERY * (ACCEPTANCE_PRIOR - current) if current < ACCEPTANCE_PRIOR else current
    return (1 - ACCEPTANCE_WEIGHT) * current + ACCEPTANCE_WEIGHT * accepted / proposed


def worth_a_row(gain: float, rows: int, cost: StepCost) -> bool:
    """Whether a guess adding ``gain`` expected tokens to a step of ``rows`` rows pays for its row."""
    return gain > cost.per_row_s * rows / (cost.fixed_s + cost.per_row_s * rows)


def plan_guesses(acceptance: Sequence[float], available: Sequence[int], rows: int,
                 cost: StepCost | None, round_cost: StepCost | None = None) -> list[int]:
    """Guesses per request: ``acceptance[i]`` and ``available[i]`` (the most request ``i`` can
    have: its proposal's length) for the requests that may speculate; ``rows``: the step's rows
    without guesses (every decode and prompt token). Without a fitted cost (every step so far
    had one width), one guess each: the wider steps it makes are what the fit needs.

    ``round_cost``: a proposer's own step (a draft model's), None where guessing costs nothing
    worth counting. A request's first guess comes from the forward the draft runs after every
    step anyway (its cost: a row there, and the draft's fixed cost is counted in the step's);
    its ``j``-th guess needs the draft's ``j-1``-th decode step: a row in it, and the step's
    fixed cost for the first guess that needs that step. A guess not worth what it costs drops
    its request; others may still pay (a step already run costs them only a row)."""
    guesses = [0] * len(acceptance)
    if cost is None:
        return [min(1, n) for n in available]
    tokens = float(rows)
    seconds = cost.fixed_s + cost.per_row_s * rows + (round_cost.fixed_s if round_cost else 0.0)
    rounds_run: set[int] = set()
    heap = [(-a, i) for i, (a, n) in enumerate(zip(acceptance, available)) if n > 0 and a > 0]
    heapq.heapify(heap)
    while heap:
        gain, i = heapq.heappop(heap)
        gain = -gain
        depth = guesses[i] + 1
        extra = cost.per_row_s
        if round_cost is not None:
            extra += round_cost.per_row_s + (round_cost.fixed_s if depth > 1 and depth not in rounds_run else 0.0)
        if gain <= extra * tokens / seconds:  # the rate is tokens / seconds, not rows / seconds
            if round_cost is None:
                break  # the best remaining guess is worth less than the row it takes
            continue
        guesses[i] += 1
        rounds_run.add(depth)
        tokens += gain
        seconds += extra
        if guesses[i] < available[i]:
            heapq.heappush(heap, (-gain * acceptance[i], i))
    return guesses
