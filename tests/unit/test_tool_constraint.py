"""The constraint a request's tools put on its output, checked with the engine's grammar library
(llguidance, through the backend's ``check``) on a byte-level tokenizer: ``auto`` is a structural tag over the tools' schemas;
``required``, a named function and ``parallel_tool_calls: false`` are grammars that accept exactly
the calls the format's parser reads (and refuse text before them, a second call, another name,
or arguments off the schema)."""

from __future__ import annotations

import json

import pytest

from cluster.engine.structured.grammars import check
from cluster.engine.tool_calls.constraint import tool_constraint
from cluster.engine.tool_calls.formats import FORMATS
from cluster.engine.tool_calls.parser import parse
from cluster.engine.tool_calls.tools import FunctionTool, ToolUse
from conftest import train_tokenizer

pytestmark = pytest.mark.unit

WEATHER = FunctionTool("get_weather", "", json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"], "additionalProperties": False}))
TIME = FunctionTool("get_time", "", json.dumps({"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                                 "required": ["zone"], "additionalProperties": False}))
PARIS, UTC = '{"city": "Paris"}', '{"zone": "UTC"}'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from llguidance import LLTokenizer
    from tokenizers import Tokenizer

    directory = tmp_path_factory.mktemp("tok")
    train_tokenizer(directory)
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return hf, LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size(), eos_token=[3])


def accepts(tokenizer, spec, text: str) -> bool:
    """Whether the spec's grammar, as the engine's backend compiles it, takes ``text`` whole (and may end there)."""
    from llguidance import LLMatcher

    hf, lltok = tokenizer
    matcher = LLMatcher(lltok, check(spec), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(hf.encode(text).ids) and matcher.is_accepting()


def test_no_constraint_without_calls():
    assert tool_constraint(ToolUse((WEATHER,), "none"), FORMATS["hermes"]) is None
    assert tool_constraint(ToolUse((), "auto"), FORMATS["hermes"]) is None


def test_auto_is_a_structural_tag_over_each_tools_schema(tokenizer):
    spec = tool_constraint(ToolUse((WEATHER, TIME), "auto"), FORMATS["hermes"])
    assert (spec.kind, spec.source) == ("structural_tag", "tools")
    assert json.loads(spec.value) == {"triggers": ["<tool_call>"], "structures": [
        {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": WEATHER.schema, "end": "}\n</tool_call>"},
        {"begin": '<tool_call>\n{"name": "get_time", "arguments": ', "schema": TIME.schema, "end": "}\n</tool_call>"}]}
    hermes = FORMATS["hermes"]
    two = "Sure. " + hermes.call_text("get_weather", PARIS) + "\n" + hermes.call_text("get_time", UTC) + " Done."
    assert accepts(tokenizer, spec, two)
    assert accepts(tokenizer, spec, "No tools needed.")
    assert not accepts(tokenizer, spec, hermes.call_text("get_weather", '{"town": "Paris"}'))
    llama = tool_constraint(ToolUse((WEATHER,), "auto"), FORMATS["llama3_json"])
    assert json.loads(llama.value)["triggers"] == ['{"name": ']
    assert accepts(tokenizer, llama, FORMATS["llama3_json"].call_text("get_weather", PARIS))


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_required_is_calls_and_nothing_else(tokenizer, name):
    fmt = FORMATS[name]
    spec = tool_constraint(ToolUse((WEATHER, TIME), "required"), fmt)
    assert (spec.kind, spec.syntax, spec.source) == ("grammar", "lark", "tools")
    one = fmt.call_text("get_weather", PARIS)
    if fmt.array:
        two = '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + PARIS + '}, {"name": "get_time", "arguments": ' \
              + UTC + "}]"
    else:
        two = one + {"hermes": "\n", "llama3_json": "; "}[name] + fmt.call_text("get_time", UTC)
    assert accepts(tokenizer, spec, one) and accepts(tokenizer, spec, two)
    assert [(c.name, c.arguments) for c in parse(fmt, two).calls] == [("get_weather", PARIS), ("get_time", UTC)]
    assert not accepts(tokenizer, spec, "Hello " + one)
    assert not accepts(tokenizer, spec, one + " and some text")
    assert not accepts(tokenizer, spec, fmt.call_text("get_time", '{"zone": "PST"}'))
    single = tool_constraint(ToolUse((WEATHER, TIME), "required", parallel=False), fmt)
    assert accepts(tokenizer, single, one) and not accepts(tokenizer, single, two)


def test_a_named_function_is_one_call_of_it(tokenizer):
    fmt = FORMATS["hermes"]
    spec = tool_constraint(ToolUse((WEATHER, TIME), "function", "get_time"), fmt)
    assert accepts(tokenizer, spec, fmt.call_text("get_time", UTC))
    assert not accepts(tokenizer, spec, fmt.call_text("get_weather", PARIS))
    assert not accepts(tokenizer, spec, fmt.call_text("get_time", UTC) + "\n" + fmt.call_text("get_time", UTC))


def test_auto_without_parallel_calls_allows_text_then_one_call(tokenizer):
    fmt = FORMATS["hermes"]
    spec = tool_constraint(ToolUse((WEATHER, TIME), "auto", parallel=False), fmt)
    assert spec.kind == "grammar"
    assert accepts(tokenizer, spec, "Let me see. " + fmt.call_text("get_weather", PARIS))
    assert accepts(tokenizer, spec, "Just text.")
    assert not accepts(tokenizer, spec, fmt.call_text("get_weather", PARIS) + "\n" + fmt.call_text("get_time", UTC))
