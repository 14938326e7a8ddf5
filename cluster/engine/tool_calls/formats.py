"""The text formats models write tool calls in, one table row each, and which one a model uses.

- ``hermes`` (Hermes 2/3, Qwen 2.5/3, and Tandem's tool prompt for templates without tools):
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, once per call;
- ``llama3_json`` (Llama 3.1/3.2/3.3): ``{"name": "f", "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``;
- ``mistral`` (Mistral 7B v0.3, Nemo): ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``.

The format is the topology's ``model.tool_call_format``; ``auto`` reads it from the chat
template's text (the markers below). A template that never mentions ``tools`` gets Tandem's
tool prompt in the hermes format (``polyfill.py``); one that renders tools in a format not
listed here is refused, naming the key to set, rather than having its calls go unparsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SETTINGS = ("auto", "hermes", "llama3_json", "mistral", "none")


@dataclass(frozen=True)
class Trigger:
    """Text that opens a tool call region. ``kept``: it is the start of the calls' own JSON
    (``{"name"``), read as part of the call, not a marker before it."""

    text: str
    kept: bool = False


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    triggers: tuple[Trigger, ...]
    call_prefix: str  # before the function's name, as the model writes one call
    arguments_key: str  # "arguments" or "parameters"
    call_suffix: str  # after the arguments' JSON
    array: bool = False  # the calls of one region form a JSON array
    closer: str = ""  # after each call object (``</tool_call>``)
    separator: str = ""  # between the call objects of one region, besides an array's ``,``
    constraint_trigger: str = ""  # the trigger the constraint waits for (default: the first)
    id_length: int = 0  # calls get ids of this many letters and digits (Mistral's templates want 9)

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it; ``arguments`` is JSON text."""
        return f'{self.call_prefix}{{"name": {json.dumps(name)}, "{self.arguments_key}": {arguments}{self.call_suffix}'

    def call_begin(self, name: str) -> str:
        """A call's text up to its arguments: where the constraint takes over."""
        return f'{self.call_prefix}{{"name": {json.dumps(name)}, "{self.arguments_key}": '


FORMATS = {
    "hermes": ToolCallFormat("hermes", (Trigger("<tool_call>"),), "<tool_call>\n", "arguments", "}\n</tool_call>",
                             closer="</tool_call>"),
    "llama3_json": ToolCallFormat("llama3_json", (Trigger("<|python_tag|>"), Trigger('{"name"', kept=True)), "",
                                  "parameters", "}", separator=";", constraint_trigger='{"name": '),
    "mistral": ToolCallFormat("mistral", (Trigger("[TOOL_CALLS]"), Trigger('[{"name"', kept=True)), "[TOOL_CALLS][",
                              "arguments", "}]", array=True, id_length=9),
}
# Markers in a chat template's text that say which format it renders, tested in this order.
MARKERS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"),
           ("ipython", "llama3_json"))


@dataclass(frozen=True)
class ToolCalling:
    """How a served model takes tools: its format, whether Tandem's tool prompt stands in for a
    template that knows no tools (``polyfill``), or why tools are refused (``refusal``)."""

    format: ToolCallFormat | None
    polyfill: bool = False
    refusal: str = ""


def tool_calling(setting: str, template_source: str | None, template_knows_tools: bool) -> ToolCalling:
    """The served model's tool calling, from ``model.tool_call_format`` and its chat template."""
    if setting not in SETTINGS:
        raise ValueError(f"model.tool_call_format must be one of {', '.join(SETTINGS)}; got {setting!r}")
    if setting == "none":
        return ToolCalling(None, refusal="tools are turned off on this server (model.tool_call_format: none)")
    if template_source is None:
        return ToolCalling(None, refusal="this model has no chat template, so it cannot be given tools")
    if setting != "auto":
        return ToolCalling(FORMATS[setting], polyfill=not template_knows_tools)
    if not template_knows_tools:
        return ToolCalling(FORMATS["hermes"], polyfill=True)
    for marker, name in MARKERS:
        if marker in template_source:
            return ToolCalling(FORMATS[name])
    return ToolCalling(None, refusal="this model's chat template writes tool calls in a format Tandem does not "
                                     "recognise; set model.tool_call_format (hermes, llama3_json or mistral)")
