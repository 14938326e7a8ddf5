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
    request = request_payload(build_generate_request("hi", max_tokens=5, speculative=False))
    assert request.sampling == {"max_tokens": 5, "speculative": False}
    assert SamplingParams.from_mapping(request.sampling).speculative is False
    assert request_payload(build_generate_request("hi", speculative=True)).sampling == {"speculative": True}


def test_unset_sampling_fields_take_the_servers_defaults():
    request = request_payload(build_generate_request([1, 2, 3]))
    assert request.sampling == {} and request.prompt == [1, 2, 3]
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
    request = request_payload(build_generate_request("hi", **options))
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
