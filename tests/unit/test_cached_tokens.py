"""A request's ``cached_tokens`` counts the prompt tokens its last placement did not compute: a
prefill worker's own cache hits where that worker computed the prompt (blocks the decode worker
held spared only their transfer), the decode worker's hits (either tier, or pulled) where it
prefilled the prompt itself."""

from __future__ import annotations

import pytest

from cluster.ingress.request_path import Attempt, Journey, cached_prompt_tokens
from cluster.protocol.messages import Finished, TransferReport, Usage
from router.router import Decision

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0


def attempt(prefill: str | None, transfer: TransferReport | None = None) -> Attempt:
    decision = Decision("place", "r1", prefill, "decode-0", "standard", 5.0, 0.25)
    return Attempt(T0, T0 + 0.01, decision, transfer)


def transfer(prefill_cached_tokens: int, blocks_cached_on_decode: int) -> TransferReport:
    return TransferReport(prefill="prefill-0", blocks_cached_on_decode=blocks_cached_on_decode, blocks_sent=2,
                          prefill_cached_tokens=prefill_cached_tokens, bytes=1, prefill_span=(T0, T0 + 0.1),
                          receive_span=(T0, T0 + 0.1), admitted_at=T0 + 0.1)


def finished(decode_cached: int) -> Finished:
    return Finished("length", Usage(prompt_tokens=96, cached_tokens=decode_cached, completion_tokens=4))


def test_a_remote_prefill_counts_the_prefill_workers_hits():
    journey = Journey("r1", T0, 96)
    # The decode worker held 4 blocks (64 tokens) and took 2 more; the prefill worker had 48
    # tokens cached and computed the other 48: 48 were not computed, not 64.
    journey.attempts.append(attempt("prefill-0", transfer(48, 4)))
    assert cached_prompt_tokens(journey, finished(64)) == 48


def test_a_local_prefill_counts_the_decode_workers_hits():
    journey = Journey("r1", T0, 96)
    journey.attempts.append(attempt(None))
    assert cached_prompt_tokens(journey, finished(80)) == 80


def test_the_last_placement_counts_after_a_move():
    journey = Journey("r1", T0, 96)
    journey.attempts.append(attempt("prefill-0", transfer(32, 0)))  # failed, then placed again ...
    journey.attempts.append(attempt(None))  # ... on a decode worker that prefilled it itself
    assert cached_prompt_tokens(journey, finished(16)) == 16
    assert cached_prompt_tokens(Journey("r2", T0, 96), finished(16)) == 16  # never placed: the engine's count
