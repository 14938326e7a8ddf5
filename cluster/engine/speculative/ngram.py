"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the
request's last n tokens (n from ``ngram_max`` down to ``ngram_min``), in its prompt or output.

Each request keeps an index of where each n-gram was last followed, extended by the tokens
appended since the last proposal, so a proposal costs a few dictionary lookups however long the
request is (searching 2,048 tokens of each of 32 requests every step would cost milliseconds).
"""

from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """For each n, the position after the latest occurrence of each n-gram that has a token
    after it. The request's last n tokens are never their own match: their follower is unknown."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # followers recorded for positions < indexed
        self.matched = 0  # the length of the suffix the latest proposal matched (0: none)

    def extend(self, tokens: Sequence[int]) -> None:
        for position in range(max(self.indexed, 1), len(tokens)):
            for n, table in self.tables.items():
                if position >= n:
                    table[tuple(tokens[position - n: position])] = position
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``tokens`` (the index extended over them first)."""
        self.extend(tokens)
        for n in self.sizes:
            if len(tokens) > n:
                follower = self.tables[n].get(tuple(tokens[-n:]))
                if follower is not None:
                    self.matched = n
                    return list(tokens[follower: follower + k])
        self.matched = 0
        return []
