"""Where guesses come from: one small interface, the n-gram lookup and a draft model behind it
(an EAGLE or MTP head would be a third: its ``propose`` would read the target's hidden states).

After each target step the engine asks ``available`` how many guesses each decoding request
could get, the policy (``policy.py``) chooses how many it gets (counting ``round_cost``, what each
round of guessing costs), the engine holds cache slots for them where ``writes_kv`` (a model that
writes its guesses' KV), and ``propose`` makes them. ``propose`` is called after every step, with
no request where none guesses: a model follows the target's step there (its own KV)."""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from cluster.engine.request import Request
from cluster.engine.scheduler import SchedulerOutput
from cluster.engine.speculative.config import SpeculativeConfig
from cluster.engine.speculative.ngram import NgramIndex
from cluster.engine.speculative.policy import StepCost


class Proposer(Protocol):
    writes_kv: bool

    def available(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[int]:
        """How many guesses each request could be given (at most its room)."""

    def propose(self, step: SchedulerOutput, held: Mapping[int, list[int]], requests: Sequence[Request],
                counts: Sequence[int]) -> list[list[int]]:
        """``counts[i]`` guesses for ``requests[i]``, after the target's ``step`` (``held``: the
        block ids each of its requests held in it, by ``id(request)``, finished ones included)."""

    def round_cost(self) -> StepCost | None:
        """What one round of guesses costs (a model's step), None where it is not worth counting."""


class NgramProposer:
    """Prompt lookup (``ngram.py``): each request's index, kept in ``Request.proposer_state``."""

    writes_kv = False

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._proposals: dict[int, list[int]] = {}

    def available(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[int]:
        self._proposals = {}
        for request, room in zip(requests, rooms):
            if request.proposer_state is None:
                request.proposer_state = NgramIndex(self.config.ngram_min, self.config.ngram_max)
            self._proposals[id(request)] = request.proposer_state.propose(request.token_ids, room)
        return [len(self._proposals[id(r)]) for r in requests]

    def propose(self, step: SchedulerOutput, held: Mapping[int, list[int]], requests: Sequence[Request],
                counts: Sequence[int]) -> list[list[int]]:
        return [self._proposals[id(r)][:n] for r, n in zip(requests, counts)]

    def round_cost(self) -> StepCost | None:
        return None  # a few dictionary lookups
