"""What a verified step emits for one request."""

from __future__ import annotations

from typing import Sequence


def accepted_prefix(sampled: Sequence[int], proposed: Sequence[int]) -> list[int]:
    """``sampled[j]`` is the target's token after the request's tokens and ``proposed[:j]``
    (``len(proposed) + 1`` rows). The step emits the samples while each equals the guess it
    checks, then the first that does not (or, all guesses kept, the last row's: one more)."""
    emitted = []
    for j, token in enumerate(sampled):
        emitted.append(token)
        if j >= len(proposed) or token != proposed[j]:
            break
    return emitted
