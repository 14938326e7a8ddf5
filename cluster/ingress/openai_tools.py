"""OpenAI's tool fields, as chat completions and the Responses API spell them, read into one
``ToolUse`` (``cluster/engine/tool_calls/tools.py``); and what a request with tools needs from
the served model: its call format and the constraint on its output (``constraint.py``).

Chat completions: ``tools: [{"type": "function", "function": {"name", "description",
"parameters", "strict"}}]``, ``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type":
"function", "function": {"name"}}``. Responses: ``tools: [{"type": "function", "name", ...}]``,
``tool_choice``: the same modes or ``{"type": "function", "name"}``. Any other tool type
(web search, file search, MCP, custom tools, ...) is refused, naming it: Tandem runs no tools
itself.
"""

from __future__ import annotations

from typing import Any, Mapping

from cluster.engine.request_limits import InvalidRequestError, quote
from cluster.engine.structured.spec import StructuredOutput
from cluster.engine.tool_calls.constraint import tool_constraint
from cluster.engine.tool_calls.formats import ToolCalling, ToolCallFormat
from cluster.engine.tool_calls.parser import ParsedCall
from cluster.engine.tool_calls.tools import ToolUse, function_tool, tool_use


def chat_tool_use(body: Mapping[str, Any]) -> ToolUse | None:
    """The chat completion's tools, or None when it gives none and no tool_choice."""
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, Mapping) or set(choice) - {"type", "function"}:
            raise InvalidRequestError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                                      f"\"function\": {{\"name\": ...}}}}; got {quote(choice)}")
        choice = ("function", function.get("name"))
    return _use(body, _functions(body, nested=True), choice)


def responses_tool_use(body: Mapping[str, Any]) -> ToolUse | None:
    """The Responses API request's tools, or None when it gives none and no tool_choice."""
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        if choice.get("type") != "function" or set(choice) - {"type", "name"}:
            raise InvalidRequestError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                                      f"\"name\": ...}}; got {quote(choice)}")
        choice = ("function", choice.get("name"))
    return _use(body, _functions(body, nested=False), choice)


def _functions(body: Mapping[str, Any], nested: bool) -> list:
    """The request's function tools, checked: each in its own object (``{"type": "function",
    "function": {...}}``, chat) or flat (``{"type": "function", "name", ...}``, Responses)."""
    checked = []
    for index, tool in enumerate(_tool_list(body)):
        where = f"tools[{index}]"
        _function_type(tool, where)
        function, names = tool, ("type", "name", "description", "parameters", "strict")
        if nested:
            _known(tool, ("type", "function"), where)
            function, where, names = tool.get("function"), f"{where}.function", names[1:]
            if not isinstance(function, Mapping):
                raise InvalidRequestError(f"{where} must be an object with the function's name and parameters")
        _known(function, names, where)
        checked.append(function_tool(function.get("name"), function.get("description"), function.get("parameters"),
                                     function.get("strict"), where))
    return checked


def tool_setup(use: ToolUse | None, calling: ToolCalling) -> tuple[ToolCallFormat | None, StructuredOutput | None]:
    """The format the request's calls are parsed in and the spec that constrains them; (None,
    None) when no call may be made. Raises InvalidRequestError when the model takes no tools."""
    if use is None or not use.tools:
        return None, None
    if calling.format is None:
        raise InvalidRequestError(f"tools: {calling.refusal}")
    if not use.calls_possible:
        return None, None
    return calling.format, tool_constraint(use, calling.format)


def prompt_tool_format(calling: ToolCalling) -> str:
    """The format Tandem's tool prompt asks for, where the chat template knows no tools."""
    return calling.format.name if calling.format is not None else "hermes"


def chat_tool_call(call: ParsedCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_list(body: Mapping[str, Any]) -> list:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError(f"tools must be a list of tool definitions, got {quote(tools)}")
    return tools


def _function_type(tool: Any, where: str) -> None:
    if not isinstance(tool, Mapping):
        raise InvalidRequestError(f"{where} must be a tool definition object, got {quote(tool)}")
    if tool.get("type") != "function":
        raise InvalidRequestError(f"{where}.type: {quote(tool.get('type'))} tools are not supported by this server; "
                                  "only function tools (Tandem runs no tools itself)")


def _known(value: Mapping, names: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise InvalidRequestError(f"{where}.{unknown[0]}: unknown field (not supported by this server)")


def _use(body: Mapping[str, Any], tools: list, choice: Any) -> ToolUse | None:
    if not tools and body.get("tool_choice") is None and body.get("parallel_tool_calls") is None:
        return None
    if choice is not None and not isinstance(choice, (str, tuple)):
        raise InvalidRequestError(f"tool_choice must be none, auto, required or a named function; got {quote(choice)}")
    return tool_use(tools, choice, body.get("parallel_tool_calls"))
