"""Per-request sampling parameters, validated once at the edge.

Every error names the offending field so that a bad line of an input file, or a bad gRPC
request, can be answered with a message that says what to fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from cluster.engine.request_limits import MAX_UINT32, InvalidRequestError, check_stops, clip, quote
from cluster.engine.structured.spec import StructuredOutput

__all__ = ["InvalidRequestError", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Processing order (see DESIGN.md): penalties on the logits, then temperature, then top-k,
    top-p and min-p truncation, then the draw. ``temperature == 0`` is greedy.
    ``logprobs=n`` returns the sampled token's log-probability plus the top ``n``; the values
    are those of the model's raw distribution, before any processing. ``speculative=False``
    keeps the request out of speculative decoding where the engine speculates (its tokens are
    the same either way: this only trades the guesses' rows for one token a step).
    ``structured`` holds the output to a schema, regex, grammar or choice (``structured/spec.py``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    speculative: bool = True
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        _check_int(self.max_tokens, "max_tokens", minimum=1, maximum=MAX_UINT32)
        _check_number(self.temperature, "temperature")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 means greedy), got {quote(self.temperature)}")
        _check_number(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {quote(self.top_p)}")
        _check_int(self.top_k, "top_k", minimum=0, maximum=MAX_UINT32)
        _check_number(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {quote(self.min_p)}")
        if self.seed is not None:
            _check_int(self.seed, "seed", minimum=0, maximum=2**64 - 1)
        _check_number(self.repetition_penalty, "repetition_penalty")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 means none), got {quote(self.repetition_penalty)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(value, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {quote(value)}")
        if self.logprobs is not None:
            _check_int(self.logprobs, "logprobs", minimum=0, maximum=20)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {quote(self.ignore_eos)}")
        if not isinstance(self.speculative, bool):
            raise InvalidRequestError(f"speculative must be true or false, got {quote(self.speculative)}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError(f"structured must be a StructuredOutput, got {quote(self.structured)}")
        check_stops(self.stop, self.stop_token_ids)
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative, got {quote(list(self.stop_token_ids))}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "SamplingParams":
        """Builds from a flat mapping (a JSON line), refusing keys that are not fields."""
        unknown = sorted(set(values) - cls.field_names())
        if unknown:
            raise InvalidRequestError(f"unknown sampling field(s): {clip(', '.join(map(str, unknown)))}")
        return cls(**values)


def _as_tuple(value: Any, name: str, kind: type) -> tuple:
    if isinstance(value, kind):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a list of {kind.__name__}, got {quote(value)}")
    for item in value:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise InvalidRequestError(f"{name} must be a list of {kind.__name__}, got item {quote(item)}")
    return tuple(value)


def _check_number(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {quote(value)}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _check_int(value: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {quote(value)}")
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {quote(value)}")
    if maximum is not None and value > maximum:
        raise InvalidRequestError(f"{name} must be <= {maximum}, got {quote(value)}")
