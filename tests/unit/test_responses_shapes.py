"""The Responses API's shapes: input items become chat turns, tools and ``text.format`` become the
output's constraint, fields Tandem does not honour (stored responses among them) are refused with
a 400 naming them; the writer's events come in OpenAI's order with consecutive sequence numbers,
and the whole response is what the events build."""

from __future__ import annotations

import json

import pytest

from cluster.engine.tool_calls.formats import FORMATS, ToolCalling
from cluster.ingress.openai_api import ApiError
from cluster.ingress.responses_api import ResponseWriter, parse_responses

pytestmark = pytest.mark.unit

MODEL = "tiny"
HERMES = ToolCalling(FORMATS["hermes"], polyfill=True)
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": PARAMETERS}


def parse(**fields):
    return parse_responses({"model": MODEL, "input": "Hi", **fields}, MODEL, HERMES)


def test_input_items_become_chat_turns():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
              "id": "fc_1", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]
    req = parse_responses({"model": MODEL, "input": items, "instructions": "You help.", "tools": [WEATHER],
                           "max_output_tokens": 20, "temperature": 0.5, "top_p": 0.9, "store": False}, MODEL, HERMES)
    prompt = req.request.prompt
    assert prompt.messages == [
        {"role": "system", "content": "You help."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    assert prompt.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                              "parameters": PARAMETERS}}]
    assert req.request.sampling["max_tokens"] == 20 and req.request.sampling["temperature"] == 0.5
    assert req.request.sampling["structured"].kind == "structural_tag" and req.tool_format is FORMATS["hermes"]
    assert parse().request.prompt.messages == [{"role": "user", "content": "Hi"}]


def test_text_format_is_the_output_constraint():
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    req = parse(text={"format": {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}})
    spec = req.request.sampling["structured"]
    assert (spec.kind, json.loads(spec.value), spec.source) == ("json_schema", schema, "text.format")
    assert parse(text={"format": {"type": "json_object"}}).request.sampling["structured"].kind == "json_object"
    assert "structured" not in parse(text={"format": {"type": "text"}}).request.sampling


@pytest.mark.parametrize("fields,param,words", [
    ({"store": True}, "store", "responses are not kept on this server (no server-side state); send store: false"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "responses are not kept on this server"),
    ({"conversation": "conv_1"}, "conversation", "responses are not kept"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools",
     "tools[0].type: 'web_search_preview' tools are not supported by this server; only function tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "'file_search' tools are not supported"),
    ({"tools": [{**WEATHER, "name": "get weather"}]}, "tools", "tools[0].name must be 1 to 64 letters"),
    ({"tools": [{**WEATHER, "parameters": {"type": 5}}]}, "tools", "tools[0] ('get_weather').parameters['type'] is "
                                                                   "not a valid JSON schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "names the function"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text",
     "cannot be combined with tool calls"),
    ({"text": {"format": {"type": "json_schema", "name": "r"}}}, "text", "text.format.schema must be a JSON schema"),
    ({"text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "x"}}}}, "text",
     "text.format.schema['type'] is not a valid JSON schema"),
    ({"text": {"format": {"type": "grammar"}}}, "text", "text.format must be"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "is not supported by this server"),
    ({"include": ["message.output_text.logprobs"]}, "include", "is not supported"),
    ({"truncation": "auto"}, "truncation", "is not supported"),
    ({"background": True}, "background", "is not supported"),
    ({"max_output_tokens": 0}, "max_output_tokens", "must be >= 1, got 0"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "input[0].type: 'item_reference' items are not "
                                                                  "supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input",
     "only text parts (input_text, output_text) are supported"),
    ({"input": ""}, "input", "the input is empty"),
    ({"colour": "blue"}, "colour", "unknown field"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unknown field"),  # text.format is its own
    ({"text": {"format": {"type": "json_object"}}, "regex": "[a-z]+"}, "text", "cannot be combined with regex"),
    ({"tools": [WEATHER], "choice": ["a"]}, "tools", "cannot be combined with choice"),
])
def test_unsupported_or_bad_fields_are_a_400_naming_them(fields, param, words):
    with pytest.raises(ApiError) as caught:
        parse(**fields)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert words in caught.value.message


def test_events_come_in_openais_order_and_build_the_response():
    req = parse(tools=[WEATHER], stream=True)
    writer = ResponseWriter(req)
    events = writer.start()
    for piece in ["Sure.", "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci", "ty\": \"Paris\"}}",
                  "\n</tool_call>"]:
        events += writer.text(piece)
    events += writer.finish("stop", [12, 4, 30])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    message, call = writer.final["output"]
    assert message["type"] == "message" and message["content"] == [
        {"type": "output_text", "text": "Sure.", "annotations": [], "logprobs": []}]
    assert (call["type"], call["name"], call["arguments"], call["status"]) == (
        "function_call", "get_weather", '{"city": "Paris"}', "completed")
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert events[8]["item"] == {**call, "status": "in_progress", "arguments": ""}
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"] == {
        "input_tokens": 12, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 30,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 42}
    assert final["tools"] == [{**WEATHER, "strict": None}] and final["tool_choice"] == "auto"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def test_a_response_cut_short_is_incomplete():
    writer = ResponseWriter(parse(max_output_tokens=3))
    writer.start()
    writer.text("One two")
    events = writer.finish("length", [5, 0, 3])
    assert events[-1]["type"] == "response.incomplete"
    assert writer.final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert writer.final["output"][0]["content"][0]["text"] == "One two"
