"""The one codec for what crosses a worker's stream: a message (a frozen dataclass of
``messages.py``) to plain data that msgpack carries, and back. Never pickle.

A message becomes a map of its fields plus a type tag under ``TAG``; a field holding another
message (a WorkerRequest's SamplingParams, a TokenDelta's Finished) nests the same way. The
maps are made from ``dataclasses.fields``, so a field added to a message needs no change here.
msgpack has no tuple: a field declared a tuple is made one again, other sequences stay lists.
Enums travel as their values (a message's own ``__post_init__`` turns them back, as
WorkerFailure does).
"""

from __future__ import annotations

import dataclasses
import re
from enum import Enum
from typing import Any

from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured.spec import StructuredOutput
from cluster.protocol.messages import (Finished, Hello, PullReport, RequestFailed, ScaleProgress, ScaleRequest,
                                       ScaleResult, TokenDelta, TransferReport, Usage, WorkerFailure, WorkerRequest)

TAG = "@type"
MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (
    Hello, WorkerRequest, SamplingParams, TokenDelta, Finished, Usage, TransferReport, PullReport, WorkerFailure,
    RequestFailed, StructuredOutput, ScaleRequest, ScaleProgress, ScaleResult)}


# A field declared a scalar, or a list or tuple of scalars, is already msgpack's plain data: it
# is passed as it is, not walked item by item (a 2,000-token prompt walked cost 0.7 ms to encode).
_PLAIN = re.compile(r"(str|int|float|bool|list\[(str|int|float)\]|tuple\[(str|int|float), \.\.\.\])( \| None)?")

# Each message's field names, those passed as they are, and those declared tuples, read once:
# encoding and decoding run per token.
FIELDS: dict[str, tuple[str, ...]] = {
    tag: tuple(f.name for f in dataclasses.fields(cls)) for tag, cls in MESSAGES.items()}
PLAIN_FIELDS: dict[str, frozenset[str]] = {
    tag: frozenset(f.name for f in dataclasses.fields(cls) if _PLAIN.fullmatch(str(f.type)))
    for tag, cls in MESSAGES.items()}
TUPLE_FIELDS: dict[str, frozenset[str]] = {
    tag: frozenset(f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple"))
    for tag, cls in MESSAGES.items()}


class UnknownMessage(ValueError):
    """Data that is not one of the stream's messages."""


def encode_message(message: Any) -> Any:
    """A message as plain data (maps, lists, strings, numbers, None)."""
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        tag = type(message).__name__
        if MESSAGES.get(tag) is not type(message):
            raise UnknownMessage(f"{tag} is not a stream message; known: {', '.join(sorted(MESSAGES))}")
        data = {TAG: tag}
        plain = PLAIN_FIELDS[tag]
        for name in FIELDS[tag]:
            value = getattr(message, name)
            data[name] = value if name in plain else encode_message(value)
        return data
    if isinstance(message, Enum):
        return message.value
    if isinstance(message, (list, tuple)):
        return [encode_message(item) for item in message]
    if isinstance(message, dict):
        return {key: encode_message(value) for key, value in message.items()}
    return message


def decode_message(data: Any) -> Any:
    """The message ``encode_message`` made ``data`` from; UnknownMessage for data that is not
    one (no type tag, a tag no message has, fields the message lacks)."""
    if not (isinstance(data, dict) and TAG in data):
        raise UnknownMessage(f"not a stream message (no {TAG!r} tag): {str(data)[:80]}")
    return _decode(data)


def _decode(data: Any) -> Any:
    if isinstance(data, list):
        return [_decode(item) for item in data]
    if not isinstance(data, dict):
        return data
    if TAG not in data:
        return {key: _decode(value) for key, value in data.items()}
    tag = data[TAG]
    cls = MESSAGES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise UnknownMessage(f"unknown message type {str(tag)[:40]!r}; known: {', '.join(sorted(MESSAGES))}")
    unknown = sorted(set(data) - set(FIELDS[tag]) - {TAG})
    if unknown:
        raise UnknownMessage(f"{tag} has no field(s) {', '.join(map(str, unknown))}")
    plain, tuples = PLAIN_FIELDS[tag], TUPLE_FIELDS[tag]
    values = {}
    for key, value in data.items():
        if key != TAG:
            if key not in plain:
                value = _decode(value)
            if key in tuples and isinstance(value, list):
                value = tuple(value)
            values[key] = value
    try:
        return cls(**values)
    except TypeError as exc:  # a required field missing
        raise UnknownMessage(f"{tag}: {exc}") from None
