"""A request's state inside the engine: its tokens, how many have KV computed, its blocks."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from cluster.engine.block_hash import BlockHash
from cluster.engine.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RECEIVING = "receiving"  # decode side of disaggregation: blocks held, KV arriving from a prefill worker
    LOADING = "loading"  # in the waiting queue, blocks held, its prefix being loaded from the host KV tier
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class TransferTarget:
    """Where a prefill worker streams this request's KV: a pair (transfer group), the tags of
    the stream, and how many leading blocks the decode side already holds. ``streaming=False``
    sends the whole request after its forward pass instead of layer by layer (for comparison).
    ``draft_first_block``: None, or the prefill side also builds its draft model's KV of the
    prompt and sends it from that block on (the blocks before it hold the decode side's draft
    KV already): the decode side's draft then guesses without catching up on the prompt."""

    pair: str
    tag_base: int
    first_block: int = 0
    timeout_s: float = 60.0
    streaming: bool = True
    draft_first_block: int | None = None


@dataclass(eq=False)
class Request:
    """``token_ids`` holds the prompt followed by the output; ``num_computed_tokens`` of them
    have KV in ``block_ids``. A step moves that count forward by the tokens it schedules."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    generator: Any = None
    transfer: TransferTarget | None = None

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)
    block_ids: list[int] = field(default_factory=list, init=False)
    block_hashes: list[BlockHash] = field(default_factory=list, init=False)
    num_registered_blocks: int = field(default=0, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    logprobs: list[float] = field(default_factory=list, init=False)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list, init=False)
    times: RequestTimes = field(init=False)
    order: tuple[int, float, int] = field(init=False)
    # Speculative decoding (cluster/engine/speculative): the guesses the next step checks, the
    # running odds that its first guess is kept and that a guess after a kept one is (policy.py),
    # its proposer's index, and its counts.
    spec_token_ids: list[int] = field(default_factory=list, init=False)
    acceptance: float = field(default=0.5, init=False)
    continuation: float = field(default=0.7, init=False)
    proposer_state: Any = field(default=None, init=False)
    num_proposed_tokens: int = field(default=0, init=False)
    num_accepted_tokens: int = field(default=0, init=False)
    # Constrained decoding (cluster/engine/structured): the request's place in its grammar.
    grammar: Any = field(default=None, init=False)
    # The host KV tier: the index of the first of its blocks whose load failed, and why.
    load_failure: tuple[int, str] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.times = RequestTimes(arrival=self.arrival_time)
        self.order = (-self.priority, self.arrival_time, next(_arrival_counter))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def row_runs(requests: Sequence[Request]) -> list[tuple[Request, int, int]]:
    """A step's sampled rows as ``(request, first row, rows)``, in row order: a verifying request
    has one row per guess after its first (consecutive), any other request one."""
    runs = []
    row = 0
    while row < len(requests):
        request, count = requests[row], 1
        while row + count < len(requests) and requests[row + count] is request:
            count += 1
        runs.append((request, row, count))
        row += count
    return runs
