"""The OpenAI API's shapes: request bodies in, the request path's mappings out; responses,
stream chunks and error bodies from hand-made messages."""

from __future__ import annotations

import json

import pytest

from cluster.engine.chat_template import ChatPrompt
from cluster.engine.structured.spec import StructuredOutput
from cluster.protocol.messages import ApiRequest, RequestFailed
from cluster.ingress.openai_api import (
    ApiError, Choice, chunk, error_for, logprobs_block, models, parse_chat, parse_completion, response, usage,
    usage_chunk,
)

pytestmark = pytest.mark.unit

MODEL = "tiny"


def test_a_completion_body_becomes_a_request_mapping():
    req = parse_completion({"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "top_p": 0.5,
                            "stop": "\n", "seed": 7, "presence_penalty": 0.1, "frequency_penalty": 0.2,
                            "top_k": 3, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                            "priority": 2, "slo_class": "interactive", "ttft_ms": 250, "tpot_ms": 50,
                            "user": "u1", "logprobs": 2}, MODEL)
    assert req.kind == "completion" and req.n == 1 and not req.stream and req.seed == 7 and req.logprobs == 2
    assert req.request == ApiRequest(
        model=MODEL, prompt="Hello", slo_class="interactive", priority=2, ttft_s=0.25, tpot_s=0.05,
        sampling={"max_tokens": 5, "temperature": 0.0, "top_p": 0.5, "presence_penalty": 0.1,
                  "frequency_penalty": 0.2, "min_p": 0.05, "repetition_penalty": 1.1, "top_k": 3,
                  "stop": ["\n"], "ignore_eos": True, "logprobs": 2})
    assert [r.sampling["seed"] for r in req.choice_requests()] == [7]


def test_completion_defaults_and_token_id_prompts():
    req = parse_completion({"model": MODEL, "prompt": [5, 6, 7]}, MODEL)
    assert req.request.prompt == [5, 6, 7] and req.request.sampling == {"max_tokens": 16}
    assert parse_completion({"model": MODEL, "prompt": ["one"]}, MODEL).request.prompt == "one"


def test_a_chat_body_renders_through_the_template_and_maps_logprobs():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    req = parse_chat({"model": MODEL, "messages": messages, "max_completion_tokens": 9, "logprobs": True,
                      "top_logprobs": 3, "n": 2, "seed": 10, "stream": True,
                      "stream_options": {"include_usage": True}}, MODEL)
    assert req.request.prompt == ChatPrompt(messages, True, None) and req.request.max_tokens_to_context
    assert req.request.sampling == {"max_tokens": 9, "logprobs": 3}  # no max: the rest of the context
    assert (req.kind, req.n, req.stream, req.include_usage, req.logprobs) == ("chat", 2, True, True, 3)
    assert [r.sampling["seed"] for r in req.choice_requests()] == [10, 11]  # choices differ, each reproducible
    assert parse_chat({"model": MODEL, "messages": messages}, MODEL).request.sampling == {}


@pytest.mark.parametrize("body, status, param, words", [
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "must be in [1, 16], got 0"),
    ({"model": MODEL, "prompt": "x", "colour": "blue"}, 400, "colour", "unknown field"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias", "is not supported"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "needs stream: true"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "the prompt is empty"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ({"prompt": "x"}, 400, "model", "the model's name is required"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "model", "model 'gpt-9' is not served here"),
    ({"model": MODEL, "prompt": "x", "ttft_ms": 0}, 400, "ttft_ms", "must be positive"),
    ({"model": MODEL, "prompt": "x", "speculative": "no"}, 400, "speculative", "must be true or false, got 'no'"),
    ({"model": MODEL, "prompt": "x", "speculative": 0}, 400, "speculative", "must be true or false, got 0"),
    ({"model": MODEL, "prompt": "x", "user": "u" * 257}, 400, "user",
     "user is 257 characters long; at most 256 are allowed"),
    ({"model": MODEL, "prompt": "x", "user": 7}, 400, "user", "user: must be a string"),
    ({"model": MODEL, "prompt": "x", "metadata": 5}, 400, "metadata", "must be an object of string values, got 5"),
    ({"model": MODEL, "prompt": "x", "metadata": {"k": 1}}, 400, "metadata", "must be an object of string values"),
    ({"model": MODEL, "prompt": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata",
     "17 pairs; at most 16 are allowed"),
    ({"model": MODEL, "prompt": "x", "metadata": {"k": "v" * 513}}, 400, "metadata", "values at most 512"),
    ({"model": MODEL, "prompt": "x", "echo": 0}, 400, "echo", "0 is not supported"),
    ({"model": MODEL, "prompt": "x", "store": []}, 400, "store", "[] is not supported"),
    ({"model": MODEL, "prompt": "x", "logit_bias": []}, 400, "logit_bias", "[] is not supported"),
    ({"model": MODEL, "prompt": "x", "best_of": True}, 400, "best_of", "True is not supported"),
    ({"model": MODEL, "prompt": "x", "temperature": 10**400}, 400, "temperature", "must be a finite number"),
    ({"model": MODEL, "prompt": "x", "n": 10**400}, 400, "n", "more characters)"),  # quoted, clipped
])
def test_bad_completion_bodies_name_the_field(body, status, param, words):
    with pytest.raises(ApiError) as caught:
        parse_completion(body, MODEL)
    assert (caught.value.status, caught.value.param) == (status, param)
    assert words in caught.value.message
    error = caught.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == ("model_not_found" if status == 404 else None)


def test_speculative_is_a_sampling_field_of_both_endpoints():
    from cluster.engine.sampling_params import SamplingParams

    completion = parse_completion({"model": MODEL, "prompt": "x", "speculative": False}, MODEL)
    assert completion.request.sampling == {"max_tokens": 16, "speculative": False}
    assert SamplingParams.from_mapping(completion.request.sampling).speculative is False
    chat = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "speculative": True}, MODEL)
    assert chat.request.sampling == {"speculative": True}
    assert "speculative" not in parse_completion({"model": MODEL, "prompt": "x"}, MODEL).request.sampling


def test_bad_chat_bodies_name_the_field():
    with pytest.raises(ApiError, match="messages: must be a non-empty list"):
        parse_chat({"model": MODEL, "messages": []}, MODEL)
    with pytest.raises(ApiError, match="top_logprobs: needs logprobs: true"):
        parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, MODEL)
    with pytest.raises(ApiError, match="^the request body must be a JSON object, got an array$"):
        parse_chat([1, 2], MODEL)
    with pytest.raises(ApiError, match="^the request body must be a JSON object, got a number$"):
        parse_completion(1.5, MODEL)


def test_accepted_neutral_and_metadata_fields():
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for extra in ({"metadata": {"k": "v" * 512}}, {"metadata": None}, {"store": False}, {"logit_bias": {}},
                  {"parallel_tool_calls": True}, {"user": "u" * 256}):
        parse_chat({**chat, **extra}, MODEL)
    for extra in ({"echo": False}, {"best_of": 1}, {"metadata": {}}):
        parse_completion({"model": MODEL, "prompt": "x", **extra}, MODEL)
    with pytest.raises(ApiError, match="^parallel_tool_calls must be true or false, got 'yes'"):
        parse_chat({**chat, "parallel_tool_calls": "yes"}, MODEL)


def test_an_error_message_is_one_line():
    assert ApiError(400, "the chat template failed:\n  line 3\n\tmore").message == \
        "the chat template failed: line 3 more"


@pytest.mark.parametrize("message, param", [
    ("temperature must be >= 0 (0 means greedy), got -1.0", "temperature"),
    ("messages[0].role is missing", "messages[0].role"),
    ("messages[2].content[1] must be {...}", "messages[2].content[1]"),
    ("stop: 17 stop strings; at most 16 are allowed", "stop"),
    ("max_tokens must be <= 4294967295, got 10", "max_tokens"),
    ("prompt has 600 tokens but the model's context is 512 tokens", "prompt"),
    ("prompt_token_ids must be integers in [0, 512); got [600]", "prompt"),
    ("priority must be in [-2147483648, 2147483647], got 2147483648", "priority"),
    ("a stop string is 300 characters long; at most 256 are allowed", None),
    ("unknown slo_class 'x'; known: interactive", None),
    ("objectives.ttft_ms must be positive, got -1", None),
    ("colour is missing", None),  # not a field of either endpoint
])
def test_a_path_error_names_the_field_it_starts_with(message, param):
    assert error_for(RequestFailed("invalid", message)).param == param


def test_path_errors_get_their_status():
    assert error_for(RequestFailed("invalid", "temperature: must be >= 0")).status == 400
    rejected = error_for(RequestFailed("rejected", "rejected by admission control: ..."))
    assert (rejected.status, rejected.body()["error"]["type"], rejected.code) == (429, "rate_limit_error",
                                                                                  "rate_limit_exceeded")
    assert error_for(RequestFailed("unavailable", "no live decode worker")).status == 503
    assert error_for(RequestFailed("not_found", "model 'x' ...")).status == 404


def test_whole_responses_and_usage_with_cached_tokens():
    req = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, MODEL)
    choices = [Choice(0, "ab", [1, 2], finish_reason="length", usage=[7, 4, 2]),
               Choice(1, "c", [3], finish_reason="stop", usage=[7, 4, 1])]
    body = response(req, choices, decode=str)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": None, "finish_reason": "length"},
        {"index": 1, "message": {"role": "assistant", "content": "c"}, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == usage(7, 3, 4) == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                               "prompt_tokens_details": {"cached_tokens": 4}}


def test_stream_chunks():
    chat = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}, MODEL)
    assert chunk(chat, 0, "", role=True)["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
    assert chunk(chat, 0, None, "stop")["choices"][0]["delta"] == {}
    assert chunk(chat, 0, "hi")["object"] == "chat.completion.chunk"
    done = usage_chunk(chat, usage(1, 2, 0))
    assert done["choices"] == [] and done["usage"]["total_tokens"] == 3
    completion = parse_completion({"model": MODEL, "prompt": "x", "stream": True}, MODEL)
    assert chunk(completion, 0, "hi")["choices"] == [{"index": 0, "text": "hi", "logprobs": None,
                                                      "finish_reason": None}]


def test_logprobs_in_both_shapes():
    entries = [(-0.5, [(65, -0.5), (66, -1.5)]), (-0.25, [(67, -0.25)])]
    decode = {65: "A", 66: "B", 67: "C"}.get
    chat = logprobs_block("chat", entries, [65, 67], decode)
    assert chat == {"content": [
        {"token": "A", "logprob": -0.5, "bytes": [65],
         "top_logprobs": [{"token": "A", "logprob": -0.5, "bytes": [65]}, {"token": "B", "logprob": -1.5,
                                                                            "bytes": [66]}]},
        {"token": "C", "logprob": -0.25, "bytes": [67], "top_logprobs": [{"token": "C", "logprob": -0.25,
                                                                          "bytes": [67]}]}]}
    completion = logprobs_block("completion", entries, [65, 67], decode, text_offset=3)
    assert completion == {"tokens": ["A", "C"], "token_logprobs": [-0.5, -0.25],
                          "top_logprobs": [{"A": -0.5, "B": -1.5}, {"C": -0.25}], "text_offset": [3, 4]}
    assert logprobs_block("chat", [], [], decode) is None


def test_models_list():
    assert models(MODEL, 512, 1000) == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 1000, "owned_by": "tandem", "max_model_len": 512}]}


def test_what_aiohttp_answers_itself_is_one_line_without_the_bytes_it_quotes():
    from cluster.ingress.http_connection import protocol_error_message

    assert protocol_error_message(400, "Invalid method encountered:\n\n  b'{}garbage'\n    ^") == \
        "the request is not valid HTTP/1.1: Invalid method encountered"
    assert protocol_error_message(400, None) == "the request is not valid HTTP/1.1"
    assert protocol_error_message(500, "Server got itself in trouble") == \
        "the server failed on this request (an internal error; the server's log has the details)"
    assert protocol_error_message(400, "x" * 500).endswith("(400 more characters)")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("fields, spec", [
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "strict": False,
                                                                 "description": "an a"}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+", source="regex")),
    ({"grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"', syntax="ebnf", source="grammar")),
    ({"grammar": 'start: "a"', "grammar_syntax": "lark"},
     StructuredOutput("grammar", 'start: "a"', syntax="lark", source="grammar")),
    ({"choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]', source="choice")),
])
def test_structured_output_fields_of_both_endpoints_become_the_spec(fields, spec):
    chat = parse_chat({"model": MODEL, "messages": MESSAGES, **fields}, MODEL)
    completion = parse_completion({"model": MODEL, "prompt": "x", **fields}, MODEL)
    assert chat.request.sampling == {"structured": spec}
    assert completion.request.sampling == {"max_tokens": 16, "structured": spec}


def test_a_text_response_format_is_free_text():
    for value in ({"type": "text"}, None):
        assert parse_chat({"model": MODEL, "messages": MESSAGES, "response_format": value}, MODEL).request.sampling == {}


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex",
     "regex: give at most one of response_format, regex, grammar and choice (this request also has response_format)"),
    ({"choice": ["a"], "grammar": "x"}, "choice",
     "choice: give at most one of response_format, regex, grammar and choice (this request also has grammar)"),
    ({"grammar_syntax": "lark"}, "grammar_syntax", "grammar_syntax: goes with grammar"),
    ({"grammar": "x", "grammar_syntax": "peg"}, "grammar_syntax",
     "grammar_syntax: must be \"ebnf\" (GBNF) or \"lark\", got 'peg'"),
    ({"response_format": {"type": "xml"}}, "response_format",
     'response_format: must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
     "{...}}, got {'type': 'xml'}"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format",
     "response_format: unknown key 'schema' for type json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A"}}}, "response_format",
     "response_format: json_schema.schema must be a JSON schema object, got None"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format", "response_format: json_schema.strict must be a bool, got 'yes'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "colour": 1}}},
     "response_format", "response_format: unknown key json_schema.colour"),
    ({"choice": "yes"}, "choice", "choice: must be a non-empty list of non-empty strings, got 'yes'"),
    ({"regex": 5}, "regex", "regex: must be a string, got 5"),
    ({"regex": ""}, "regex", "regex: the regex is empty"),
])
def test_bad_structured_output_fields_name_the_field(fields, param, message):
    with pytest.raises(ApiError) as caught:
        parse_chat({"model": MODEL, "messages": MESSAGES, **fields}, MODEL)
    assert (caught.value.status, caught.value.param, caught.value.message) == (400, param, message)
