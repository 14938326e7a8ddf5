"""The tool call parser: exact calls and content from exact texts in each format (Hermes/Qwen,
Llama 3 JSON, Mistral), and the same result however the text is cut into deltas (a trigger
split across deltas, one character at a time), with arguments streamed as the model wrote them."""

from __future__ import annotations

import pytest

from cluster.engine.tool_calls.formats import FORMATS, tool_calling
from cluster.engine.tool_calls.parser import (ArgumentsDelta, CallClosed, CallOpened, ContentDelta, ToolCallParser,
                                              parse)

pytestmark = pytest.mark.unit

HERMES, LLAMA, MISTRAL = FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"]
WEATHER = '{"city": "Paris", "days": [1, 2], "units": {"t": "C}"}}'


def calls(output):
    return [(c.name, c.arguments, c.complete) for c in output.calls]


@pytest.mark.parametrize("fmt,text,content,expected", [
    (HERMES, f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', "",
     [("get_weather", WEATHER, True)]),
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>', "Let me look.",
     [("a", "{}", True), ("b", '{"x": 1}', True)]),
    (HERMES, '<tool_call>{"arguments": {"x": "y"}, "name": "late"}</tool_call> Done.', " Done.",
     [("late", '{"x": "y"}', True)]),
    (HERMES, '<tool_call>\n{"name": "s", "arguments": "{\\"q\\": 1}"}\n</tool_call>', "", [("s", '{"q": 1}', True)]),
    (HERMES, '<tool_call>\n{"name": "cut", "arguments": {"city": "Par', "", [("cut", '{"city": "Par', False)]),
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call', "", [("a", "{}", True)]),
    (HERMES, 'Plain text, a <tool of sorts.', "Plain text, a <tool of sorts.", []),
    (HERMES, 'Opens <tool_call> but is prose', "Opens <tool_call> but is prose", []),
    (HERMES, '<tool_call>\n{"nom": "x"}\n</tool_call>', '<tool_call>\n{"nom": "x"}\n</tool_call>', []),
    (LLAMA, f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}', "",
     [("get_weather", WEATHER, True)]),
    (LLAMA, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "",
     [("a", '{"x": 1}', True), ("b", "{}", True)]),
    (LLAMA, 'The answer is {"x": 1}.', 'The answer is {"x": 1}.', []),
    (MISTRAL, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "b", "arguments": {{}}}}]',
     "", [("get_weather", WEATHER, True), ("b", "{}", True)]),
    (MISTRAL, '[{"name": "a", "arguments": {"x": [1, "]"]}}]', "", [("a", '{"x": [1, "]"]}', True)]),
], ids=["hermes", "hermes-two-after-text", "hermes-name-last", "hermes-arguments-as-string", "hermes-cut-short",
        "hermes-closer-cut-short",
        "hermes-partial-trigger-is-text", "hermes-trigger-then-prose", "hermes-object-without-name",
        "llama3-python-tag", "llama3-two", "llama3-json-in-prose", "mistral-two", "mistral-special-token-dropped"])
def test_whole_texts(fmt, text, content, expected):
    output = parse(fmt, text)
    assert output.content == content
    assert calls(output) == expected


def replay(fmt, pieces):
    """Feeds the pieces; returns the events and the parser."""
    parser = ToolCallParser(fmt)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return events, parser


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_any_chunking_gives_the_same_events_joined(size):
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>\n'
            '<tool_call>\n{"name": "f", "arguments": {"a": "<tool_call>"}}\n</tool_call>')
    events, parser = replay(HERMES, [text[i:i + size] for i in range(0, len(text), size)])
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Checking."
    opened = [e for e in events if isinstance(e, CallOpened)]
    assert [(e.index, e.name) for e in opened] == [(0, "get_weather"), (1, "f")]
    assert opened[0].id.startswith("call_") and len(opened[0].id) == 29 and opened[0].id != opened[1].id
    for index, arguments in enumerate([WEATHER, '{"a": "<tool_call>"}']):
        assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == index) == arguments
        assert [e.arguments for e in events if isinstance(e, CallClosed) and e.index == index] == [arguments]
    # each call's name comes before its arguments, and its arguments before it closes
    kinds = [(type(e).__name__, getattr(e, "index", None)) for e in events if not isinstance(e, ContentDelta)]
    assert kinds.index(("CallOpened", 1)) > kinds.index(("CallClosed", 0))
    assert parser.content == "Checking."


def test_a_trigger_split_across_deltas_is_held_until_it_is_known():
    events, _ = replay(HERMES, ["Hi <to", "ol_", "call>\n{\"name\": \"f\", \"arg", "uments\": {\"x\"", ": 1}}\n</tool",
                                "_call>"])
    assert events[0] == ContentDelta("Hi")
    assert [type(e) for e in events[1:]] == [CallOpened, ArgumentsDelta, ArgumentsDelta, CallClosed]
    assert [e.text for e in events if isinstance(e, ArgumentsDelta)] == ['{"x"', ": 1}"]
    held, _ = replay(HERMES, ["Hi <to", "day"])
    assert held == [ContentDelta("Hi"), ContentDelta(" <today")]


def test_streamed_text_is_content_as_it_comes_and_whitespace_waits():
    parser = ToolCallParser(HERMES)
    assert parser.feed("Hello") == [ContentDelta("Hello")]
    assert parser.feed(" world\n") == [ContentDelta(" world")]  # the newline waits: a call may follow
    assert parser.feed("Bye") == [ContentDelta("\nBye")]
    assert parser.feed("\n") == []
    assert parser.finish() == [ContentDelta("\n")]  # no calls: the text is kept exactly
    assert parser.content == "Hello world\nBye\n"


def test_mistral_calls_get_the_nine_character_ids_its_templates_want():
    output = parse(MISTRAL, '[TOOL_CALLS][{"name": "a", "arguments": {}}]')
    assert len(output.calls[0].id) == 9 and output.calls[0].id.isalnum()


@pytest.mark.parametrize("setting,source,knows,expected", [
    ("auto", "{% for m in messages %}{{ m.content }}{% endfor %}", False, ("hermes", True, "")),
    ("auto", "{% if tools %}<tool_call>{% endif %}", True, ("hermes", False, "")),
    ("auto", "{% if tools %}[TOOL_CALLS]{% endif %}", True, ("mistral", False, "")),
    ("auto", "{% if tools %}<|python_tag|>{% endif %}", True, ("llama3_json", False, "")),
    ("auto", "{% if tools %}<function={{ x }}>{% endif %}", True, (None, False, "set model.tool_call_format")),
    ("llama3_json", "{{ messages }}", False, ("llama3_json", True, "")),
    ("none", "{% if tools %}<tool_call>{% endif %}", True, (None, False, "model.tool_call_format: none")),
    ("auto", None, False, (None, False, "no chat template")),
])
def test_the_format_comes_from_the_setting_or_the_template(setting, source, knows, expected):
    calling = tool_calling(setting, source, knows)
    name, polyfill, refusal = expected
    assert (calling.format.name if calling.format else None, calling.polyfill) == (name, polyfill)
    assert refusal in calling.refusal and bool(refusal) == bool(calling.refusal)
