"""Tools for a chat template that knows nothing of them (SmolLM2's, plain ChatML): the messages
are rewritten into ones it can render, so that tools are never silently dropped.

The tools go into the system message, described as Hermes-style models are prompted (a
``<tools>`` block of JSON signatures and the call syntax of the chosen format); an
assistant's earlier calls become its text, written as the model is asked to write them; tool
results become a user turn of ``<tool_response>`` blocks (consecutive results in one turn, so
templates that insist on alternating roles still render). llama.cpp's server does the like for
such templates (its minja polyfills, with a generic JSON format); vLLM hands the tools to the
template, which drops them.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from cluster.engine.tool_calls.formats import ToolCallFormat

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, write the function's name and its arguments as a JSON object, exactly like this:
{example}"""


def tools_prompt(tools: Sequence[Mapping[str, Any]], fmt: ToolCallFormat) -> str:
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_PROMPT.format(tools=signatures, example=fmt.call_text("<function-name>", "<arguments-json-object>"))


def has_tool_turns(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def polyfill_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                      fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """Checked messages (``chat_template.validate_messages``), rewritten without tools, tool
    calls or tool results."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        calls = [call_text(call, fmt) for call in message.get("tool_calls") or ()]
        message = {k: v for k, v in message.items() if k != "tool_calls"}
        if calls:
            message["content"] = "\n".join(([message["content"]] if message["content"] else []) + calls)
        out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        prompt = tools_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def call_text(call: Mapping[str, Any], fmt: ToolCallFormat) -> str:
    function = call["function"]
    arguments = function["arguments"]
    return fmt.call_text(function["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
