"""A request body read as strict JSON: every way a body is not, refused with one line that says
how (``cluster/ingress/json_body.py``)."""

from __future__ import annotations

import json

import pytest

from cluster.engine.request_limits import MAX_BODY_DEPTH
from cluster.ingress.json_body import BodyError, parse_json_body

pytestmark = pytest.mark.unit


def refused(raw: bytes) -> BodyError:
    with pytest.raises(BodyError) as info:
        parse_json_body(raw)
    assert "\n" not in str(info.value)
    return info.value


def test_a_strict_json_body_reads_as_json_does():
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo 東京 🙂"}], "temperature": 0.5,
            "prompt": list(range(1000)), "seed": 2**64 - 1, "nested": [[[[{"a": None, "b": True}]]]]}
    raw = json.dumps(body).encode()
    assert parse_json_body(raw) == json.loads(raw) == body
    assert parse_json_body(json.dumps(body, ensure_ascii=False).encode()) == body
    assert parse_json_body(b'"\\ud83d\\ude42"') == "🙂"  # a surrogate pair is one character


@pytest.mark.parametrize("raw, message", [
    (b"", "the request body is empty; send a JSON object"),
    (b"  \r\n", "the request body is empty; send a JSON object"),
    (b"hello", "the request body is not valid JSON: Expecting value at line 1 column 1"),
    (b'{"model": ', "the request body is not valid JSON: Expecting value at line 1 column 11"),
    (b'{"a": 1}{"b": 2}', "the request body is not valid JSON: Extra data at line 1 column 9"),
    (b'{"a": "\xff\xfe"}', "the request body is not UTF-8: byte 0xff at offset 7"),
    (b'{"t": NaN}', "the request body holds NaN, which is not a JSON number"),
    (b'{"t": Infinity}', "the request body holds Infinity, which is not a JSON number"),
    (b'[-Infinity]', "the request body holds -Infinity, which is not a JSON number"),
    (b'{"t": 1e400}', "the request body holds the number '1e400', beyond a 64-bit float's range"),
    (b'{"n": ' + b"9" * 5000 + b"}", "the request body holds an integer of more than 4300 digits"),
    (b'{"model": "a", "model": "b"}', "the request body repeats the key 'model' in one object"),
    (b'{"m": [{"x": 1, "x": 1}]}', "the request body repeats the key 'x' in one object"),
    (b"[" * 5000 + b"]" * 5000, f"the request body nests arrays and objects more than {MAX_BODY_DEPTH} levels deep"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000,
     f"the request body nests arrays and objects more than {MAX_BODY_DEPTH} levels deep"),
])
def test_malformed_bodies_are_refused_with_one_line(raw, message):
    assert str(refused(raw)) == message


def test_nesting_is_allowed_to_the_documented_depth():
    deepest = b"[" * MAX_BODY_DEPTH + b"]" * MAX_BODY_DEPTH
    assert parse_json_body(deepest) is not None
    assert str(refused(b"[" + deepest + b"]")).endswith(f"more than {MAX_BODY_DEPTH} levels deep")
    objects = b'{"a":' * MAX_BODY_DEPTH + b"1" + b"}" * MAX_BODY_DEPTH
    assert parse_json_body(objects) is not None
    assert str(refused(b'{"a":' + objects + b"}")).endswith(f"more than {MAX_BODY_DEPTH} levels deep")


@pytest.mark.parametrize("raw, message, param", [
    (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages[0].content holds a lone surrogate (\\ud800): not Unicode text", "messages[0].content"),
    (b'{"messages": [{"content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content[0].text holds a lone surrogate (\\udc00): not Unicode text", "messages[0].content[0].text"),
    (b'{"stop": ["ok", "\\ud83d"]}', "stop[1] holds a lone surrogate (\\ud83d): not Unicode text", "stop[1]"),
    (b'{"a b": {"c": "\\ud800"}}', "['a b'].c holds a lone surrogate (\\ud800): not Unicode text", "['a b'].c"),
    (b'{"metadata": {"\\ud800": "x"}}', "metadata has a key that holds a lone surrogate (\\ud800): not Unicode text",
     "metadata"),
    (b'"\\ud800"', "the request body holds a lone surrogate (\\ud800): not Unicode text", None),
])
def test_a_lone_surrogate_is_refused_naming_where_it_is(raw, message, param):
    error = refused(raw)
    assert (str(error), error.param) == (message, param)
