"""A request body read as strict JSON (RFC 8259), so that every malformed body gets a 400 that
says what is wrong with it instead of a failure somewhere deeper.

Python's ``json`` reads more than JSON and fails in ways a client cannot read; here:

- ``NaN``, ``Infinity`` and numbers beyond a float's range are refused (they are not JSON numbers);
- an object that repeats a key is refused (which of the two a server reads is up to the server);
- arrays and objects nest at most ``MAX_BODY_DEPTH`` levels (deeper, Python's parser would exhaust
  its recursion: a 500);
- a string with a lone surrogate (``"\\ud800"``: valid JSON, not Unicode text) is refused naming
  where it is (``messages[0].content``), before a tokenizer chokes on it;
- bytes that are not UTF-8, an empty body and an integer of more than 4,300 digits (Python's
  limit on reading one) are refused.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.engine.request_limits import MAX_BODY_DEPTH, clip, quote


class BodyError(Exception):
    """A body that is not strict JSON; the message says what is wrong, in one line, and
    ``param`` where in the body, when it is one value."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_json_body(raw: bytes) -> Any:
    """The body's value; raises :class:`BodyError`."""
    if not raw.strip():
        raise BodyError("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"the request body is not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}") from None
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_float, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise BodyError(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    except RecursionError:
        raise BodyError(_too_deep()) from None
    except ValueError:  # our hooks raise BodyError: this is int() refusing a number too long to read
        raise BodyError("the request body holds an integer of more than 4300 digits") from None
    _check_tree(value)
    return value


def _constant(name: str) -> Any:
    raise BodyError(f"the request body holds {name}, which is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BodyError(f"the request body holds the number {quote(text)}, beyond a 64-bit float's range")
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise BodyError(f"the request body repeats the key {quote(key)} in one object")
            seen.add(key)
    return value


def _too_deep() -> str:
    return f"the request body nests arrays and objects more than {MAX_BODY_DEPTH} levels deep"


def _check_tree(value: Any) -> None:
    """Depth and text of the parsed body, walked without recursion (only containers are stacked;
    ``json`` makes exactly dicts, lists and strs)."""
    stack: list[tuple[Any, tuple, int]] = [({"": value}, (), -1)]  # the body, as a wrapper's one value
    while stack:
        item, path, depth = stack.pop()
        if depth >= MAX_BODY_DEPTH:
            raise BodyError(_too_deep())
        entries = item.items() if type(item) is dict else enumerate(item)
        for key, child in entries:
            where = path + (key,) if depth >= 0 else ()
            if type(key) is str:
                _check_text(key, path, key=True)
            kind = type(child)
            if kind is str:
                _check_text(child, where)
            elif kind is dict or kind is list:
                stack.append((child, where, depth + 1))


def _check_text(text: str, path: tuple, key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = clip(_path(path)) or "the request body"
        what = "has a key that holds" if key else "holds"
        raise BodyError(f"{where} {what} a lone surrogate ({ascii(text[exc.start])[1:-1]}): not Unicode text",
                        where if path else None) from None


def _path(path: tuple) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        elif key.isidentifier():
            out += f".{key}" if out else key
        else:
            out += f"[{quote(key)}]"
    return out
