"""The structured output spec that holds a request's tool calls to its tools' schemas
(``structured/spec.py``; ``source`` is ``tools``, so a schema the grammar backend refuses is
an error naming the tools).

- ``auto``: a ``structural_tag``: free text until the format's trigger, then a call as the
  format writes it, its arguments held to the function's parameter schema; any number of calls.
- ``auto`` with ``parallel_tool_calls: false``: the same, with one call at most and nothing after it.
- ``required`` and a named function: the output is nothing but calls (one, for a named function
  or without parallel calls), so it always parses as calls.

The last two are Lark grammars for the engine's backend (llguidance: ``%json`` embeds a schema,
``[lazy]`` makes the free text end at the trigger, as its structural tags do), with its JSON
layout (``structured/grammars.py``), so that the same model text comes out whichever way a
call was asked for. A format whose calls form one JSON array (Mistral) has one structure: the
array of calls.
"""

from __future__ import annotations

import json

from cluster.engine.structured.grammars import JSON_OPTIONS
from cluster.engine.structured.spec import StructuredOutput
from cluster.engine.tool_calls.formats import ToolCallFormat
from cluster.engine.tool_calls.tools import FunctionTool, ToolUse

SEPARATORS = {"hermes": "\n", "llama3_json": "; "}  # between the calls of a calls-only output


def tool_constraint(use: ToolUse, fmt: ToolCallFormat) -> StructuredOutput | None:
    """The spec for ``use``, or None when no call may be made."""
    tools = use.offered()
    if not use.calls_possible or not tools:
        return None
    single = use.choice == "function" or not use.parallel
    trigger = fmt.constraint_trigger or fmt.triggers[0].text
    structures = _structures(tools, fmt, single)
    if use.choice == "auto" and not single:
        value = {"triggers": [trigger], "structures": structures}
        return StructuredOutput("structural_tag", json.dumps(value, ensure_ascii=False), source="tools")
    calls = " | ".join(f"call_{i}" for i in range(len(structures)))
    rules = [f"call_{i}: {_literal(s['begin'])} {_json(s['schema'])} {_literal(s['end'])}"
             for i, s in enumerate(structures)]
    if use.choice == "auto":  # free text, then at most one call, which ends the output
        bodies = " | ".join(f"body_{i}" for i in range(len(structures)))
        rules = [f"body_{i}: {_literal(s['begin'][len(trigger):])} {_json(s['schema'])} {_literal(s['end'])}"
                 for i, s in enumerate(structures)]
        lines = ["%llguidance {}", f"start: free | trigger ({bodies})", "free: FREE", r"FREE: /(.|\n)*/",
                 f"trigger[lazy]: FREE {_literal(trigger)}", *rules]
    elif single or fmt.array:
        lines = [f"start: {calls}", *rules]
    else:
        lines = [f"start: call ({_literal(SEPARATORS[fmt.name])} call)*", f"call: {calls}", *rules]
    return StructuredOutput("grammar", "\n".join(lines) + "\n", syntax="lark", source="tools")


def _structures(tools: tuple[FunctionTool, ...], fmt: ToolCallFormat, single: bool) -> list[dict]:
    """``{"begin", "schema", "end"}`` per call (the arguments' schema between the call's text),
    or, for an array format, one: the trigger, then the array of calls."""
    if not fmt.array:
        return [{"begin": fmt.call_begin(t.name), "schema": t.schema, "end": fmt.call_suffix} for t in tools]
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, fmt.arguments_key: t.schema},
              "required": ["name", fmt.arguments_key], "additionalProperties": False} for t in tools]
    array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if single:
        array["maxItems"] = 1
    return [{"begin": fmt.triggers[0].text, "schema": array, "end": ""}]


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
