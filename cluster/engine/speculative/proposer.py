"""Where guesses come from: one small interface, the n-gram lookup and a draft model behind it
(an EAGLE or MTP head would be a third: its ``propose`` would read the target's hidden states).

After each target step the engine asks ``best_first_odds`` the best odds any decoding request's
first guess could have (where even those could not pay, no proposal is looked up), then
``available`` how many guesses each decoding request could get and ``first_odds`` how likely each
one's first guess is to be kept, the policy (``policy.py``) chooses how many it gets (counting
``round_cost``, what each round of guessing costs, and ``catch_up``, what a proposer must feed
before a request's first guess), the engine holds cache slots for them where ``writes_kv`` (a
model that writes its guesses' KV), and ``propose`` makes them. ``propose`` is called after every
step, with no request where none guesses (a model catches its KV up when guessing resumes). Each
verify's outcome is reported back (``observe``)."""

from __future__ import annotations

from typing import Protocol, Sequence

from cluster.engine.request import Request
from cluster.engine.scheduler import SchedulerOutput
from cluster.engine.speculative.config import SpeculativeConfig
from cluster.engine.speculative.ngram import NgramIndex
from cluster.engine.speculative.policy import ACCEPTANCE_PRIOR, StepCost

MATCH_WEIGHT = 0.1  # weight of a verify in its match length's running odds (the engine's: many verifies)


class Proposer(Protocol):
    writes_kv: bool

    def available(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[int]:
        """How many guesses each request could be given (at most its room)."""

    def first_odds(self, requests: Sequence[Request]) -> list[float]:
        """The odds that each request's first guess (of the proposal ``available`` found) is kept."""

    def best_first_odds(self, requests: Sequence[Request]) -> float:
        """The highest odds ``first_odds`` could give any of ``requests``, known without looking
        up their proposals (the policy's ``GuessGate`` asks it before any lookup)."""

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        """A verify of ``request`` checked ``proposed`` of its guesses and kept ``accepted``."""

    def propose(self, step: SchedulerOutput, requests: Sequence[Request], counts: Sequence[int]) -> list[list[int]]:
        """``counts[i]`` guesses for ``requests[i]``, after the target's ``step``."""

    def catch_up(self, requests: Sequence[Request]) -> list[int]:
        """Per request, the tokens it must feed before its first guess beyond the newest one
        (a model's KV of the prompt, or of what was made while the request did not guess)."""

    def round_cost(self, target: StepCost | None) -> StepCost | None:
        """What one round of guesses costs (a model's step; ``target``: the engine's own fitted
        step, for an estimate before the proposer's steps are measured), None where it is not
        worth counting."""


class NgramProposer:
    """Prompt lookup (``ngram.py``): each request's index, kept in ``Request.proposer_state``.

    How often a first guess is kept depends most on how long a suffix it matched (text that
    repeats its prompt: 24% after one token, 40% after two, 73% after three, 87% after four), so
    a proposal's odds are the engine's running odds for its match length (a request's own running
    odds mixed its long matches with its short ones: after 1-token matches failed, its 4-token
    ones went unguessed)."""

    writes_kv = False

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._proposals: dict[int, list[int]] = {}
        self.first_by_match = {n: ACCEPTANCE_PRIOR for n in range(config.ngram_min, config.ngram_max + 1)}

    def available(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[int]:
        self._proposals = {}
        for request, room in zip(requests, rooms):
            if request.proposer_state is None:
                request.proposer_state = NgramIndex(self.config.ngram_min, self.config.ngram_max)
            self._proposals[id(request)] = request.proposer_state.propose(request.token_ids, room)
        return [len(self._proposals[id(r)]) for r in requests]

    def first_odds(self, requests: Sequence[Request]) -> list[float]:
        return [self.first_by_match.get(r.proposer_state.matched, 0.0) for r in requests]

    def best_first_odds(self, requests: Sequence[Request]) -> float:
        return max(self.first_by_match.values())  # whatever length each lookup would match

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        matched = request.proposer_state.matched if request.proposer_state is not None else 0
        if matched in self.first_by_match:  # the verify checks the proposal the index made last
            kept = 1.0 if accepted else 0.0
            self.first_by_match[matched] += MATCH_WEIGHT * (kept - self.first_by_match[matched])

    def propose(self, step: SchedulerOutput, requests: Sequence[Request], counts: Sequence[int]) -> list[list[int]]:
        return [self._proposals[id(r)][:n] for r, n in zip(requests, counts)]

    def catch_up(self, requests: Sequence[Request]) -> list[int]:
        return [0] * len(requests)  # the index extends itself over new tokens in the lookup

    def round_cost(self, target: StepCost | None) -> StepCost | None:
        return None  # a few dictionary lookups
