"""A fuzz of the OpenAI-compatible HTTP API: what a stranger or a broken client sends to
``/v1/completions`` and ``/v1/chat/completions``, each answered with a 4xx and OpenAI's error body
whose message is one line naming the field or what is wrong with the body (never a 500, never a
traceback), and a server that serves normally afterwards.

Bodies that are not JSON, the wrong Content-Type, JSON that Python reads and JSON forbids (NaN,
numbers beyond a float, duplicate keys, lone surrogates), deep nesting, every field with a value
of the wrong type, values out of range, and requests that are not valid HTTP/1.1 (sent on a raw
socket: Content-Length that disagrees with the body or is not a number, a broken chunk, a chunked
body past the size limit). One cluster: one colocated worker of the small test checkpoint, behind a
bearer token, through the real ingress (``cluster/ingress/http_server.py``).
"""

from __future__ import annotations

import json
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from cluster.engine.request_limits import MAX_BODY_DEPTH
from cluster.ingress.http_server import MAX_BODY_BYTES
from cluster.ingress.openai_api import CHAT_FIELDS, COMPLETION_FIELDS
from e2e_cluster import Cluster, topology

pytestmark = pytest.mark.e2e

TOKEN = "sk-fuzz"
MODEL = "tiny-chat"
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD = {CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 3},
        COMPLETIONS: {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 3}}
ANY = object()  # a param not checked


@pytest.fixture(scope="module")
def model_dir(checkpoint, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fuzz-model") / MODEL
    shutil.copytree(checkpoint("llama"), directory)
    (directory / "chat_template.jinja").write_text(CHATML)
    return directory


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """``(host, port)`` of the cluster's HTTP API."""
    spec = topology("e2e-fuzz", model_dir, prefill={"replicas": 0}, decode={"replicas": 0},
                    colocated={"replicas": 1, "threads": 1}, server={"auth_token_env": "E2E_FUZZ_TOKEN"})
    cluster = Cluster("e2e-fuzz", spec, tmp_path_factory.mktemp("fuzz"), env={"E2E_FUZZ_TOKEN": TOKEN})
    try:
        url = urlsplit(cluster.state["http"])
        yield url.hostname, url.port
    finally:
        cluster.down()


# -- talking to it -----------------------------------------------------------------------------

@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes


def post(server, path: str, content: bytes, content_type: str | None = "application/json",
         token: str | None = TOKEN) -> Answer:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if content_type is not None:
        headers["Content-Type"] = content_type
    response = httpx.post(f"http://{server[0]}:{server[1]}{path}", content=content, headers=headers, timeout=60)
    return Answer(response.status_code, response.headers.get("Content-Type", ""), response.content)


def exchange(server, request: bytes) -> Answer:
    """One raw HTTP/1.1 exchange (the request as given, byte for byte); the first response."""
    with socket.create_connection(server, timeout=60) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it was all sent: its answer is waiting
        received = b""
        while b"\r\n\r\n" not in received or len(received) < _expected_length(received):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    body = body[:int(headers.get("content-length", len(body)))]
    return Answer(int(lines[0].split()[1]), headers.get("content-type", ""), body)


def _expected_length(received: bytes) -> int:
    head, _, _ = received.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(received) + 1  # read to the close


def http_request(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: fuzz", f"Authorization: Bearer {TOKEN}",
            "Content-Type: application/json", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def assert_refused(answer: Answer, status: int, words: str, param=ANY) -> dict:
    """A 4xx with OpenAI's error body, its message one line that says ``words``."""
    assert answer.status == status, answer.body[:300]
    assert answer.content_type.startswith("application/json"), answer.content_type
    error = json.loads(answer.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    message = error["message"]
    assert words in message, message
    assert "\n" not in message and "Traceback" not in message and len(message) < 400, message
    if param is not ANY:
        assert error["param"] == param, error
    return error


def good(path: str, **changes) -> bytes:
    return json.dumps({**GOOD[path], **changes}).encode()


def both(*cases):
    """Each case on both endpoints."""
    return [pytest.param(path, *case, id=f"{_name(path)}-{i}") for i, case in enumerate(cases)
            for path in (CHAT, COMPLETIONS)]


def _name(path: str) -> str:
    return "chat" if path == CHAT else "completions"


# -- bodies that are not a request's JSON object -------------------------------------------------

DEEP_ARRAYS = b"[" * 5000 + b"]" * 5000
DEEP_OBJECTS = b'{"a":' * 5000 + b"1" + b"}" * 5000
TOO_DEEP = f"nests arrays and objects more than {MAX_BODY_DEPTH} levels deep"


@pytest.mark.parametrize("path, content, content_type, status, words", both(
    (b"hello", "application/json", 400, "the request body is not valid JSON: Expecting value at line 1 column 1"),
    (b'{"model": "tiny-chat", "prompt": ', "application/json", 400, "the request body is not valid JSON"),
    (b"", "application/json", 400, "the request body is empty; send a JSON object"),
    (b"model=tiny-chat&prompt=hi", "application/x-www-form-urlencoded", 415,
     "the request body must be JSON (Content-Type: application/json), got Content-Type "
     "'application/x-www-form-urlencoded'"),
    (b'{"model": "tiny-chat"}', "text/plain", 415, "must be JSON (Content-Type: application/json)"),
    (b"[]", "application/json", 400, "the request body must be a JSON object, got an array"),
    (b'"hello"', "application/json", 400, "the request body must be a JSON object, got a string"),
    (b"42", "application/json", 400, "the request body must be a JSON object, got a number"),
    (b"null", "application/json", 400, "the request body must be a JSON object, got null"),
    (b'{"model": "tiny-chat", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", 400,
     "the request body holds an integer of more than 4300 digits"),
    (b'{"model": "tiny-chat", "temperature": 1e999}', "application/json", 400,
     "the request body holds the number '1e999', beyond a 64-bit float's range"),
    (b'{"model": "tiny-chat", "temperature": NaN}', "application/json", 400,
     "the request body holds NaN, which is not a JSON number"),
    (b'{"model": "tiny-chat", "top_p": -Infinity}', "application/json", 400,
     "the request body holds -Infinity, which is not a JSON number"),
    (DEEP_ARRAYS, "application/json", 400, TOO_DEEP),
    (DEEP_OBJECTS, "application/json", 400, TOO_DEEP),
    (b'{"model": "tiny-chat", "model": "other"}', "application/json", 400,
     "the request body repeats the key 'model' in one object"),
    (b'{"model": "tiny-chat", "prompt": "caf\xe9"}', "application/json", 400,
     "the request body is not UTF-8: byte 0xe9 at offset 37"),
    (b'\xef\xbb\xbf{"model": "tiny-chat"}', "application/json", 400, "Unexpected UTF-8 BOM"),
))
def test_a_body_that_is_not_a_json_object(server, path, content, content_type, status, words):
    assert_refused(post(server, path, content, content_type), status, words, None)


def test_lone_surrogates_are_refused_naming_the_field(server):
    error = assert_refused(post(server, CHAT, b'{"model": "tiny-chat", "messages": [{"role": "user", '
                                              b'"content": "hi \\ud800"}]}'),
                           400, "messages[0].content holds a lone surrogate (\\ud800): not Unicode text")
    assert error["param"] == "messages[0].content"
    assert_refused(post(server, COMPLETIONS, b'{"model": "tiny-chat", "prompt": "\\udfff"}'), 400,
                   "prompt holds a lone surrogate (\\udfff)", "prompt")


def test_without_the_token(server):
    error = assert_refused(post(server, CHAT, good(CHAT), token=None), 401, "missing or wrong bearer token")
    assert error["code"] == "invalid_api_key"


# -- fields --------------------------------------------------------------------------------------

# A value of the wrong JSON type for every field either endpoint takes.
WRONG_TYPE = {
    "model": 5, "prompt": {"text": "hi"}, "messages": {"role": "user", "content": "hi"}, "max_tokens": "16",
    "max_completion_tokens": "16", "temperature": "hot", "top_p": [1], "n": 1.5, "stop": 5, "seed": "7",
    "presence_penalty": "x", "frequency_penalty": {}, "stream": "yes", "stream_options": "usage", "user": 5,
    "metadata": ["x"], "logprobs": "yes", "top_logprobs": "3", "tools": "get_weather", "top_k": 1.5, "min_p": "x",
    "repetition_penalty": [1], "ignore_eos": "yes", "speculative": "no", "priority": 1.5, "slo_class": 5,
    "ttft_ms": "fast", "tpot_ms": [50], "stop_token_ids": "3", "request_id": 5, "logit_bias": "x", "echo": "yes",
    "best_of": "1", "suffix": 5, "response_format": "json", "parallel_tool_calls": "yes", "tool_choice": 5,
    "service_tier": 5, "store": "no", "modalities": "text", "reasoning_effort": 5, "regex": 5, "grammar": ["x"],
    "grammar_syntax": 5, "choice": "yes",
}
FIELDS = [(CHAT, name) for name in sorted(CHAT_FIELDS)] + [(COMPLETIONS, name) for name in sorted(COMPLETION_FIELDS)]


@pytest.mark.parametrize("path, name", FIELDS, ids=[f"{_name(p)}-{n}" for p, n in FIELDS])
def test_every_field_with_a_value_of_the_wrong_type(server, path, name):
    assert name in WRONG_TYPE, f"{name}: add a value of the wrong type for it to WRONG_TYPE"
    assert_refused(post(server, path, good(path, **{name: WRONG_TYPE[name]})), 400, name, name)


@pytest.mark.parametrize("path, changes, status, words, param", both(
    ({"colour": "blue"}, 400, "colour: unknown field", "colour"),
    ({"model": None}, 400, "model: the model's name is required", "model"),
    ({"model": "gpt-9"}, 404, "model 'gpt-9' is not served here; this cluster serves 'tiny-chat'", "model"),
    ({"max_tokens": 0}, 400, "max_tokens: must be >= 1, got 0", "max_tokens"),
    ({"max_tokens": -5}, 400, "max_tokens: must be >= 1, got -5", "max_tokens"),
    ({"max_tokens": 10**30}, 400, "max_tokens must be <= 4294967295, got 1000000000000000000000000000000",
     "max_tokens"),
    ({"max_tokens": 2.5}, 400, "max_tokens: must be an integer, got 2.5", "max_tokens"),
    ({"n": 0}, 400, "n: must be in [1, 16], got 0", "n"),
    ({"n": 17}, 400, "n: must be in [1, 16], got 17", "n"),
    ({"n": 10**300}, 400, "n: must be in [1, 16], got 1000000000", "n"),
    ({"stop": ["x"] * 10_000}, 400, "stop: 10000 stop strings; at most 16 are allowed", "stop"),
    ({"stop": ["s" * 100_000]}, 400, "a stop string is 100000 characters long; at most 256 are allowed", ANY),
    ({"stop": [""]}, 400, "stop: must be a string or a list of non-empty strings", "stop"),
    ({"stop_token_ids": [10**30]}, 400, "stop_token_ids must be in [0, 512)", "stop_token_ids"),
    ({"user": "u" * 100_000}, 400, "user is 100000 characters long; at most 256 are allowed", "user"),
    ({"temperature": -1}, 400, "temperature must be >= 0 (0 means greedy), got -1.0", "temperature"),
    ({"temperature": 10**400}, 400, "temperature: must be a finite number", "temperature"),
    ({"top_p": 0}, 400, "top_p must be in (0, 1], got 0.0", "top_p"),
    ({"seed": -1}, 400, "seed: must be >= 0, got -1", "seed"),
    ({"seed": 2**64}, 400, "seed must be <= 18446744073709551615", "seed"),
    ({"top_k": 2**32}, 400, "top_k must be <= 4294967295", "top_k"),
    ({"priority": 2**31}, 400, "priority must be in [-2147483648, 2147483647], got 2147483648", "priority"),
    ({"frequency_penalty": 3}, 400, "frequency_penalty must be in [-2, 2], got 3.0", "frequency_penalty"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options: needs stream: true", "stream_options"),
    ({"request_id": "r" * 10_000}, 400, "request_id is 10000 characters long; at most 256 are allowed",
     "request_id"),
    ({"slo_class": "platinum"}, 400, "unknown slo_class 'platinum'; known: interactive, standard, batch", None),
    ({"ttft_ms": -1}, 400, "ttft_ms: must be positive, got -1", "ttft_ms"),
    ({"metadata": {"k": 1}}, 400, "metadata: must be an object of string values", "metadata"),
    ({"logit_bias": {"5": 100}}, 400, "logit_bias: {'5': 100} is not supported by this server", "logit_bias"),
))
def test_fields_out_of_range(server, path, changes, status, words, param):
    assert_refused(post(server, path, good(path, **changes)), status, words, param)


@pytest.mark.parametrize("changes, words, param", [
    ({"prompt": ""}, "prompt: the prompt is empty", "prompt"),
    ({"prompt": []}, "prompt: must be a non-empty string or a list of token ids", "prompt"),
    ({"prompt": [1, -1]}, "prompt_token_ids must be integers in [0, 512); got [-1]", "prompt"),
    ({"prompt": [10**30]}, "prompt_token_ids must be integers in [0, 512)", "prompt"),
    ({"prompt": [True, 2]}, "prompt: must be a non-empty string or a list of token ids", "prompt"),
    ({"prompt": ["a", "b"]}, "prompt: give one prompt per request", "prompt"),
    ({"prompt": "The quick brown fox " * 500}, "but the model's context is 512 tokens", "prompt"),
    ({"logprobs": 21}, "logprobs: must be in [0, 20], got 21", "logprobs"),
    ({"echo": True}, "echo: True is not supported by this server", "echo"),
    ({"best_of": 3}, "best_of: 3 is not supported by this server", "best_of"),
    ({"suffix": "tail"}, "suffix: 'tail' is not supported by this server", "suffix"),
])
def test_completion_prompts_and_fields(server, changes, words, param):
    assert_refused(post(server, COMPLETIONS, good(COMPLETIONS, **changes)), 400, words, param)


@pytest.mark.parametrize("messages, words, param", [
    ([], "messages: must be a non-empty list", "messages"),
    (["hello"], "messages[0] must be an object with 'role' and 'content', got 'hello'", "messages[0]"),
    ([{"content": "hi"}], "messages[0].role is missing", "messages[0].role"),
    ([{"role": "user"}], "messages[0].content is missing", "messages[0].content"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role must be one of system, user, assistant, tool; got "
                                            "'wizard'", "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list of text parts, got 5",
     "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}],
     'messages[0].content[0] must be {"type": "text", "text": "..."}', "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text"}]}], 'messages[0].content[0] must be {"type": "text"',
     "messages[0].content[0]"),
    ([{"role": "system", "content": "x"}, {"role": None, "content": "hi"}],
     "messages[1].role must be one of system, user, assistant, tool; got None", "messages[1].role"),
])
def test_chat_messages(server, messages, words, param):
    assert_refused(post(server, CHAT, good(CHAT, messages=messages)), 400, words, param)


@pytest.mark.parametrize("changes, words, param", [
    ({"logprobs": 1}, "logprobs: must be true or false, got 1", "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs: needs logprobs: true", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: must be in [0, 20], got 21", "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens: must be >= 1, got 0", "max_completion_tokens"),
    ({"response_format": {"type": "json_schema"}},
     'response_format: json_schema must be an object {"name", "schema", "strict"}', "response_format"),
])
def test_chat_fields(server, changes, words, param):
    assert_refused(post(server, CHAT, good(CHAT, **changes)), 400, words, param)


# -- requests that are not valid HTTP/1.1, or too large ----------------------------------------------

def test_a_body_larger_than_the_limit(server):
    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}).encode()
    too_large = f"the request body is larger than {MAX_BODY_BYTES} bytes, the most this server reads"
    assert_refused(post(server, COMPLETIONS, big), 413, too_large, None)
    # announced, and never sent: refused at once
    assert_refused(exchange(server, http_request(COMPLETIONS, b"{}", f"Content-Length: {10 * MAX_BODY_BYTES}")),
                   413, too_large)
    chunk = b"x" * 2**20
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(9)) + b"0\r\n\r\n"
    assert_refused(exchange(server, http_request(CHAT, chunked, "Transfer-Encoding: chunked")), 413, too_large)


@pytest.mark.parametrize("request_bytes, words", [
    # a Content-Length shorter than the body: the rest reads as the next request, which is not HTTP
    (http_request(CHAT, good(CHAT), "Content-Length: 10"), "the request is not valid HTTP/1.1: Invalid method"),
    (http_request(CHAT, good(CHAT), "Content-Length: ten"), "the request is not valid HTTP/1.1: Invalid character "
                                                            "in Content-Length"),
    (http_request(CHAT, good(CHAT), "Content-Length: -1"), "the request is not valid HTTP/1.1"),
    (http_request(CHAT, b"2\r\n{}\r\n0\r\n\r\n", "Content-Length: 2", "Transfer-Encoding: chunked"),
     "can't be present with"),
    (http_request(CHAT, b"zz\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding: chunked"),
     "the request is not valid HTTP/1.1: Invalid character in chunk size"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64), "the request is not valid HTTP/1.1"),  # TLS hello
], ids=["length-short", "length-not-a-number", "length-negative", "length-and-chunked", "broken-chunk", "not-http"])
def test_requests_that_are_not_http(server, request_bytes, words):
    assert_refused(exchange(server, request_bytes), 400, words, None)


def test_unknown_routes_and_methods(server):
    error = assert_refused(post(server, "/v1/embeddings", b"{}"), 404, "POST /v1/embeddings: Not Found")
    assert error["code"] == "unknown_url"
    assert_refused(exchange(server, f"GET {CHAT} HTTP/1.1\r\nHost: fuzz\r\nAuthorization: Bearer {TOKEN}\r\n"
                                    "Connection: close\r\n\r\n".encode()), 405, "GET /v1/chat/completions: Method "
                                                                              "Not Allowed")


# -- and then ---------------------------------------------------------------------------------------

def test_the_server_serves_normally_afterwards(server):
    base = f"http://{server[0]}:{server[1]}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as http:
        chat = http.post(CHAT, json={**GOOD[CHAT], "temperature": 0, "ignore_eos": True})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 3 and chat.json()["choices"][0]["finish_reason"] == "length"
        text = http.post(COMPLETIONS, json={**GOOD[COMPLETIONS], "ignore_eos": True, "n": 2})
        assert text.status_code == 200 and [c["finish_reason"] for c in text.json()["choices"]] == ["length"] * 2
        with http.stream("POST", CHAT, json={**GOOD[CHAT], "stream": True, "ignore_eos": True}) as events:
            lines = [line for line in events.iter_lines() if line.startswith("data: ")]
        assert events.status_code == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
