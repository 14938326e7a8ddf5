"""OpenAI's Responses API (``POST /v1/responses``): its request body becomes a chat request on
the request path, and the answer becomes a response object, or its stream of events.

Honoured: ``input`` (text, or items: messages with text parts, ``function_call`` and
``function_call_output``), ``instructions`` (a system message first), ``tools`` (function
tools), ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (``text``, ``json_schema``,
``json_object``: the output is constrained to it), ``max_output_tokens``, ``temperature``,
``top_p``, ``stream``, and Tandem's extra sampling, scheduling and structured-output fields (as
in chat, but for ``response_format``: ``text.format`` is the Responses API's own).

Nothing is kept: ``store`` may be false (or left out), and ``store: true``,
``previous_response_id`` and ``conversation`` are refused with a 400 that says so. Any other
field is refused unless it is at its neutral value.

Streaming follows OpenAI's event order, each event with its ``sequence_number``:
``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta`` ... ``response.output_text.done``, ``response.content_part.done``,
for a call ``response.function_call_arguments.delta`` ... ``.done``, then
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it short).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from cluster.engine.chat_template import ChatPrompt
from cluster.engine.structured.spec import StructuredOutput
from cluster.engine.tool_calls.formats import ToolCalling, ToolCallFormat
from cluster.engine.tool_calls.parser import ArgumentsDelta, CallClosed, CallOpened, ContentDelta, ToolCallParser
from cluster.engine.tool_calls.tools import NAME, ToolUse, check_schema
from cluster.engine.request_limits import quote
from cluster.ingress.openai_api import _EXTRA, ApiError, common_fields, invalid, refused_as_400
from cluster.ingress.openai_tools import prompt_tool_format, responses_tool_use, tool_setup
from cluster.protocol.messages import ApiRequest

NOT_KEPT = "responses are not kept on this server (no server-side state)"
# Fields OpenAI defines that Tandem accepts only at their neutral value.
_NEUTRAL = {
    "background": lambda v: not v,
    "include": lambda v: not v,
    "metadata": lambda v: not v,
    "max_tool_calls": lambda v: v is None,
    "prompt": lambda v: v is None,
    "prompt_cache_key": lambda v: v is None,
    "reasoning": lambda v: not v,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "stream_options": lambda v: not v or (isinstance(v, Mapping) and not v.get("include_obfuscation")),
    "top_logprobs": lambda v: not v,
    "truncation": lambda v: v in (None, "disabled"),
    "safety_identifier": lambda v: v is None,
}
_TANDEM = tuple(n for n in _EXTRA if n != "response_format") + ("seed",)  # text.format stands for response_format
FIELDS = frozenset(("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                    "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
                    "conversation", "user") + _TANDEM) | set(_NEUTRAL)
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass
class ResponsesRequest:
    model: str
    request: ApiRequest
    stream: bool
    body: Mapping[str, Any]  # echoed in the response object
    tools: ToolUse | None = None
    tool_format: ToolCallFormat | None = None  # set when the output may hold calls
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))


def parse_responses(body: Any, model_name: str, tool_calling: ToolCalling) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise invalid(unknown[0], "unknown field")
    if body.get("store"):
        raise invalid("store", f"{NOT_KEPT}; send store: false")
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise invalid(name, f"{NOT_KEPT}; send the whole conversation as input items")
    for name, neutral in _NEUTRAL.items():
        if name in body and not neutral(body[name]):
            raise invalid(name, f"{quote(body[name])} is not supported by this server")
    messages = _messages(body)
    with refused_as_400():
        use = responses_tool_use(body)
        tool_format, constraint = tool_setup(use, tool_calling)
    text_spec = _text_format(body.get("text"))
    if text_spec is not None and constraint is not None:
        raise invalid("text", "a text.format other than text cannot be combined with tool calls; "
                              "send tool_choice: none, or no tools")
    mapped = {name: body[name] for name in ("model", "temperature", "top_p", "user") + _TANDEM if name in body}
    if body.get("max_output_tokens") is not None:
        mapped["max_tokens"] = body["max_output_tokens"]
    try:
        fields = common_fields(mapped, model_name, default_max_tokens=None)
    except ApiError as exc:
        if exc.param == "max_tokens":
            raise invalid("max_output_tokens", exc.message.split(": ", 1)[1]) from None
        raise
    prompt = ChatPrompt(messages, True, use.template_tools() if use else None, prompt_tool_format(tool_calling))
    spec = constraint or text_spec
    if spec is not None:
        if "structured" in fields["sampling"]:  # Tandem's regex, grammar or choice as well
            raise invalid("tools" if constraint else "text", f"cannot be combined with "
                          f"{fields['sampling']['structured'].source}; give one constraint on the output")
        fields["sampling"]["structured"] = spec
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream", f"must be true or false, got {quote(stream)}")
    return ResponsesRequest(model_name, ApiRequest(prompt, max_tokens_to_context=True, **fields), stream, body, use,
                            tool_format)


def _messages(body: Mapping[str, Any]) -> list[dict]:
    """``instructions`` and ``input`` as chat messages (calls and their outputs as tool turns)."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", f"must be a string, got {quote(instructions)}")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    given = body.get("input")
    if isinstance(given, str):
        if not given:
            raise invalid("input", "the input is empty")
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise invalid("input", "must be a non-empty string or a non-empty list of input items")
    for index, item in enumerate(given):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise invalid("input", f"{where} must be an input item object, got {quote(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            _known(item, ("type", "role", "content", "id", "status"), where)
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise invalid("input", f"{where}.role must be user, assistant, system or developer; "
                                       f"got {quote(item.get('role'))}")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            _known(item, ("type", "call_id", "name", "arguments", "id", "status"), where)
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise invalid("input", f"{where}.{name} must be a string, got {quote(item.get(name))}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _known(item, ("type", "call_id", "output", "id", "status"), where)
            if not isinstance(item.get("call_id"), str):
                raise invalid("input", f"{where}.call_id must be a string, got {quote(item.get('call_id'))}")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise invalid("input", f"{where}.type: {quote(kind)} items are not supported by this server; "
                                   "send message, function_call or function_call_output items")
    return messages


def _text(content: Any, where: str) -> str:
    """A message's (or call output's) text: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") not in ("input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise invalid("input", f"{where}[{index}]: only text parts (input_text, output_text) are supported "
                                       f"by this server; got {quote(part)}")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid("input", f"{where} must be a string or a list of text parts, got {quote(content)}")


def _known(item: Mapping, names: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(item) - set(names))
    if unknown:
        raise invalid("input", f"{where}.{unknown[0]}: unknown field (not supported by this server)")


def _text_format(text: Any) -> StructuredOutput | None:
    """``text: {"format": ...}`` as the output's constraint (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, Mapping) or set(text) - {"format", "verbosity"}:
        raise invalid("text", f"must be {{\"format\": {{...}}}}, got {quote(text)}")
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("text", f"verbosity {quote(text['verbosity'])} is not supported by this server")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return StructuredOutput("json_object", source="text.format")
    if kind == "json_schema":
        unknown = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
        if unknown:
            raise invalid("text", f"text.format.{unknown[0]}: unknown field")
        if not isinstance(fmt.get("name"), str) or not NAME.fullmatch(fmt["name"]):
            raise invalid("text", "text.format.name must be 1 to 64 letters, digits, underscores or dashes; "
                                  f"got {quote(fmt.get('name'))}")
        if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
            raise invalid("text", f"text.format.strict must be true or false, got {quote(fmt['strict'])}")
        schema = fmt.get("schema")
        if not isinstance(schema, Mapping):
            raise invalid("text", f"text.format.schema must be a JSON schema object, got {quote(schema)}")
        with refused_as_400():
            check_schema(schema, "text.format.schema")
        return StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False), source="text.format")
    raise invalid("text", f"text.format must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                          f"{{\"type\": \"json_schema\", \"name\", \"schema\"}}; got {quote(fmt)}")


# -- writing responses ----------------------------------------------------------------------------

class ResponseWriter:
    """One response: its output items, built from the model's text (read as content and calls
    when calls are possible), and the stream events that build them, numbered in order. The
    whole response is the same machine run without sending its events."""

    def __init__(self, req: ResponsesRequest):
        self.req = req
        self.parser = ToolCallParser(req.tool_format) if req.tool_format is not None else None
        self.output: list[dict] = []
        self.sequence = 0
        self._message: dict | None = None  # the open message item
        self._calls: dict[int, dict] = {}  # the parser's call index -> its item
        self._events: list[dict] = []
        self.usage = [0, 0, 0]  # prompt, cached, completion: known at the end
        self.final: dict | None = None  # the finished response

    def start(self) -> list[dict]:
        self._event("response.created", response=self.response("in_progress"))
        self._event("response.in_progress", response=self.response("in_progress"))
        return self._take()

    def text(self, delta: str) -> list[dict]:
        for event in self.parser.feed(delta) if self.parser is not None else [ContentDelta(delta)] if delta else []:
            self._apply(event)
        return self._take()

    def finish(self, finish_reason: str, usage: list[int]) -> list[dict]:
        """The last events: the open items closed, then ``response.completed`` (or
        ``response.incomplete``); ``usage`` is [prompt, cached, completion]."""
        for event in self.parser.finish() if self.parser is not None else []:
            self._apply(event)
        self._close_message()
        self.usage = usage
        status = "incomplete" if finish_reason == "length" else "completed"
        self.final = self.response(status)
        self._event(f"response.{status}", response=self.final)
        return self._take()

    def error(self, message: str, code: str | None, param: str | None) -> list[dict]:
        self._event("error", code=code, message=message, param=param)
        return self._take()

    def response(self, status: str) -> dict:
        body = self.req.body
        out = {"id": self.req.id, "object": "response", "created_at": self.req.created_at, "status": status,
               "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
               "model": self.req.model, "output": list(self.output) if status != "in_progress" else [],
               "parallel_tool_calls": self.req.tools.parallel if self.req.tools else True,
               "previous_response_id": None, "store": False, "temperature": body.get("temperature"),
               "top_p": body.get("top_p"), "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
               "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
               "tools": [_tool(t) for t in self.req.tools.tools] if self.req.tools else [],
               "truncation": "disabled", "metadata": {}, "usage": None}
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
            prompt, cached, completion = self.usage
            out["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": prompt + completion}
        return out

    # -- items -----------------------------------------------------------------------------

    def _apply(self, event) -> None:
        if isinstance(event, ContentDelta):
            if self._message is None:
                self._message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                                 "role": "assistant", "content": []}
                self._add(self._message)
                self._event("response.content_part.added", item_id=self._message["id"], output_index=self._index(),
                            content_index=0, part=_text_part(""))
                self._message["content"] = [_text_part("")]
            self._message["content"][0]["text"] += event.text
            self._event("response.output_text.delta", item_id=self._message["id"], output_index=self._index(),
                        content_index=0, delta=event.text, logprobs=[])
        elif isinstance(event, CallOpened):
            self._close_message()
            item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress",
                    "call_id": event.id, "name": event.name, "arguments": ""}
            self._calls[event.index] = item
            self._add(item)
        elif isinstance(event, ArgumentsDelta):
            item = self._calls[event.index]
            item["arguments"] += event.text
            self._event("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=self.output.index(item), delta=event.text)
        elif isinstance(event, CallClosed):
            item = self._calls[event.index]
            item["arguments"] = event.arguments
            item["status"] = "completed" if event.complete else "incomplete"
            index = self.output.index(item)
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=event.arguments)
            self._event("response.output_item.done", output_index=index, item=dict(item))

    def _add(self, item: dict) -> None:
        self.output.append(item)
        self._event("response.output_item.added", output_index=len(self.output) - 1, item=json.loads(json.dumps(item)))

    def _close_message(self) -> None:
        message, self._message = self._message, None
        if message is None:
            return
        index, part = self.output.index(message), message["content"][0]
        message["status"] = "completed"
        self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                    text=part["text"], logprobs=[])
        self._event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                    part=dict(part))
        self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(message)))

    def _index(self) -> int:
        return self.output.index(self._message)

    def _event(self, kind: str, **fields) -> None:
        self._events.append({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    def _take(self) -> list[dict]:
        events, self._events = self._events, []
        return events


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _tool(tool) -> dict:
    return {"type": "function", "name": tool.name, "description": tool.description or None,
            "parameters": tool.schema, "strict": tool.strict}
