"""A step's token masks: built for its constrained rows on a thread while the forward pass
runs, then applied to the logits in one vectorised operation before sampling.

Rows are the step's sampling rows (``StepInputs.sampling_requests``): one per request, or, for
a verify (speculative decoding), one per position: the request's last token and each of its
guesses. A verify's row ``j`` is masked at the grammar's state after the first ``j`` guesses
(the guesses were cut to what the grammar accepts when they were proposed), which llguidance
computes in the same call, advancing the matcher over the guesses and rolling it back. That
call releases the GIL, so the model's step runs beside it.

The masks are packed bits, 32 tokens a word (llguidance's layout); the sampler applies them
(``bitmask.py``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch
from llguidance import LLExecutor

from cluster.engine.request import Request

from cluster.engine.structured.bitmask import BITS


@dataclass
class TokenMasks:
    """Allowed tokens of some rows: ``bitmask[i]`` (packed, int32 words) for row ``rows[i]``."""

    bitmask: torch.Tensor  # [C, words] int32, on the host until the sampler moves it
    rows: torch.Tensor  # [C] int64, rows of the step's logits
    num_rows: int  # the step's rows (all of them constrained when C == num_rows)


class StepMasks:
    """Builds steps' masks on one thread of its own (``threads``: llguidance's, for wide batches)."""

    def __init__(self, vocab_size: int, threads: int | None = None):
        self.words = -(-vocab_size // BITS)
        self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar-masks")
        self._executor = LLExecutor(num_threads=threads or max(1, min(8, (os.cpu_count() or 2) // 2)))

    def start(self, requests: Sequence[Request]) -> Future | None:
        """Starts the masks of ``requests``' constrained rows (None when no row is constrained);
        the future's result is their :class:`TokenMasks`. Nothing may advance those requests'
        matchers until it is done."""
        jobs, rows = [], []
        index = 0
        while index < len(requests):
            request, count = requests[index], 1
            while index + count < len(requests) and requests[index + count] is request:
                count += 1
            if request.grammar is not None:
                jobs.append((request.grammar.parser, len(rows), list(request.spec_token_ids[: count - 1])))
                rows.extend(range(index, index + count))
            index += count
        if not jobs:
            return None
        return self._threads.submit(self._fill, jobs, rows, len(requests))

    def _fill(self, jobs: list, rows: list[int], num_rows: int) -> TokenMasks:
        bitmask = torch.full((len(rows), self.words), -1, dtype=torch.int32)  # every row is written
        pointer, row_bytes = bitmask.data_ptr(), self.words * 4
        plain = [(parser, row) for parser, row, guesses in jobs if not guesses]
        guessed = [job for job in jobs if job[2]]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, pointer, row_bytes, len(rows))
        if guessed:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(guessed, pointer, row_bytes, len(rows))
        return TokenMasks(bitmask, torch.tensor(rows, dtype=torch.int64), num_rows)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
