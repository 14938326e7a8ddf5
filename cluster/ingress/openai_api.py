"""The OpenAI API's request and response shapes: ``/v1/completions`` and
``/v1/chat/completions`` bodies become the request path's requests (``ApiRequest``), and
the path's messages become OpenAI responses, stream chunks and error bodies.

Pure functions over dicts (no server here: ``cluster/ingress/http_server.py`` serves them), so every
field's handling is tested alone. Tandem's own sampling and scheduling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``speculative`` (false: this request is not
decoded speculatively), ``priority``, ``slo_class``, ``ttft_ms``, ``tpot_ms``) are accepted as
extra body fields, as vLLM accepts its own; so are its structured-output fields beside
OpenAI's ``response_format`` (``regex``, ``grammar``, ``grammar_syntax``, ``choice``:
``cluster/engine/structured/fields.py``).

Chat tools (``tools``, ``tool_choice``, ``parallel_tool_calls``: ``openai_tools.py``) go to the
chat template and constrain the output; each choice's text is read back as content and
``tool_calls`` (``cluster/engine/tool_calls/parser.py``), whole or as streamed deltas.

An error a caller can fix is an :class:`ApiError` with OpenAI's body ``{"error": {"message",
"type", "param", "code"}}`` and its status: 400 naming the field, 401, 404 for another model,
429 when admission control refuses, 503 when no worker can serve.
"""

from __future__ import annotations

import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from cluster.engine.chat_template import ChatPrompt
from cluster.engine.request_limits import InvalidRequestError, check_user, quote
from cluster.engine.structured.fields import FIELDS as STRUCTURED_FIELDS
from cluster.engine.structured.fields import structured_output
from cluster.engine.tool_calls.formats import ToolCalling, ToolCallFormat
from cluster.engine.tool_calls.parser import ArgumentsDelta, CallOpened, ContentDelta, ParsedCall
from cluster.ingress import retry_after
from cluster.ingress.openai_tools import chat_tool_call, chat_tool_use, prompt_tool_format, tool_setup
from cluster.protocol.messages import ApiRequest, RequestFailed

MAX_CHOICES = 16
# Fields OpenAI defines that Tandem accepts only at their neutral value.
_NEUTRAL = {
    "logit_bias": lambda v: v is None or v == {},
    "echo": lambda v: v is None or v is False,
    "best_of": lambda v: v is None or (type(v) is int and v == 1),
    "suffix": lambda v: v in (None, ""),
    "service_tier": lambda v: v in (None, "auto", "default"),
    "store": lambda v: v is None or v is False,
    "modalities": lambda v: v in (None, ["text"]),
    "reasoning_effort": lambda v: v is None,
}
_EXTRA = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "speculative", "priority", "slo_class", "ttft_ms",
          "tpot_ms", "stop_token_ids", "request_id") + STRUCTURED_FIELDS
_COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
           "frequency_penalty", "stream", "stream_options", "user", "metadata", "logprobs") + _EXTRA
COMPLETION_FIELDS = frozenset(_COMMON + ("prompt",)) | set(_NEUTRAL)
CHAT_FIELDS = frozenset(_COMMON + ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                   "parallel_tool_calls")) | set(_NEUTRAL)
# OpenAI's limits on ``metadata`` (kept by OpenAI with ``store``; accepted and not kept here)
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512

STATUS = {"invalid": 400, "not_found": 404, "rejected": 429, "unavailable": 503}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 500: "internal_error"}
CODES = {404: "model_not_found", 429: "rate_limit_exceeded", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        message = " ".join(line.strip() for line in message.splitlines() if line.strip())  # one line, always
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or CODES.get(status)
        self.headers = headers or {}  # sent with the status (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


@dataclass
class OpenAIRequest:
    """One API call: the request for each of its ``n`` choices, and how to answer."""

    kind: str  # "chat" or "completion"
    model: str
    request: ApiRequest  # as the request path takes it (without arrival; the seed is ``seed``)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top logprobs wanted (0: only the sampled token's), or None
    seed: int | None = None
    tool_format: ToolCallFormat | None = None  # set when the output may hold tool calls, in this format
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def choice_requests(self) -> list[ApiRequest]:
        """The request of each choice; with a seed, choice i samples with seed + i so that
        choices differ yet each is reproducible."""
        out = []
        for i in range(self.n):
            sampling = dict(self.request.sampling)
            if self.seed is not None:
                sampling["seed"] = self.seed + i
            request = replace(self.request, sampling=sampling)
            if request.request_id and self.n > 1:
                request = replace(request, request_id=f"{request.request_id}-{i}")
            out.append(request)
        return out


# -- reading requests ---------------------------------------------------------------------------

def parse_completion(body: Any, model_name: str) -> OpenAIRequest:
    body = _object(body)
    _known(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "the prompt is empty")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt", "give one prompt per request (a string or a list of token ids)")
    else:
        raise invalid("prompt", "must be a non-empty string or a list of token ids")
    logprobs = _optional_int(body, "logprobs", 0, 20)
    fields = common_fields(body, model_name, default_max_tokens=16)
    fields["prompt"] = prompt
    if logprobs is not None:
        fields["sampling"]["logprobs"] = logprobs
    return _finish(body, "completion", model_name, fields, logprobs)


def parse_chat(body: Any, model_name: str, tool_calling: ToolCalling = ToolCalling(None, refusal="no tools here"),
               ) -> OpenAIRequest:
    """The chat call; ``tool_calling`` is how the served model takes tools (``RequestPath.tool_calling``)."""
    body = _object(body)
    _known(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    with refused_as_400():
        use = chat_tool_use(body)
        tool_format, constraint = tool_setup(use, tool_calling)
    if _optional_int(body, "max_completion_tokens", 1, None) is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    fields = common_fields(body, model_name, default_max_tokens=None)
    fields["prompt"] = ChatPrompt(messages, True, use.template_tools() if use else None,
                                  prompt_tool_format(tool_calling))
    if constraint is not None:
        if "structured" in fields["sampling"]:
            raise invalid("tools", "tool calls cannot be combined with another constraint on the output "
                                   "(response_format, regex, grammar, choice); send tool_choice: none, or no tools")
        fields["sampling"]["structured"] = constraint
    fields["max_tokens_to_context"] = True  # without max_tokens: until the context (or the KV cache) ends
    wants = body.get("logprobs")
    if wants is not None and not isinstance(wants, bool):
        raise invalid("logprobs", f"must be true or false, got {quote(wants)}")
    top = _optional_int(body, "top_logprobs", 0, 20)
    if top is not None and not wants:
        raise invalid("top_logprobs", "needs logprobs: true")
    logprobs = (top or 0) if wants else None
    if logprobs is not None:
        fields["sampling"]["logprobs"] = logprobs
    req = _finish(body, "chat", model_name, fields, logprobs)
    req.tool_format = tool_format
    return req


@contextmanager
def refused_as_400():
    """Turns an InvalidRequestError (a checked field, named first in its message) into a 400."""
    try:
        yield
    except InvalidRequestError as exc:
        message = str(exc)
        raise ApiError(400, message, re.match(r"[A-Za-z_]*", message).group() or None) from None


def _finish(body: Mapping, kind: str, model_name: str, fields: dict, logprobs: int | None) -> OpenAIRequest:
    """The call, from the body's answering fields and its request's ``ApiRequest`` fields."""
    n = _optional_int(body, "n", 1, MAX_CHOICES) or 1
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream", f"must be true or false, got {quote(stream)}")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise invalid("stream_options", "may hold only include_usage")
    if options and not stream:
        raise invalid("stream_options", "needs stream: true")
    include_usage = bool(options.get("include_usage"))
    seed = fields["sampling"].pop("seed", None)
    return OpenAIRequest(kind, model_name, ApiRequest(**fields), n, stream, include_usage, logprobs, seed)


def common_fields(body: Mapping, model_name: str, default_max_tokens: int | None) -> dict:
    """The ``ApiRequest`` fields every endpoint shares (all but the prompt), checked."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "the model's name is required (GET /v1/models lists it)")
    if model != model_name:
        raise ApiError(404, f"model {quote(model)} is not served here; this cluster serves {quote(model_name)}",
                       "model")
    for name, neutral in _NEUTRAL.items():
        if name in body and not neutral(body[name]):
            raise invalid(name, f"{quote(body[name])} is not supported by this server")
    sampling: dict[str, Any] = {}
    max_tokens = _optional_int(body, "max_tokens", 1, None)
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    elif default_max_tokens is not None:
        sampling["max_tokens"] = default_max_tokens
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        if body.get(name) is not None:
            sampling[name] = _number(body, name)
    for name in ("top_k", "seed"):
        value = _optional_int(body, name, 0, None)
        if value is not None:
            sampling[name] = value
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid("stop", "must be a string or a list of non-empty strings")
        if stops:
            sampling["stop"] = stops
    if body.get("stop_token_ids"):
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise invalid("stop_token_ids", "must be a list of token ids")
        sampling["stop_token_ids"] = ids
    for name in ("ignore_eos", "speculative"):
        if body.get(name) is not None:
            if not isinstance(body[name], bool):
                raise invalid(name, f"must be true or false, got {quote(body[name])}")
            sampling[name] = body[name]
    try:
        structured = structured_output(body)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), str(exc).split(":", 1)[0]) from None
    if structured is not None:
        sampling["structured"] = structured
    fields: dict[str, Any] = {"model": model, "sampling": sampling}
    slo_class = body.get("slo_class")
    if slo_class is not None:
        if not isinstance(slo_class, str):
            raise invalid("slo_class", "must be a string")
        fields["slo_class"] = slo_class
    priority = _optional_int(body, "priority", None, None)
    if priority is not None:
        fields["priority"] = priority
    for name in ("ttft_ms", "tpot_ms"):
        if body.get(name) is not None:
            value = _number(body, name)
            if not value > 0:
                raise invalid(name, f"must be positive, got {value:g}")
            fields[name.replace("_ms", "_s")] = value / 1000.0
    request_id = body.get("request_id")
    if request_id is not None:
        if not isinstance(request_id, str) or not request_id:
            raise invalid("request_id", "must be a non-empty string")
        fields["request_id"] = request_id
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise invalid("user", "must be a string")
        _limited("user", check_user, user)
    _check_metadata(body.get("metadata"))
    return fields


def _limited(param: str, check: Callable[[Any], None], value: Any) -> None:
    """A limit of ``cluster/engine/request_limits.py``, as a 400 naming ``param``."""
    try:
        check(value)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param) from None


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, Mapping) or not all(isinstance(v, str) for v in metadata.values()):
        raise invalid("metadata", f"must be an object of string values, got {quote(metadata)}")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid("metadata", f"{len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid("metadata", f"key {quote(key)}: keys may have at most {MAX_METADATA_KEY_CHARS} characters, "
                                      f"values at most {MAX_METADATA_VALUE_CHARS}")


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(body), "a number")
        raise ApiError(400, f"the request body must be a JSON object, got {kind}")
    return body


def _known(body: Mapping, fields: frozenset) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise invalid(unknown[0], "unknown field")


def _number(body: Mapping, name: str) -> float:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"must be a number, got {quote(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer beyond a float
        raise invalid(name, f"must be a finite number, got {quote(value)}") from None


def _optional_int(body: Mapping, name: str, minimum: int | None, maximum: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {quote(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise invalid(name, f"must be {bounds}, got {quote(value)}")
    return value


# -- writing responses ----------------------------------------------------------------------------

def error_for(error: RequestFailed) -> ApiError:
    """The request path's error message as an API error with its status."""
    status = STATUS.get(error.kind, 503)
    return ApiError(status, error.message, _param_of(error.message) if status == 400 else None,
                    headers=retry_after.http_headers(error))


# A message that starts by naming a field: "temperature must be ...", "messages[0].role is missing", "stop: ..."
_LEADING_FIELD = re.compile(r"([a-z_]+)((?:\[\d+\]|\.[a-z_]+)*)(?=:| must | is | has )")
_PARAM_ALIASES = {"prompt_token_ids": "prompt"}


def _param_of(message: str) -> str | None:
    """The body field an engine or request-path message names first, for the error's ``param``."""
    match = _LEADING_FIELD.match(message)
    if match is None:
        return None
    root = _PARAM_ALIASES.get(match.group(1), match.group(1))
    return root + match.group(2) if root in COMPLETION_FIELDS | CHAT_FIELDS else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Choice:
    """What one choice produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (logprob, [(token id, logprob)]) per token
    finish_reason: str | None = None
    usage: list[int] | None = None  # [prompt, cached, completion] at the end
    tool_calls: list[ParsedCall] = field(default_factory=list)  # parsed out of text, which is then the content


def logprobs_block(kind: str, entries: list, token_ids: list[int], decode: Callable[[int], str],
                   text_offset: int = 0) -> dict | None:
    """OpenAI's logprobs object for the tokens of ``entries``: chat's ``{"content": [...]}`` or
    completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
    if not entries:
        return None
    if kind == "chat":
        content = []
        for token_id, (logprob, top) in zip(token_ids, entries):
            text = decode(token_id)
            content.append({"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
                            "top_logprobs": [{"token": decode(t), "logprob": lp,
                                              "bytes": list(decode(t).encode("utf-8"))} for t, lp in top]})
        return {"content": content}
    tokens = [decode(t) for t in token_ids]
    offsets, at = [], text_offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [{decode(t): lp for t, lp in top} for _, top in entries], "text_offset": offsets}


def response(req: OpenAIRequest, choices: list[Choice], decode: Callable[[int], str]) -> dict:
    """The whole (not streamed) response."""
    prompt_tokens = choices[0].usage[0] if choices[0].usage else 0
    cached = choices[0].usage[1] if choices[0].usage else 0
    completion = sum(c.usage[2] if c.usage else len(c.token_ids) for c in choices)
    body_choices = []
    for c in choices:
        lp = logprobs_block(req.kind, c.logprobs, c.token_ids, decode) if req.logprobs is not None else None
        if req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message["content"] = c.text or None
                message["tool_calls"] = [chat_tool_call(call) for call in c.tool_calls]
            body_choices.append({"index": c.index, "message": message, "logprobs": lp,
                                 "finish_reason": c.finish_reason})
        else:
            body_choices.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {"id": _id(req), "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": req.created, "model": req.model, "choices": body_choices,
            "usage": usage(prompt_tokens, completion, cached)}


def chunk(req: OpenAIRequest, index: int, text: str | None, finish_reason: str | None = None,
          logprobs: dict | None = None, role: bool = False, tool_calls: list[dict] | None = None) -> dict:
    """One streamed chunk of one choice (``tool_calls``: OpenAI's call deltas)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": _id(req), "object": kind, "created": req.created, "model": req.model, "choices": [choice]}


def event_chunks(req: OpenAIRequest, index: int, events: list, logprobs: dict | None = None) -> list[dict]:
    """The chunks of a choice's parsed events (``tool_calls/parser.py``): content deltas, then
    each call's id, type and name, then its arguments in pieces, as OpenAI streams them. The
    message's logprobs ride on the first chunk (on an empty delta when it made none)."""
    chunks = []
    for event in events:
        if isinstance(event, ContentDelta):
            chunks.append(chunk(req, index, event.text))
        elif isinstance(event, CallOpened):
            chunks.append(chunk(req, index, None, tool_calls=[{"index": event.index, "id": event.id, "type": "function",
                                                               "function": {"name": event.name, "arguments": ""}}]))
        elif isinstance(event, ArgumentsDelta):
            chunks.append(chunk(req, index, None, tool_calls=[{"index": event.index,
                                                               "function": {"arguments": event.text}}]))
    if logprobs is not None:
        if not chunks:
            chunks.append(chunk(req, index, None))
        chunks[0]["choices"][0]["logprobs"] = logprobs
    return chunks


def usage_chunk(req: OpenAIRequest, usage_body: dict) -> dict:
    return {"id": _id(req), "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": req.created, "model": req.model, "choices": [], "usage": usage_body}


def _id(req: OpenAIRequest) -> str:
    return ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.id


def models(model_name: str, max_model_len: int, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "tandem", "max_model_len": max_model_len}]}
