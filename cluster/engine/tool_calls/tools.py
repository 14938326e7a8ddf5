"""The functions a request offers the model, and how it may use them (``tool_choice``,
``parallel_tool_calls``), checked once whatever API they came through: a bad name or schema
is an error naming the tool (``tools[1] ('get_weather').parameters: ...``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cluster.engine.request_limits import InvalidRequestError, clip, quote

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("none", "auto", "required", "function")
MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True)
class FunctionTool:
    """One function: its name, what it does, and its arguments' JSON schema (as JSON text,
    so that the value is immutable; ``{"type": "object"}`` when the caller gave none)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'
    strict: bool | None = None

    @property
    def schema(self) -> dict:
        return json.loads(self.parameters)

    def template_form(self) -> dict:
        """The tool as chat templates written for transformers expect it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and how the model may call them. ``choice`` is ``none`` (no calls),
    ``auto`` (text or calls), ``required`` (one call at least) or ``function`` (a call of
    ``function``); ``parallel`` false allows one call at most."""

    tools: tuple[FunctionTool, ...]
    choice: str = "auto"
    function: str = ""
    parallel: bool = True

    @property
    def calls_possible(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def calls_required(self) -> bool:
        return self.choice in ("required", "function")

    def offered(self) -> tuple[FunctionTool, ...]:
        """The tools the model may call: all, or only the named one."""
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools if self.choice != "none" else ()

    def template_tools(self) -> list[dict] | None:
        """What the chat template is given as ``tools``: all of them, even under ``none`` (as
        OpenAI and vLLM do: the model still knows its tools, and the prompt's prefix, cached
        from earlier turns, stays the same), or None when the request gives none."""
        return [t.template_form() for t in self.tools] if self.tools else None


def function_tool(name: Any, description: Any, parameters: Any, strict: Any, where: str) -> FunctionTool:
    """A checked FunctionTool from a request's values; ``where`` names it in errors
    (``tools[0]``, ``tools[0].function``)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequestError(f"{where}.name must be 1 to 64 letters, digits, underscores or dashes; "
                                  f"got {quote(name)}")
    where = f"{where} ({quote(name)})"
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description must be a string, got {quote(description)}")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.strict must be true or false, got {quote(strict)}")
    if parameters is None:
        parameters = {"type": "object"}
    if not isinstance(parameters, Mapping):
        raise InvalidRequestError(f"{where}.parameters must be a JSON schema object, got {quote(parameters)}")
    check_schema(parameters, f"{where}.parameters")
    return FunctionTool(name, description, json.dumps(parameters, ensure_ascii=False), strict)


def check_schema(schema: Mapping, where: str) -> None:
    """Refuses a schema that is not a valid JSON schema (by its own draft's meta-schema)."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise InvalidRequestError(f"{where}{path} is not a valid JSON schema: {clip(exc.message)}") from None


def tool_use(tools: Sequence[FunctionTool], choice: Any, parallel: Any, field: str = "tool_choice") -> ToolUse:
    """The checked ToolUse. ``choice`` is None (``auto`` with tools, ``none`` without), a mode,
    or ``("function", name)``; ``parallel`` None means true."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidRequestError(f"tools: two tools are named {quote(twice[0])}; names must differ")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be true or false, got {quote(parallel)}")
    function = ""
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, tuple):
        choice, function = choice
        if function not in names:
            raise InvalidRequestError(f"{field}: names the function {quote(function)}, which is not among the "
                                      f"tools ({clip(', '.join(names)) or 'none given'})")
    elif choice not in CHOICES[:3]:
        raise InvalidRequestError(f"{field} must be none, auto, required or a named function; got {quote(choice)}")
    if choice == "required" and not tools:
        raise InvalidRequestError(f"{field}: required needs tools to call; the request gives none")
    return ToolUse(tuple(tools), choice, function, parallel)
