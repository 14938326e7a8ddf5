"""Scorers: each rates one candidate placement (:class:`router.candidates.Candidate`) with a
number in [0, 1]; a policy weighs them (``router.weights``, presets in ``router/config.py``).

Scorers see every candidate of the request at once (a :class:`CandidateSet`), so that relative
ones (load) can normalise across them. They run after the filters (``router/filters.py``) and
before the picker (``router/picker.py``).
"""

from __future__ import annotations

from typing import Callable, Sequence

from router.candidates import Candidate


class CandidateSet:
    """The candidates of one request, with what relative scorers need of all of them computed
    once (scoring every candidate against every other would cost the square of their number)."""

    def __init__(self, candidates: Sequence[Candidate]):
        self.candidates = candidates
        self.most_queued = max((x.prefill_queue_tokens for x in candidates), default=0)
        self.most_loaded = max((x.decode_load for x in candidates), default=0.0)


def round_robin(c: Candidate, _every: CandidateSet, _objectives) -> float:
    return 1.0 if c.rotation_slot else 0.0


def least_loaded(c: Candidate, every: CandidateSet, _objectives) -> float:
    most_queued, most_loaded = every.most_queued, every.most_loaded
    prefill = c.prefill_queue_tokens / most_queued if most_queued else 0.0
    decode = c.decode_load / most_loaded if most_loaded else 0.0
    return 1.0 - 0.5 * (prefill + decode)


def prefix_affinity(c: Candidate, _every: CandidateSet, _objectives) -> float:
    """Cache reuse: mostly the prefill side's (compute saved), partly the decode side's
    (transfer saved). A host-tier block counts for what its load saves of its recompute
    (``Candidate.prefill_host_worth``), a device block fully."""
    if not c.cacheable_blocks:
        return 0.0
    prefill = c.prefill_hit_blocks - c.prefill_host_blocks * (1.0 - c.prefill_host_worth)
    decode = c.decode_hit_blocks - c.decode_host_blocks * (1.0 - c.decode_host_worth)
    return (0.75 * prefill + 0.25 * decode) / c.cacheable_blocks


def slo_headroom(c: Candidate, _every: CandidateSet, objectives: tuple[float | None, float | None]) -> float:
    """1 with all the objectives' time to spare, 0 at or past them; with no objective, a
    predicted second counts as half the room."""

    def used(predicted: float, objective: float | None) -> float:
        return min(1.0, predicted / objective) if objective else predicted / (predicted + 1.0)

    ttft_objective, tpot_objective = objectives
    return 1.0 - 0.5 * (used(c.ttft_s, ttft_objective) + used(c.tpot_s, tpot_objective))


SCORER_FUNCTIONS: dict[str, Callable[[Candidate, CandidateSet, tuple], float]] = {
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "prefix_affinity": prefix_affinity,
    "slo_headroom": slo_headroom,
}


def score_all(candidates: Sequence[Candidate], weights: dict[str, float],
              objectives: tuple[float | None, float | None]) -> None:
    """Sets each candidate's ``scores`` (by scorer) and ``score`` (their weighted mean)."""
    total = sum(weights.values())
    every = CandidateSet(candidates)
    scorers = [(name, weight, SCORER_FUNCTIONS[name]) for name, weight in weights.items() if weight]
    for c in candidates:
        scores, score = {}, 0  # summed in the weights' order, as sum() would
        for name, weight, scorer in scorers:
            scores[name] = s = scorer(c, every, objectives)
            score += weight * s
        c.scores, c.score = scores, score / total
