"""``TandemClient``: the Python client of a Tandem cluster's gRPC API (``tandem.v1.Tandem``).

    with TandemClient("127.0.0.1:50051") as client:
        for response in client.generate("Hello", max_tokens=16):
            print(response.text, end="", flush=True)

``generate`` streams ``tandem_pb2.GenerateResponse`` messages; closing the stream early (``close()``,
``cancel()`` or leaving ``with client.stream(...) as stream:``) cancels the call, which aborts the
request on the cluster. Every gRPC error becomes a ``TandemError`` carrying the status code.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.engine.request_limits import quote
from tandem.v1 import tandem_pb2, tandem_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"


class TandemError(Exception):
    """A failed call: ``code`` is the ``grpc.StatusCode``, ``message`` the server's details.
    ``str(error)`` is ``"<CODE>: <message>"``, e.g. ``"RESOURCE_EXHAUSTED: queue full"``."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # RESOURCE_EXHAUSTED: when the server predicts a retry could be placed

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> "TandemError":
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = error.details() if callable(getattr(error, "details", None)) else None
        trailers = dict(error.trailing_metadata() or ()) if callable(getattr(error, "trailing_metadata", None)) else {}
        pushback = trailers.get("grpc-retry-pushback-ms")
        return cls(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN,
                   details if details is not None else str(error),
                   int(pushback) / 1000 if isinstance(pushback, str) and pushback.isdigit() else None)


class GenerateStream(Iterator[tandem_pb2.GenerateResponse]):
    """The responses of one ``Generate`` call, in order. Closing it before the end (``close()`` or
    ``cancel()``, from any thread, or leaving its ``with`` block) cancels the call: iteration then
    simply ends. Errors from the server raise ``TandemError``."""

    def __init__(self, call):
        self._call = call
        self._closed = False

    def __iter__(self) -> "GenerateStream":
        return self

    def __next__(self) -> tandem_pb2.GenerateResponse:
        if self._closed:
            raise StopIteration
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            if self._closed and exc.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise TandemError.from_rpc_error(exc) from None

    def cancel(self) -> bool:
        """Cancels the call; True when it was still running (the server sees the cancellation)."""
        self._closed = True
        return self._call.cancel()

    def close(self) -> None:
        """Like a generator's ``close()``: cancels the call if it is still running."""
        self.cancel()

    def __enter__(self) -> "GenerateStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.cancel()

    @property
    def cancelled(self) -> bool:
        """True when this side cancelled the call before it finished."""
        return self._call.cancelled()

    def done(self) -> bool:
        return self._call.done()

    def initial_metadata(self):
        return self._call.initial_metadata()

    def trailing_metadata(self):
        return self._call.trailing_metadata()


class TandemClient:
    """A connection to a Tandem cluster's gRPC endpoint.

    ``token``: sent as ``authorization: Bearer <token>`` metadata on every call. ``tls_ca_file``:
    a PEM file of CA certificates; when given the channel uses TLS verified against it.
    ``timeout_s``: the default deadline of each call (``None``: no deadline); each method takes its
    own ``timeout_s`` too. Use as a context manager, or call ``close()``.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, tls_ca_file: str | None = None,
                 timeout_s: float | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        if tls_ca_file is not None:
            with open(tls_ca_file, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.secure_channel(address, credentials)
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = tandem_pb2_grpc.TandemStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "TandemClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else timeout_s

    def _unary(self, method, request, timeout_s: float | None):
        try:
            return method(request, metadata=self._metadata, timeout=self._timeout(timeout_s))
        except grpc.RpcError as exc:
            raise TandemError.from_rpc_error(exc) from None

    # -- the API -----------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, timeout_s: float | None = None,
                 **options: Any) -> GenerateStream:
        """Starts a ``Generate`` call; returns its stream of ``GenerateResponse`` messages.

        ``prompt`` is text, a list of token ids, or a chat (a list of ``{"role", "content"}``
        dicts, rendered with the model's chat template); ``options`` are those of
        :func:`build_generate_request` (sampling fields, ``slo_class``, ``ttft_ms``/``tpot_ms``
        objectives, ``priority``, ``request_id``, ``model``); sampling options left out take the
        server's defaults. The call starts at once; errors surface while iterating."""
        return self.generate_request(build_generate_request(prompt, **options), timeout_s=timeout_s)

    stream = generate  # ``with client.stream(...) as responses:`` reads better with a ``with``.

    def generate_request(self, request: tandem_pb2.GenerateRequest, *,
                         timeout_s: float | None = None) -> GenerateStream:
        """``generate`` for a ready-made ``GenerateRequest``."""
        try:
            call = self._stub.Generate(request, metadata=self._metadata, timeout=self._timeout(timeout_s))
        except grpc.RpcError as exc:
            raise TandemError.from_rpc_error(exc) from None
        return GenerateStream(call)

    def model_info(self, *, timeout_s: float | None = None) -> tandem_pb2.ModelInfo:
        return self._unary(self._stub.GetModelInfo, tandem_pb2.GetModelInfoRequest(), timeout_s)

    def tokenize(self, text: str, *, timeout_s: float | None = None) -> list[int]:
        response = self._unary(self._stub.Tokenize, tandem_pb2.TokenizeRequest(text=text), timeout_s)
        return list(response.token_ids)

    def detokenize(self, ids: Iterable[int], *, timeout_s: float | None = None) -> str:
        request = tandem_pb2.DetokenizeRequest(token_ids=_token_ids(ids, "ids"))
        return self._unary(self._stub.Detokenize, request, timeout_s).text

    def status(self, *, timeout_s: float | None = None) -> tandem_pb2.ClusterStatus:
        """The cluster's workers, routers, goodput per SLO class and health (``GetStatus``)."""
        return self._unary(self._stub.GetStatus, tandem_pb2.GetStatusRequest(), timeout_s)

    def health(self, *, timeout_s: float | None = None) -> str:
        """The standard ``grpc.health.v1`` check of the whole server (service ``""``): ``"SERVING"``,
        ``"NOT_SERVING"``, ``"UNKNOWN"`` or ``"SERVICE_UNKNOWN"``."""
        response = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=""), timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _chat_message(message: dict) -> tandem_pb2.ChatMessage:
    out = tandem_pb2.ChatMessage(role=str(message.get("role", "")), content=str(message.get("content") or ""),
                                 tool_call_id=str(message.get("tool_call_id") or ""))
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = function.get("arguments", "{}")
        out.tool_calls.add(id=str(call.get("id", "")), name=str(function.get("name", "")),
                           arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))
    return out


def _chat_tools(chat: tandem_pb2.Chat, tools: Sequence[dict], tool_choice: str | dict | None,
                parallel_tool_calls: bool | None) -> None:
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters")
        chat.tools.add(name=str(function.get("name", "")), description=str(function.get("description") or ""),
                       parameters=json.dumps(parameters) if parameters is not None else "",
                       **({"strict": function["strict"]} if function.get("strict") is not None else {}))
    if isinstance(tool_choice, dict):
        chat.tool_function = str(tool_choice.get("function", tool_choice).get("name", ""))
    elif tool_choice in ("none", "auto", "required"):
        chat.tool_mode = tool_choice
    elif tool_choice is not None:
        chat.tool_function = str(tool_choice)
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls


def _token_ids(ids: Iterable[int], what: str) -> list[int]:
    out = []
    for t in ids:
        if isinstance(t, bool):
            raise TypeError(f"{what}: token ids must be integers, got {quote(t)}")
        try:
            value = operator.index(t)
        except TypeError:
            raise TypeError(f"{what}: token ids must be integers, got {quote(t)}") from None
        if not 0 <= value < 2**32:
            raise ValueError(f"{what}: token id {value} is out of range (0 to 2**32-1)")
        out.append(value)
    return out


def build_generate_request(
    prompt: str | Sequence[int] | Sequence[dict],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Iterable[str] | str = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logprobs: int | None = None,
    speculative: bool | None = None,
    json_schema: Mapping[str, Any] | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    grammar_syntax: str = "",
    choice: Sequence[str] | None = None,
    slo_class: str = "",
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
    priority: int = 0,
    request_id: str = "",
    model: str = "",
    tools: Sequence[dict] = (),
    tool_choice: str | dict | None = None,
    parallel_tool_calls: bool | None = None,
) -> tandem_pb2.GenerateRequest:
    """The ``GenerateRequest`` that ``TandemClient.generate`` sends for these arguments. Optional
    sampling fields left ``None`` stay unset (the server applies its defaults); the objectives
    message is set only when ``ttft_ms`` or ``tpot_ms`` is given. Structured output: at most one
    of ``json_schema`` (a dict, or JSON text), ``json_object``, ``regex``, ``grammar`` (GBNF, or
    Lark with ``grammar_syntax="lark"``) and ``choice`` (ValueError otherwise).

    A chat may carry tool turns as the OpenAI API writes them (an assistant's ``tool_calls``,
    a ``tool`` message's ``tool_call_id``) and offer ``tools`` (``{"name", "description",
    "parameters"}``, or OpenAI's ``{"type": "function", "function": {...}}``); ``tool_choice`` is
    ``"none"``, ``"auto"``, ``"required"`` or a function's name (or OpenAI's ``{"type":
    "function", "function": {"name"}}``)."""
    request = tandem_pb2.GenerateRequest(request_id=request_id, model=model, slo_class=slo_class, priority=priority)
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        request.chat.messages.extend(_chat_message(m) for m in prompt)
        _chat_tools(request.chat, tools, tool_choice, parallel_tool_calls)
    elif isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be text (str) or a list of token ids, not bytes")
    else:
        request.token_ids.ids.extend(_token_ids(prompt, "prompt"))
    sampling = request.sampling
    sampling.SetInParent()
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("min_p", min_p), ("seed", seed),
                        ("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("logprobs", logprobs),
                        ("speculative", speculative)):
        if value is not None:
            setattr(sampling, name, value)
    sampling.stop.extend([stop] if isinstance(stop, str) else list(stop))
    sampling.stop_token_ids.extend(_token_ids(stop_token_ids, "stop_token_ids"))
    sampling.ignore_eos = bool(ignore_eos)
    _set_structured(sampling, json_schema, json_object, regex, grammar, grammar_syntax, choice)
    if ttft_ms is not None:
        request.objectives.ttft_ms = ttft_ms
    if tpot_ms is not None:
        request.objectives.tpot_ms = tpot_ms
    return request


def _set_structured(sampling: tandem_pb2.SamplingParams, json_schema, json_object: bool, regex, grammar,
                    grammar_syntax: str, choice) -> None:
    given = [name for name, value in (("json_schema", json_schema), ("json_object", json_object or None),
                                      ("regex", regex), ("grammar", grammar), ("choice", choice)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, json_object, regex, grammar and choice, got {given}")
    if grammar_syntax and grammar is None:
        raise ValueError("grammar_syntax goes with grammar")
    if json_schema is not None:
        sampling.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif json_object:
        sampling.json_object = True
    elif regex is not None:
        sampling.regex = regex
    elif grammar is not None:
        sampling.grammar.text, sampling.grammar.syntax = grammar, grammar_syntax
    elif choice is not None:
        if isinstance(choice, str):
            raise TypeError("choice must be a list of strings, not one string")
        sampling.choice.options.extend(choice)
