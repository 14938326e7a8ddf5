"""How an engine speculates: one frozen, validated object (``EngineConfig.speculative``)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.request_limits import quote

METHODS = ("ngram",)  # "draft" (a smaller model's guesses) is not served yet: refused, not ignored
MAX_NUM_TOKENS = 16
MAX_NGRAM = 64  # the longest suffix looked up


class SpeculativeConfigError(ValueError):
    """A speculative setting that cannot work; the message names it."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_tokens``: the most tokens guessed for a request in one step; ``adaptive``: the
    policy (``policy.py``) guesses fewer, or none, where guessing would not pay (off: every
    proposal is checked in full, up to ``num_tokens``); ``ngram_min``..``ngram_max``: the lengths
    of the suffix looked up earlier in the request's tokens, longest first."""

    method: str = "ngram"
    num_tokens: int = 4
    adaptive: bool = True
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            extra = " (draft models are not served yet)" if self.method == "draft" else ""
            raise SpeculativeConfigError(
                f"speculative.method must be one of {', '.join(METHODS)}, got {quote(self.method)}{extra}")
        for name, low, high in (("num_tokens", 1, MAX_NUM_TOKENS), ("ngram_min", 1, MAX_NGRAM), ("ngram_max", 1, MAX_NGRAM)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise SpeculativeConfigError(f"speculative.{name} must be an integer in [{low}, {high}], got {quote(value)}")
        if not isinstance(self.adaptive, bool):
            raise SpeculativeConfigError(f"speculative.adaptive must be true or false, got {quote(self.adaptive)}")
        if self.ngram_min > self.ngram_max:
            raise SpeculativeConfigError(
                f"speculative.ngram_min ({self.ngram_min}) must not exceed speculative.ngram_max ({self.ngram_max})")
