"""The gRPC API (``tandem.v1.Tandem``, see ``proto/``) of an ingress replica.

An asyncio server (``grpc.aio``) on an event loop of its own: a call costs a coroutine, not a
thread, so however many streams are open none waits unseen for a free thread, and each call is
stamped with the time it arrived, from which its admission and TTFT are timed. Each
``Generate`` call runs the request's path (``cluster/ingress/request_path.py``: the router places it,
the decode worker streams it) and turns each message into a ``GenerateResponse``; errors become
status codes (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE; DEADLINE_EXCEEDED
and CANCELLED come from gRPC itself). When the call ends early (the client cancels, disconnects
or passes its deadline) the path is closed, which aborts the request on every worker.

A chat with tools (``Chat.tools``, ``tool_mode``/``tool_function``, ``parallel_tool_calls``)
is constrained and read back as in the OpenAI API (``cluster/engine/tool_calls/``): each
response's ``text`` is the content, its ``tool_calls`` the calls that completed in it.

``GetStatus`` answers what ``tandem status`` and ``tandem top`` show (``cluster/cli/status.py``).
Also served: the standard health service (``grpc.health.v1``, exempt from the token so probes
work; SERVING only while a router and a generating worker answer: ``cluster/ingress/health.py``), server
reflection, TLS when the topology names a certificate and key, and a bearer
token (``authorization: Bearer <token>``) checked on every other call when one is configured.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.engine.chat_template import ChatPrompt
from cluster.engine.request_limits import InvalidRequestError
from cluster.engine.structured.spec import StructuredOutput
from cluster.engine.tool_calls.formats import ToolCalling, ToolCallFormat
from cluster.engine.tool_calls.parser import CallClosed, ContentDelta, ToolCallParser
from cluster.engine.tool_calls.tools import function_tool, tool_use
from cluster.ingress import retry_after
from cluster.ingress.openai_tools import prompt_tool_format, tool_setup
from cluster.protocol.messages import ApiRequest, Output, RequestFailed
from cluster.runtime.ports import host_port
from cluster.topology import ClusterSpec
from tandem.v1 import tandem_pb2, tandem_pb2_grpc

SERVICE = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name
CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "rejected": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "logprobs", "speculative")
START_TIMEOUT_S = 30.0
NO_TOOLS = ToolCalling(None, refusal="this server takes no tools")


class RequestError(ValueError):
    pass


def request_payload(request: tandem_pb2.GenerateRequest,
                    tool_calling: ToolCalling = NO_TOOLS) -> tuple[ApiRequest, ToolCallFormat | None]:
    """The request as the request path takes it, and the format its tool calls are read in
    (None when it may make none); RequestError names the field that is wrong."""
    kind = request.WhichOneof("prompt")
    tool_format = constraint = None
    if kind is None:
        raise RequestError("prompt: give text, token_ids or chat")
    if kind == "chat":
        chat = request.chat
        if not chat.messages:
            raise RequestError("chat.messages: the chat is empty")
        try:
            use = _tool_use(chat)
            tool_format, constraint = tool_setup(use, tool_calling)
        except InvalidRequestError as exc:
            raise RequestError(f"chat.{exc}") from None
        prompt = ChatPrompt([_message(m) for m in chat.messages], True, use.template_tools() if use else None,
                            prompt_tool_format(tool_calling))
    else:
        prompt = request.text if kind == "text" else list(request.token_ids.ids)
        if not prompt:
            raise RequestError(f"{'text' if kind == 'text' else 'token_ids.ids'}: the prompt is empty")
    sampling = {name: getattr(request.sampling, name) for name in SAMPLING_FIELDS
                if request.sampling.HasField(name)}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if name in sampling:
            sampling[name] = round(float(sampling[name]), 6)  # float32 on the wire
    if request.sampling.stop:
        sampling["stop"] = list(request.sampling.stop)
    if request.sampling.stop_token_ids:
        sampling["stop_token_ids"] = list(request.sampling.stop_token_ids)
    if request.sampling.ignore_eos:
        sampling["ignore_eos"] = True
    if request.sampling.WhichOneof("structured") is not None:
        if constraint is not None:
            raise RequestError(f"sampling.{request.sampling.WhichOneof('structured')}: cannot be combined with tool "
                               "calls; set chat.tool_mode none, or send no tools")
        sampling["structured"] = structured_output(request.sampling)
    if constraint is not None:
        sampling["structured"] = constraint
    objectives = {name.replace("_ms", "_s"): getattr(request.objectives, name) / 1000.0
                  for name in ("ttft_ms", "tpot_ms") if request.objectives.HasField(name)}  # checked by the request path
    return ApiRequest(prompt, request_id=request.request_id, model=request.model, sampling=sampling,
                      slo_class=request.slo_class, priority=request.priority, **objectives), tool_format


def _message(message: tandem_pb2.ChatMessage) -> dict:
    out = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _tool_use(chat: tandem_pb2.Chat):
    """The chat's tools, checked (errors name ``tools[i]``); None when it gives none."""
    choice = chat.WhichOneof("tool_choice")
    if not chat.tools and choice is None and not chat.HasField("parallel_tool_calls"):
        return None
    tools = []
    for index, tool in enumerate(chat.tools):
        try:
            parameters = json.loads(tool.parameters) if tool.parameters else None
        except ValueError as exc:
            raise InvalidRequestError(f"tools[{index}].parameters is not JSON: {exc}") from None
        tools.append(function_tool(tool.name, tool.description, parameters,
                                   tool.strict if tool.HasField("strict") else None, f"tools[{index}]"))
    mode = chat.tool_mode if choice == "tool_mode" else ("function", chat.tool_function) if choice else None
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None
    return tool_use(tools, mode, parallel, "tool_mode" if choice == "tool_mode" else "tool_function")


class ToolCallReader:
    """A chat's responses with tools: each one's text read as content and completed calls."""

    def __init__(self, fmt: ToolCallFormat):
        self.parser = ToolCallParser(fmt)

    def read(self, message: Output) -> tuple[str, list[tandem_pb2.ToolCall], str | None]:
        """(content, calls completed, the finish reason) of one message."""
        events = self.parser.feed(message.text) + (self.parser.finish() if message.end is not None else [])
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls = [self.parser.calls[e.index] for e in events if isinstance(e, CallClosed)]
        reason = message.end.finish_reason if message.end is not None else None
        if reason == "stop" and self.parser.calls:
            reason = "tool_calls"
        return content, [tandem_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls], reason


def structured_output(sampling: tandem_pb2.SamplingParams) -> StructuredOutput:
    """The spec of ``sampling``'s ``structured`` oneof (set); RequestError names the field."""
    kind = sampling.WhichOneof("structured")
    source = f"sampling.{kind}"
    if kind == "json_object" and not sampling.json_object:
        raise RequestError(f"{source}: set it true, or leave it out for free text")
    if kind == "choice" and not all(sampling.choice.options):
        raise RequestError(f"{source}.options: give non-empty strings")
    try:
        if kind == "grammar":
            syntax = sampling.grammar.syntax or "ebnf"
            if syntax not in ("ebnf", "lark"):
                raise RequestError(f'{source}.syntax: must be "ebnf" (GBNF) or "lark", got {syntax!r:.60}')
            return StructuredOutput("grammar", sampling.grammar.text, syntax=syntax, source=source)
        value = {"json_schema": sampling.json_schema, "json_object": "", "regex": sampling.regex,
                 "choice": json.dumps(list(sampling.choice.options))}[kind]
        return StructuredOutput(kind, value, source=source)
    except InvalidRequestError as exc:
        raise RequestError(str(exc)) from None


def response_message(message: Output, reader: ToolCallReader | None = None) -> tandem_pb2.GenerateResponse:
    text, calls, reason = reader.read(message) if reader is not None else (message.text, [], None)
    response = tandem_pb2.GenerateResponse(request_id=message.request_id, token_ids=message.token_ids,
                                           text=text, finished=message.finished, tool_calls=calls)
    for logprob, top in message.logprobs or []:
        response.logprobs.add(logprob=logprob, top=[tandem_pb2.TopLogprob(token_id=t, logprob=p) for t, p in top])
    if message.placement:
        response.prefill_worker, response.decode_worker = message.placement
    if message.end is not None:
        end = message.end
        response.finish_reason = reason or end.finish_reason or ""
        usage = end.usage
        response.usage.CopyFrom(tandem_pb2.Usage(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                                                 completion_tokens=usage.completion_tokens))
        t = end.timings
        response.timings.CopyFrom(tandem_pb2.Timings(queue_ms=t.queue_ms, ttft_ms=t.ttft_ms, tpot_ms=t.tpot_ms,
                                                     e2e_ms=t.e2e_ms))
    return response


class TandemServicer(tandem_pb2_grpc.TandemServicer):
    def __init__(self, path, status=None):
        self.path = path
        self.status = status  # async () -> tandem_pb2.ClusterStatus
        self._closing: set[asyncio.Future] = set()  # finished calls' bookkeeping, still running

    async def Generate(self, request, context):
        arrival = time.time()
        try:
            payload, tool_format = request_payload(request, self.path.tool_calling)
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reader = ToolCallReader(tool_format) if tool_format is not None else None
        payload = replace(payload, arrival=arrival)
        if self.path.tracer is not None:  # the request's trace joins the caller's
            payload = replace(payload, traceparent=dict(context.invocation_metadata() or ()).get("traceparent"))
        # Written with context.write, not yielded: a cancelled call then cancels this coroutine at
        # once (a handler that yields is only dropped, and its cleanup waits for the collector).
        messages = self.path.generate(payload)
        try:
            async for message in messages:
                if isinstance(message, RequestFailed):
                    context.set_trailing_metadata(retry_after.grpc_trailers(message))
                    await context.abort(CODES.get(message.kind, grpc.StatusCode.UNAVAILABLE), message.message)
                await context.write(response_message(message, reader))
                if message.finished:
                    break
        except BaseException:
            await messages.aclose()  # a call that ended early aborts its request on every worker
            raise
        # The call ends now; the request's bookkeeping (its router, metrics and trace) runs after.
        self._closing.add(closing := asyncio.ensure_future(messages.aclose()))
        closing.add_done_callback(self._closing.discard)

    async def GetStatus(self, request, context):
        if self.status is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server has no cluster status to show")
        return await self.status()

    async def GetModelInfo(self, request, context):
        return tandem_pb2.ModelInfo(**self.path.model_info())

    async def Tokenize(self, request, context):
        return tandem_pb2.TokenizeResponse(token_ids=await self._invalid_as_status(context, self.path.tokenize,
                                                                                    request.text))

    async def Detokenize(self, request, context):
        return tandem_pb2.DetokenizeResponse(text=await self._invalid_as_status(context, self.path.detokenize,
                                                                                 list(request.token_ids)))

    @staticmethod
    async def _invalid_as_status(context, fn, *args):
        try:
            return fn(*args)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>``; the health service is exempt."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        metadata = dict(details.invocation_metadata)
        if metadata.get("authorization") == self.expected:
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong bearer token (authorization metadata)")

        async def refuse_stream(request, context):
            await refuse(request, context)
            yield  # an async generator, as a streaming handler must be

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)


def api_token(spec: ClusterSpec) -> str | None:
    server = spec.server
    if server.auth_token_env:
        token = os.environ.get(server.auth_token_env)
        if not token:
            raise ValueError(f"server.auth_token_env: environment variable {server.auth_token_env} is not set")
        return token
    if server.auth_token_file:
        return Path(server.auth_token_file).read_text().strip()
    return None


def build_server(spec: ClusterSpec, path, status=None) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """The asyncio server, bound (not started) to the topology's host and port; the port it
    got. Call it on the event loop that will run the server."""
    token = api_token(spec)
    server = grpc.aio.server(interceptors=[TokenCheck(token)] if token else [])
    tandem_pb2_grpc.add_TandemServicer_to_server(TandemServicer(path, status), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    host = spec.server.host
    address = host_port(host, spec.server.port)
    tls = spec.server.tls
    try:
        if tls is not None and tls.cert_file:
            credentials = grpc.ssl_server_credentials(
                [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())])
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"server.port: cannot bind {address} (is the port in use?)")
    return server, port, health_servicer


class ApiServer:
    """The APIs of one ingress replica, on an event loop of its own thread, so they serve the
    same whoever hosts them (a Ray Serve replica, a test, a plain process): gRPC on
    ``server.port`` and, unless ``server.http_port`` is null, the OpenAI-compatible HTTP API."""

    def __init__(self, spec: ClusterSpec, path, status=None):
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(spec, path, status), name="grpc-api", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError("the gRPC server did not start")
        if self._error is not None:
            raise self._error

    def _run(self, spec: ClusterSpec, path, status) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self.server, self.port, self.health = self._loop.run_until_complete(self._start(spec, path, status))
            self.http_runner, self.http_port, self.http = self._loop.run_until_complete(self._start_http(spec, path))
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's caller
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    @staticmethod
    async def _start(spec: ClusterSpec, path, status):
        server, port, health_servicer = build_server(spec, path, status)
        await server.start()
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        return server, port, health_servicer

    @staticmethod
    async def _start_http(spec: ClusterSpec, path):
        if spec.server.http_port is None:
            return None, None, None
        from cluster.ingress.http_server import start_http

        return await start_http(path, spec.server.host, spec.server.http_port, api_token(spec), spec.server.tls)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, coroutine):
        """Runs a coroutine on the server's event loop (beside the calls); its concurrent future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    async def serving_changed(self, serving: bool) -> None:
        """Sets the health service's status, and the HTTP API's (on the server's loop)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if self.http is not None:
            self.http.serving = serving
        for name in ("", SERVICE):
            await self.health.set(name, status)

    def stop(self, grace_s: float = 2.0, then=None) -> None:
        """Stops taking calls (gRPC, then HTTP), lets those in flight end within ``grace_s``, runs
        ``then()`` (a coroutine function: what is left once no call runs) and ends the loop."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self._loop).result(timeout=grace_s + 10)
        if self.http_runner is not None:
            asyncio.run_coroutine_threadsafe(self.http_runner.cleanup(), self._loop).result(timeout=grace_s + 10)
        if then is not None:
            try:
                asyncio.run_coroutine_threadsafe(then(), self._loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - stopping: what could not be written is lost with the process
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
