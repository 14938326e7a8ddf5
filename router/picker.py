"""The picker: ranks the scored candidates, and under admission control picks the best one that
meets the request's objectives, or says why none can.

Candidates whose decode worker has room are ranked (all of them when none has); ties on score go
to the sooner first token, then to fewer hops (a decode worker prefilling itself).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from router.candidates import Candidate
from router.config import SloClass
from router.scorers import score_all


def with_room(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates whose decode worker has room now (empty when none has)."""
    return [c for c in candidates if c.decode_has_room]


def without_room(chosen: Candidate, ranked: Sequence[Candidate]) -> Candidate | None:
    """Where a best-effort request goes when its choice has no room now: a local prefill waits
    in the decode worker's queue (the best ranked that prefills itself); where its KV must be
    reserved up front (a remote prefill's, a pull's), the decode worker would answer that it
    has no blocks, so it waits in the router (None) until a request ends and frees some. What
    no worker could ever hold is placed as chosen."""
    if chosen.decode_has_room:
        return chosen
    local = next((c for c in ranked if c.prefill is None and c.kv_source is None), None)
    if local is not None:
        return local
    return None if chosen.decode_room_later else chosen


def rank(candidates: Sequence[Candidate], weights: Mapping[str, float], cls: SloClass) -> list[Candidate]:
    """Scores the candidates with room (all of them when none has) and orders them best first."""
    eligible = with_room(candidates) or candidates
    score_all(eligible, dict(weights), (cls.ttft_s, cls.tpot_s))
    return sorted(eligible, key=lambda c: (-c.score, c.ttft_s, c.prefill is not None))


def meets(ttft_s: float, tpot_s: float, cls: SloClass) -> bool:
    return (cls.ttft_s is None or ttft_s <= cls.ttft_s) and (cls.tpot_s is None or tpot_s <= cls.tpot_s)


def within_headroom(c: Candidate) -> bool:
    """Its decode worker keeps the TPOT headroom a tighter class needs (``router/class_headroom.py``)."""
    return c.tpot_limit_s is None or c.tpot_s <= c.tpot_limit_s


def room_within_headroom(c: Candidate) -> bool:
    """It has room now and keeps a tighter class's headroom."""
    return c.decode_has_room and within_headroom(c)


def serves_in_time(c: Candidate, cls: SloClass, spent_s: float) -> bool:
    """It has room, serves the request in time counting ``spent_s``, and keeps a tighter class's headroom."""
    return c.decode_has_room and meets(c.ttft_s + spent_s, c.tpot_s, cls) and within_headroom(c)


def first_meeting(ranked: Sequence[Candidate], cls: SloClass, spent_s: float) -> Candidate | None:
    """The best candidate that ``serves_in_time``."""
    return next((c for c in ranked if serves_in_time(c, cls, spent_s)), None)


def first_within_headroom(ranked: Sequence[Candidate]) -> Candidate:
    """A request without objectives: the best with ``room_within_headroom``, else the best."""
    return next((c for c in ranked if room_within_headroom(c)), ranked[0])


def never_meets(candidates: Sequence[Candidate], cls: SloClass, spent_s: float) -> bool:
    """Not even an idle cluster could serve it in time: waiting would not help."""
    return not any(meets(c.idle_ttft_s + spent_s, c.idle_tpot_s, cls) for c in candidates)


def fastest(ranked: Sequence[Candidate]) -> Candidate:
    """The candidate predicting the least TTFT + TPOT (the best ranked among equals)."""
    return min(ranked, key=lambda c: c.ttft_s + c.tpot_s)


def explain(cls: SloClass, c: Candidate, never: bool, spent: float = 0.0, full: bool = False) -> str:
    """Why the request cannot be served in time now, with ``c``'s predictions."""
    def ms(seconds: float | None) -> str:
        return "none" if seconds is None else f"{seconds * 1000:.0f} ms"

    if never:
        state = "even an idle cluster cannot meet"
    elif full:
        state = "no decode worker has a free slot and KV blocks now for"
    else:
        state = "no (prefill, decode) pair can meet now"
    waited = f"waited {ms(spent)} + " if spent else ""
    kept = (f"; a tighter class runs on {c.decode} or is arriving, so looser ones keep its TPOT within "
            f"{ms(c.tpot_limit_s)} (router.class_headroom)" if not within_headroom(c) else "")
    return (f"{state} slo_class {cls.name!r} (TTFT <= {ms(cls.ttft_s)}, TPOT <= {ms(cls.tpot_s)}): the best, "
            f"{c.label}, predicts TTFT {waited}{ms(c.ttft_s)} (queue {ms(c.queue_s)} + prefill {ms(c.prefill_s)} + "
            f"transfer {ms(c.transfer_s)}{f' + call {ms(c.call_s)}' if c.call_s else ''}) and TPOT {ms(c.tpot_s)}; "
            f"idle, TTFT {ms(c.idle_ttft_s)} and TPOT {ms(c.idle_tpot_s)}{kept}")
