"""A ``GenerateRequest`` as the request path takes it: the sampling fields the client sets reach
``SamplingParams`` (``speculative`` and structured output among them), and those it leaves
unset take the server's defaults."""

from __future__ import annotations

import pytest

from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured.spec import StructuredOutput
from cluster.ingress.grpc_server import RequestError, request_payload
from tandem.client import build_generate_request

pytestmark = pytest.mark.unit


def test_a_request_may_opt_out_of_speculative_decoding():
    request, _ = request_payload(build_generate_request("hi", max_tokens=5, speculative=False))
    assert request.sampling == {"max_tokens": 5, "speculative": False}
    assert SamplingParams.from_mapping(request.sampling).speculative is False
    assert request_payload(build_generate_request("hi", speculative=True))[0].sampling == {"speculative": True}


def test_unset_sampling_fields_take_the_servers_defaults():
    request, tool_format = request_payload(build_generate_request([1, 2, 3]))
    assert tool_format is None and request.sampling == {} and request.prompt == [1, 2, 3]
    assert SamplingParams.from_mapping(request.sampling).speculative is True


@pytest.mark.parametrize("options, spec", [
    ({"json_schema": {"type": "object"}}, StructuredOutput("json_schema", '{"type": "object"}',
                                                           source="sampling.json_schema")),
    ({"json_object": True}, StructuredOutput("json_object", source="sampling.json_object")),
    ({"regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+", source="sampling.regex")),
    ({"grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"', syntax="ebnf", source="sampling.grammar")),
    ({"grammar": 'start: "a"', "grammar_syntax": "lark"},
     StructuredOutput("grammar", 'start: "a"', syntax="lark", source="sampling.grammar")),
    ({"choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]', source="sampling.choice")),
])
def test_structured_output_fields_become_the_spec_naming_their_field(options, spec):
    request, _ = request_payload(build_generate_request("hi", **options))
    assert request.sampling == {"structured": spec}
    assert SamplingParams.from_mapping(request.sampling).structured == spec


def test_structured_output_fields_the_server_refuses_name_the_field():
    request = build_generate_request("hi")
    request.sampling.json_object = False
    with pytest.raises(RequestError, match="^sampling.json_object: set it true, or leave it out for free text$"):
        request_payload(request)
    with pytest.raises(RequestError, match='^sampling.grammar.syntax: must be "ebnf" \\(GBNF\\) or "lark"'):
        request_payload(build_generate_request("hi", grammar="x", grammar_syntax="peg"))
    with pytest.raises(RequestError, match="^sampling.regex: the regex is empty$"):
        request = build_generate_request("hi")
        request.sampling.regex = ""
        request_payload(request)
    with pytest.raises(RequestError, match="^sampling.choice.options: give non-empty strings$"):
        request_payload(build_generate_request("hi", choice=["a", ""]))
    with pytest.raises(ValueError, match="at most one of json_schema, json_object, regex, grammar and choice"):
        build_generate_request("hi", regex="a", choice=["a"])


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_chat_with_tools_is_constrained_and_its_turns_reach_the_template():
    from cluster.engine.tool_calls.formats import FORMATS, ToolCalling

    hermes = ToolCalling(FORMATS["hermes"], polyfill=True)
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    request, tool_format = request_payload(build_generate_request(turns, tools=[WEATHER], tool_choice="required",
                                                                  parallel_tool_calls=False), hermes)
    assert tool_format is FORMATS["hermes"]
    assert request.prompt.messages[1]["tool_calls"] == turns[1]["tool_calls"]
    assert request.prompt.messages[2] == turns[2] and request.prompt.tools == [WEATHER]
    spec = request.sampling["structured"]
    assert (spec.kind, spec.source) == ("grammar", "tools")
    named, _ = request_payload(build_generate_request(turns[:1], tools=[WEATHER], tool_choice="get_weather"), hermes)
    assert named.sampling["structured"].kind == "grammar"
    _, none = request_payload(build_generate_request(turns[:1], tools=[WEATHER], tool_choice="none"), hermes)
    assert none is None
    with pytest.raises(RequestError, match=r"^chat\.tools\[0\]\.name must be 1 to 64 letters"):
        request_payload(build_generate_request(turns[:1], tools=[{"name": "a b"}]), hermes)
    with pytest.raises(RequestError, match=r"^chat\.tool_function: names the function 'nope'"):
        request_payload(build_generate_request(turns[:1], tools=[WEATHER], tool_choice="nope"), hermes)
    with pytest.raises(RequestError, match=r"^chat\.tools: this server takes no tools"):
        request_payload(build_generate_request(turns[:1], tools=[WEATHER]))
    with pytest.raises(RequestError, match=r"^sampling\.regex: cannot be combined with tool calls"):
        request_payload(build_generate_request(turns[:1], tools=[WEATHER], regex="a+"), hermes)
