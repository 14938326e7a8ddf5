"""Re-measuring the prefill path not taken: a short prompt that a decode worker may prefill
itself has two paths (``local`` or ``remote`` prefill), and each is predicted from what was
measured of it; a path not taken is never measured again.

Its prediction then rests on what it was before: the decode worker's prefill fit from its
start-up profile (its reported prefill steps are the profile's until it prefills something) and
the other path's correction (``Router.correction``). On the CPU quick start such fits put the
decode worker's prefill of the benchmark's cached prompt's last 4 tokens at 50-84 ms (the
profile's prompts of 16 tokens and more, and its decode batch's 2,048-token step, bend the line at
the short end); after three local prefills of its own its fit said 5 ms. So every short prompt of
a start went to the prefill worker (remote predicted 15-36 ms, client TTFT p50 28-37 ms) where
another start's fits kept them local (15 ms): whichever path a start's first prediction favoured
was kept for good.

So one placement in ``REMEASURE_EVERY`` goes to the best candidate of the path not taken for
that long, when it could serve the request as the chosen one does (room, objectives, headroom)
and is predicted at most ``REMEASURE_MARGIN_S`` later (what a wrong guess may cost, once in
``REMEASURE_EVERY``). One sample cannot mend the path's prediction (a correction takes off at
most half a prediction, and the worker's fit keeps 16 prefill steps), so a re-measured path that
served its request sooner than the candidate it displaced was predicted to is taken again, each
time a re-measure, until it no longer is (or its prediction wins by itself, as it does once its
own live steps replace the profile's in its worker's fit). A path measured slower is left for
another ``REMEASURE_EVERY`` placements.
"""

from __future__ import annotations

from typing import Callable, Sequence

from router.candidates import Candidate

# Placements a path may go untaken before one is placed on it to measure it. At 16, a start of the
# one-stream benchmark whose first prediction favoured remote prefill placed 17 of its 31 prompts
# remotely before local was measured (and kept: 15 local, TTFT p50 20.6 ms); a start favouring
# local pays a remote prefill (+10-15 ms on this CPU) once in this many + 1.
REMEASURE_EVERY = 8
REMEASURE_MARGIN_S = 0.1  # ... if it is predicted at most this much later than the chosen candidate


def path_of(c: Candidate) -> str:
    return "local" if c.prefill is None else "remote"


class PathRemeasure:
    """Per path: placements since it was last taken, and whether its latest re-measure beat
    the prediction of the candidate it displaced (then it is taken again)."""

    def __init__(self, every: int = REMEASURE_EVERY, margin_s: float = REMEASURE_MARGIN_S):
        self.every, self.margin_s = every, margin_s
        self.untaken = {"local": 0, "remote": 0}
        self.faster: set[str] = set()

    def pick(self, chosen: Candidate, ranked: Sequence[Candidate], serves: Callable[[Candidate], bool]
             ) -> Candidate | None:
        """The candidate of the other path to place instead of ``chosen`` (None: ``chosen``):
        the best ranked of it that ``serves`` the request, when that path is due a re-measure
        or measured faster last time, ``chosen`` serves it too, and it is predicted within the margin."""
        other = "remote" if path_of(chosen) == "local" else "local"
        if other not in self.faster and self.untaken[other] < self.every:
            return None  # asked first: most placements stop here
        if not serves(chosen):
            return None
        alt = next((c for c in ranked if path_of(c) == other and serves(c)), None)
        if alt is None or alt.ttft_s > chosen.ttft_s + self.margin_s:
            return None
        return alt

    def placed(self, c: Candidate) -> None:
        taken = path_of(c)
        self.untaken[taken] = 0
        other = "remote" if taken == "local" else "local"
        self.untaken[other] += 1

    def measured(self, path: str, service_ttft_s: float, displaced_ttft_s: float) -> None:
        """A re-measure of ``path`` ended: its TTFT after placement against the predicted TTFT
        of the candidate it displaced."""
        if service_ttft_s < displaced_ttft_s:
            self.faster.add(path)
        else:
            self.faster.discard(path)
