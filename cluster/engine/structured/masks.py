"""A step's token masks: built for its constrained rows on a thread, off the stepping thread,
then applied to the logits in one vectorised operation before sampling.

Rows are the step's sampling rows (``StepInputs.sampling_requests``): one per request, or, for
a verify (speculative decoding), one per position: the request's last token and each of its
guesses. A verify's row ``j`` is masked at the grammar's state after the first ``j`` guesses
(the guesses were cut to what the grammar accepts when they were proposed): the matcher is
advanced over them and rolled back. llguidance releases the GIL while it computes a mask (20 us
a row on average for a nested JSON schema on the default model's tokenizer; its own thread pool
was no faster for 32 rows).

The masks of the running requests are built as soon as the step before has advanced their
matchers (:meth:`StepMasks.build_ahead`): the thread works while that step's outputs are handed
out and the next one is scheduled, when, on a CPU, the model's threads leave a core idle (its
forward pass keeps every core busy), and on a GPU beside the forward pass as well.

The masks are packed bits, 32 tokens a word (llguidance's layout); the sampler applies them
(``bitmask.py``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from cluster.engine.request import Request, row_runs
from cluster.engine.structured.bitmask import BITS


@dataclass
class TokenMasks:
    """Allowed tokens of some rows: ``bitmask[i]`` (packed, int32 words) for row ``rows[i]``."""

    bitmask: torch.Tensor  # [C, words] int32, on the host until the sampler moves it
    rows: torch.Tensor  # [C] int64, rows of the step's logits
    num_rows: int  # the step's rows (all of them constrained when C == num_rows)


class StepMasks:
    """Builds steps' masks on one thread of its own. The masks of a step's constrained decodes are
    built ahead, as soon as the step before has advanced their matchers (:meth:`build_ahead`):
    the thread then works while that step's outputs are handed out and the next one is scheduled,
    when the model's threads leave a core idle, and the next step only assembles them (and builds
    those of rows it did not foresee: prompts finishing, requests that joined)."""

    def __init__(self, vocab_size: int):
        self.words = -(-vocab_size // BITS)
        self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar-masks")
        self._ahead: Future | None = None

    def build_ahead(self, running: Iterable[Request]) -> None:
        """Starts the masks of the running constrained requests' next rows (their matchers and
        guesses as they are now). Nothing may advance those matchers until the next :meth:`start`'s
        future is done."""
        wanted = [(r, list(r.spec_token_ids)) for r in running if r.grammar is not None]
        self._ahead = self._threads.submit(self._build, wanted) if wanted else None

    def start(self, requests: Sequence[Request]) -> Future | None:
        """Starts the masks of ``requests``' constrained rows; the future's result is their
        :class:`TokenMasks` (None when no row is constrained; no future when, besides, nothing was
        built ahead). No matcher may be used until it is done."""
        groups = [run for run in row_runs(requests) if run[0].grammar is not None]  # (request, first row, rows)
        ahead, self._ahead = self._ahead, None
        if not groups:  # none constrained; masks built ahead for requests not sampled this step go unused
            return None if ahead is None else self._threads.submit(_nothing)  # done once ``ahead`` is
        if ahead is None or ahead.done():
            built = ahead.result() if ahead is not None else {}
            if all(_still_fits(built.get(id(request)), request, count) for request, _, count in groups):
                ready = Future()  # all built ahead: assembled here, without a hop to the thread and back
                ready.set_result(self._assemble(groups, len(requests), built))
                return ready
        return self._threads.submit(self._complete, groups, len(requests), ahead)

    def _complete(self, groups: list, num_rows: int, ahead: Future | None) -> TokenMasks:
        """Builds the masks ``ahead`` lacks (it is done: it ran before, on this thread) and assembles."""
        built = ahead.result() if ahead is not None else {}
        missing = [(request, list(request.spec_token_ids[: count - 1])) for request, _, count in groups
                   if not _still_fits(built.get(id(request)), request, count)]
        if missing:
            built.update(self._build(missing))
        return self._assemble(groups, num_rows, built)

    @staticmethod
    def _assemble(groups: list, num_rows: int, built: dict) -> TokenMasks:
        blocks = [built[id(request)][3][:count] for request, _, count in groups]
        rows = [row for _, first, count in groups for row in range(first, first + count)]
        return TokenMasks(torch.cat(blocks), torch.tensor(rows, dtype=torch.int64), num_rows)

    def _build(self, wanted: list[tuple[Request, list[int]]]) -> dict:
        """``{id(request): (request, its output length, guesses, [1 + guesses, words] masks)}``."""
        bitmask = torch.full((sum(1 + len(guesses) for _, guesses in wanted), self.words), -1, dtype=torch.int32)
        pointer, row_bytes = bitmask.data_ptr(), self.words * 4
        built, row = {}, 0
        for request, guesses in wanted:
            parser = request.grammar.parser
            parser.unsafe_compute_mask_ptr(pointer + row * row_bytes, row_bytes)  # each releases the GIL
            taken = 0
            for guess in guesses:  # checked when proposed: each is accepted (the rows past one that
                if not parser.consume_token(guess):  # were not could not be kept: left all allowed)
                    break
                taken += 1
                parser.unsafe_compute_mask_ptr(pointer + (row + taken) * row_bytes, row_bytes)
            if taken:
                parser.rollback(taken)
            built[id(request)] = (request, request.num_output_tokens, guesses, bitmask[row: row + 1 + len(guesses)])
            row += 1 + len(guesses)
        return built

    def close(self) -> None:
        self._threads.shutdown(wait=True)


def _nothing() -> None:
    return None


def _still_fits(entry: tuple | None, request: Request, rows: int) -> bool:
    """Masks built ahead serve this step's ``rows`` of ``request``: built for this very request,
    its matcher not advanced since, and its guesses those it had (the step keeps a prefix of them)."""
    if entry is None or entry[0] is not request or entry[1] != request.num_output_tokens:
        return False
    guesses = entry[2]
    return len(guesses) >= rows - 1 and guesses[: rows - 1] == request.spec_token_ids[: rows - 1]
