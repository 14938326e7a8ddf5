"""What one request may carry, and how much of a user's input an error message repeats.

Every way in (the gRPC and HTTP APIs through the ingress, ``tandem run``, the Python API) checks a
request with these functions, so a limit is the same wherever a request enters and is
documented once: here, in ``proto/tandem/v1/tandem.proto`` and in the README.

Error messages quote user input through :func:`quote`, which clips it to about
``MAX_ECHO_CHARS`` characters: a 10 KB field must come back as a short INVALID_ARGUMENT
message, not as a status whose details overflow gRPC's metadata limit.
"""

from __future__ import annotations

from typing import Any, Sequence

MAX_ECHO_CHARS = 100  # of user input quoted in one error message
MAX_REQUEST_ID_CHARS = 256
MAX_SLO_CLASS_CHARS = 64  # also the longest class name a topology may declare
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_USER_CHARS = 256  # the OpenAI API's ``user`` (an end user's id)
MAX_UINT32 = 2**32 - 1  # max_tokens and top_k: the gRPC API's uint32
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # the gRPC API's int32
MAX_BODY_DEPTH = 64  # levels of nested arrays and objects in an HTTP API body


class InvalidRequestError(ValueError):
    """A request a user can fix: the message names the field and what is wrong with it."""


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with a note of how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def quote(value: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """``repr(value)`` (a string in quotes), clipped like :func:`clip`."""
    try:
        return clip(repr(value), limit)
    except ValueError:  # an integer too long to write out
        return "an integer of more than 4300 digits"


def check_length(name: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequestError(f"{name} is {len(value)} characters long; at most {limit} are allowed: "
                                  f"{quote(value)}")


def check_request_id(request_id: str) -> None:
    check_length("request_id", request_id, MAX_REQUEST_ID_CHARS)


def check_user(user: str) -> None:
    check_length("user", user, MAX_USER_CHARS)


def check_priority(priority: int) -> None:
    low, high = PRIORITY_RANGE
    if not low <= priority <= high:
        raise InvalidRequestError(f"priority must be in [{low}, {high}], got {quote(priority)}")


def check_slo_class(name: str | None) -> None:
    if name is not None:
        check_length("slo_class", name, MAX_SLO_CLASS_CHARS)


def check_stops(stop: Sequence[str], stop_token_ids: Sequence[int]) -> None:
    """How many stop strings and stop token ids a request may give, and how long a stop string may be."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop: {len(stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
    for text in stop:
        check_length("a stop string", text, MAX_STOP_STRING_CHARS)
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"stop_token_ids: {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are "
                                  "allowed")


def check_stop_token_ids(stop_token_ids: Sequence[int], vocab_size: int) -> None:
    """Stop token ids must be tokens of the model: in [0, vocab_size)."""
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size}); got {quote(bad[:5])}")
