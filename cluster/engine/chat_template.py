"""Chat templates: a model's own Jinja template turns a list of messages into its prompt text.

Templates come with the model (``chat_template.jinja``, ``chat_template`` in
``tokenizer_config.json``, or ``tokenizer.chat_template`` in a GGUF) and are untrusted code, so
they render in Jinja's immutable sandbox, with what templates written for transformers expect:
``messages``, ``add_generation_prompt``, ``tools`` (None when absent), the special tokens
(``bos_token``, ``eos_token``, ...), loop controls, a ``tojson`` filter that keeps non-ASCII text,
``raise_exception(message)`` and ``strftime_now(format)``.

Tool turns: an assistant message's ``tool_calls`` reach the template with their arguments as
objects (transformers' convention, which tool-use templates expect), ``tool`` messages with
their ``tool_call_id``. A template that never mentions ``tools`` gets them through Tandem's
tool prompt (``tool_calls/polyfill.py``) instead of losing them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping, Sequence

from cluster.engine.tool_calls.formats import FORMATS
from cluster.engine.tool_calls.polyfill import has_tool_turns, polyfill_messages

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """Messages the template cannot render, or a template that does not work; the message names
    the field (``messages[2].role``) or the template's own complaint."""


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI-style parts ``[{"type": "text", "text": ...}]``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"{where}[{index}] must be {{\"type\": \"text\", \"text\": \"...\"}}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError(f"{where} must be a string or a list of text parts, got {_shown(content)}")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages, checked and with content as text; raises ChatTemplateError naming the field."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content', got {_shown(message)}")
        role = message.get("role")
        if role not in ROLES:
            what = "is missing" if "role" not in message else f"must be one of {', '.join(ROLES)}; got {_shown(role)}"
            raise ChatTemplateError(f"{where}.role {what}")
        out = dict(message)
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise ChatTemplateError(f"{where}.tool_calls: only an assistant's message has tool calls")
            out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and not isinstance(message.get("tool_call_id", ""), str):
            raise ChatTemplateError(f"{where}.tool_call_id must be a string, got {_shown(message['tool_call_id'])}")
        content = message.get("content")
        if content is None:
            if not (role == "assistant" and out.get("tool_calls")):
                raise ChatTemplateError(f"{where}.content is missing")
            out["content"] = ""
        else:
            out["content"] = _content_text(content, f"{where}.content")
        checked.append(out)
    return checked


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's calls in OpenAI's shape, ``{"id", "type": "function", "function": {"name",
    "arguments"}}``; the arguments stay JSON text here."""
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ChatTemplateError(f"{where} must be a list of calls, got {_shown(calls)}")
    checked = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ChatTemplateError(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": "
                                    f"{{\"name\", \"arguments\"}}}}, got {_shown(call)}")
        if call.get("type", "function") != "function":
            raise ChatTemplateError(f"{at}.type must be function, got {_shown(call.get('type'))}")
        if not isinstance(call.get("id", ""), str):
            raise ChatTemplateError(f"{at}.id must be a string, got {_shown(call.get('id'))}")
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise ChatTemplateError(f"{at}.function.name must be a non-empty string, got {_shown(name)}")
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise ChatTemplateError(f"{at}.function.arguments must be JSON text, got {_shown(arguments)}")
        checked.append({**call, "type": "function", "function": {**function, "name": name, "arguments": arguments}})
    return checked


def _arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls as tool-use templates expect them: arguments that are a JSON object, as an object."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                try:
                    arguments = json.loads(call["function"]["arguments"])
                except ValueError:
                    arguments = call["function"]["arguments"]
                calls.append({**call, "function": {**call["function"], "arguments": arguments}})
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template and the special tokens it may refer to."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...
    origin: str = "chat template"  # where it came from, for error messages

    def __post_init__(self):
        from jinja2 import TemplateError, meta

        environment = _environment()
        try:
            compiled = environment.from_string(self.source)
            names = meta.find_undeclared_variables(environment.parse(self.source))
        except TemplateError as exc:
            raise ChatTemplateError(f"{self.origin}: the chat template does not compile: {exc}") from None
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "knows_tools", "tools" in names or "custom_tools" in names)

    def render(self, messages: Any, add_generation_prompt: bool = True, tools: list | None = None,
               tool_format: str = "hermes") -> str:
        """The prompt text for ``messages``; raises ChatTemplateError for bad messages, or when
        the template itself refuses them (its ``raise_exception``) or fails. A template that
        does not know tools gets them, and tool turns, through Tandem's tool prompt in
        ``tool_format`` (``tool_calls/formats.py``)."""
        from jinja2 import TemplateError

        checked = validate_messages(messages)
        if tools is not None and not isinstance(tools, list):
            raise ChatTemplateError(f"tools must be a list, got {_shown(tools)}")
        if not self.knows_tools and (tools or has_tool_turns(checked)):
            checked, tools = polyfill_messages(checked, tools, FORMATS[tool_format]), None
        else:
            checked = _arguments_as_objects(checked)
        try:
            return self._compiled.render(
                messages=checked, add_generation_prompt=add_generation_prompt, tools=tools, **self.special_tokens
            )
        except _TemplateRaised as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"{self.origin}: rendering the chat template failed: {exc}") from None


@dataclass(frozen=True)
class ChatPrompt:
    """A prompt given as chat messages: rendered with the model's template, then tokenized."""

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    tools: list | None = None  # OpenAI's shape, as templates take them
    tool_format: str = "hermes"  # how Tandem's tool prompt asks for calls, for templates that know no tools


def template_source(value: Any) -> str | None:
    """The template text from a ``chat_template`` value: a string, or transformers' list of
    named templates (the one named ``default``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None
