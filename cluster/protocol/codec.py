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
from enum import Enum
from typing import Any

from cluster.engine.sampling_params import SamplingParams
from cluster.protocol.messages import (Finished, Hello, RequestFailed, TokenDelta, TransferReport, Usage,
                                       WorkerFailure, WorkerRequest)

TAG = "@type"
MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (
    Hello, WorkerRequest, SamplingParams, TokenDelta, Finished, Usage, TransferReport, WorkerFailure,
    RequestFailed)}


class UnknownMessage(ValueError):
    """Data that is not one of the stream's messages."""


def encode_message(message: Any) -> Any:
    """A message as plain data (maps, lists, strings, numbers, None)."""
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        tag = type(message).__name__
        if MESSAGES.get(tag) is not type(message):
            raise UnknownMessage(f"{tag} is not a stream message; known: {', '.join(sorted(MESSAGES))}")
        data = {TAG: tag}
        for field in dataclasses.fields(message):
            data[field.name] = encode_message(getattr(message, field.name))
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
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields) - {TAG})
    if unknown:
        raise UnknownMessage(f"{tag} has no field(s) {', '.join(map(str, unknown))}")
    values = {}
    for key, value in data.items():
        if key != TAG:
            value = _decode(value)
            if isinstance(value, list) and str(fields[key].type).startswith("tuple"):
                value = tuple(value)
            values[key] = value
    try:
        return cls(**values)
    except TypeError as exc:  # a required field missing
        raise UnknownMessage(f"{tag}: {exc}") from None
