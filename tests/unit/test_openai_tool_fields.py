"""Chat completions' tool fields: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` reach the
chat template and the constraint; a bad name or schema is a 400 naming the tool; a model that
takes no tools, a tool of another type and fields Tandem does not honour are refused; calls come
back in the message and as OpenAI's stream deltas."""

from __future__ import annotations

import json

import pytest

from cluster.engine.chat_template import ChatPrompt
from cluster.engine.tool_calls.formats import FORMATS, ToolCalling
from cluster.engine.tool_calls.parser import ArgumentsDelta, CallClosed, CallOpened, ContentDelta, ParsedCall
from cluster.ingress.openai_api import ApiError, Choice, event_chunks, parse_chat, parse_completion, response

pytestmark = pytest.mark.unit

MODEL = "tiny"
HERMES = ToolCalling(FORMATS["hermes"], polyfill=True)
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": PARAMETERS}}


def chat(calling=HERMES, **fields):
    return parse_chat({"model": MODEL, "messages": MESSAGES, **fields}, MODEL, calling)


def test_tools_reach_the_template_and_constrain_the_output():
    req = chat(tools=[WEATHER], tool_choice="required")
    assert req.request.prompt == ChatPrompt(MESSAGES, True, [WEATHER], "hermes")
    spec = req.request.sampling["structured"]
    assert (spec.kind, spec.syntax, spec.source) == ("grammar", "lark", "tools")
    assert '"<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": "' in spec.value
    assert req.tool_format is FORMATS["hermes"]
    auto = chat(tools=[WEATHER])
    assert auto.request.sampling["structured"].kind == "structural_tag" and auto.tool_format is FORMATS["hermes"]
    named = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 parallel_tool_calls=False)
    assert named.request.sampling["structured"].kind == "grammar"
    none = chat(tools=[WEATHER], tool_choice="none")  # no calls: no constraint, no parsing; the model knows its tools
    assert "structured" not in none.request.sampling and none.tool_format is None
    assert none.request.prompt.tools == [WEATHER]
    plain = chat()
    assert plain.tool_format is None and plain.request.prompt.tools is None


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "name": "get weather"}}]}, "tools",
     "tools[0].function.name must be 1 to 64 letters, digits, underscores or dashes; got 'get weather'"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "objekt"}}}]}, "tools",
     "tools[0].function ('get_weather').parameters['type'] is not a valid JSON schema: 'objekt' is not valid"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": []}}]}, "tools",
     "tools[0].function ('get_weather').parameters must be a JSON schema object"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named 'get_weather'"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0].type: 'web_search' tools are not supported"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "colour": 1}}]}, "tools",
     "tools[0].function.colour: unknown field"),
    ({"tools": "get_weather"}, "tools", "tools must be a list"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be none, auto, required or a named"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names the function 'nope', which is not among the tools (get_weather)"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice",
     "tool_choice must be none, auto, required or"),
    ({"tool_choice": "required"}, "tool_choice", "required needs tools to call"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be true or false"),
])
def test_bad_tools_are_a_400_naming_the_tool(fields, param, words):
    with pytest.raises(ApiError) as caught:
        chat(**fields)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert words in caught.value.message


def test_a_model_that_takes_no_tools_refuses_them_and_completions_have_none():
    refusing = ToolCalling(None, refusal="this model's chat template writes tool calls in a format Tandem does not "
                                         "recognise; set model.tool_call_format (hermes, llama3_json or mistral)")
    with pytest.raises(ApiError, match="tools: this model's chat template writes tool calls in a format") as caught:
        chat(refusing, tools=[WEATHER])
    assert caught.value.param == "tools"
    for name, value in (("tool_choice", "auto"), ("parallel_tool_calls", True), ("tools", [WEATHER])):
        with pytest.raises(ApiError, match=f"{name}: unknown field"):
            parse_completion({"model": MODEL, "prompt": "x", name: value}, MODEL)


def test_tool_calls_and_another_output_constraint_are_refused_together():
    for other in ({"response_format": {"type": "json_object"}}, {"regex": "[a-z]+"}, {"choice": ["a", "b"]}):
        with pytest.raises(ApiError, match="tools: tool calls cannot be combined with another constraint") as caught:
            chat(tools=[WEATHER], **other)
        assert caught.value.param == "tools"
        assert chat(tools=[WEATHER], tool_choice="none", **other).request.sampling["structured"].source != "tools"


def test_the_message_holds_the_calls_and_no_content():
    req = chat(tools=[WEATHER])
    calls = [ParsedCall("call_1", "get_weather", '{"city": "Paris"}', True)]
    body = response(req, [Choice(0, "", [5, 6], finish_reason="tool_calls", usage=[3, 0, 2], tool_calls=calls)], str)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_stream_deltas_are_openais():
    req = chat(tools=[WEATHER], stream=True)
    events = [ContentDelta("Checking."), CallOpened(0, "call_1", "get_weather"), ArgumentsDelta(0, '{"city": '),
              ArgumentsDelta(0, '"Paris"}'), CallClosed(0, '{"city": "Paris"}')]
    deltas = [c["choices"][0]["delta"] for c in event_chunks(req, 0, events)]
    assert deltas == [
        {"content": "Checking."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    only_logprobs = event_chunks(req, 0, [], logprobs={"content": []})
    assert [(c["choices"][0]["delta"], c["choices"][0]["logprobs"]) for c in only_logprobs] == [({}, {"content": []})]
    assert json.dumps(deltas)  # plain JSON
