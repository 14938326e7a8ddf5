"""The OpenAI-compatible HTTP API of an ingress replica (aiohttp), beside its gRPC API.

``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed as
server-sent events (``data: {...}`` chunks, then ``data: [DONE]``) or answered whole; and
``POST /v1/responses``, streamed as named events (``event: response.created``, ...). Each
choice is one request down the request path (``cluster/ingress/request_path.py``), so HTTP requests
are placed, streamed, timed and recorded exactly like gRPC ones (metrics say ``api="http"``).
Request and response shapes are in ``cluster/ingress/openai_api.py`` and ``responses_api.py``.

The server binds ``server.host``:``server.http_port`` with ``SO_REUSEPORT`` (every ingress
replica shares the port), serves TLS with the gRPC API's certificate and asks for the same
bearer token (``Authorization: Bearer <token>``) on every route but ``/health``. A client that
disconnects aborts its request on every worker.

Every answer but a success is OpenAI's error body with a one-line message: a body is read as
strict JSON (``json_body.py``; at most ``MAX_BODY_BYTES``, ``Content-Type: application/json``
when a type is given), and what aiohttp answers by itself (a request that is not HTTP, a fault of
the server's own) is answered in the same body (``http_connection.py``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import replace
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from cluster.ingress import openai_api, responses_api
from cluster.ingress.http_connection import ApiRunner, protocol_error_message
from cluster.ingress.json_body import BodyError, parse_json_body
from cluster.ingress.openai_api import ApiError, Choice, OpenAIRequest
from cluster.ingress.responses_api import NOT_KEPT, ResponseWriter
from cluster.engine.request_limits import MAX_ECHO_CHARS, clip, quote
from cluster.engine.tool_calls.parser import ToolCallParser
from cluster.protocol.messages import ApiRequest, Ending, Output, RequestFailed

MAX_BODY_BYTES = 8 * 2**20


class OpenAIServer:
    def __init__(self, path, token: str | None = None):
        self.path = path
        self.token = token
        self.started = int(time.time())
        self.serving = True  # flipped by the ingress's health checks (503 from /health when not)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._auth])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{id}", self.stored_response)
        app.router.add_get("/health", self.health)
        return app

    # -- middlewares ---------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status,  # (aiohttp drains a body left unread)
                                     headers=exc.headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = ApiError(exc.status, f"{request.method} {clip(request.path)}: {exc.reason}",
                             code="unknown_url" if exc.status == 404 else None)
            return web.json_response(error.body(), status=exc.status)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.token and request.path != "/health" and \
                request.headers.get("Authorization") != f"Bearer {self.token}":
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                           code="invalid_api_key")
        return await handler(request)

    # -- routes ---------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "serving" if self.serving else "not serving"},
                                 status=200 if self.serving else 503)

    async def models(self, request: web.Request) -> web.Response:
        info = self.path.info
        return web.json_response(openai_api.models(info.model_name, info.max_model_len, self.started))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, openai_api.parse_completion)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, lambda body, name: openai_api.parse_chat(body, name,
                                                                                   self.path.tool_calling))

    async def _serve(self, request: web.Request, parse) -> web.StreamResponse:
        arrival = time.time()
        req = parse(await _json_body(request), self.path.info.model_name)
        requests = [replace(r, arrival=arrival, api="http") for r in req.choice_requests()]
        if req.stream:
            return await self._stream(request, req, requests)
        return await self._whole(req, requests)

    async def _whole(self, req: OpenAIRequest, requests: list[ApiRequest]) -> web.Response:
        choices = [Choice(i) for i in range(req.n)]
        streams = [self.path.generate(r) for r in requests]
        try:
            await asyncio.gather(*(self._collect(s, c) for s, c in zip(streams, choices)))
        finally:
            for stream in streams:  # a caller gone (cancelled): abort every choice
                await stream.aclose()
        if req.tool_format is not None:
            for choice in choices:
                parsed = ToolCallParser(req.tool_format).parse(choice.text)
                choice.text, choice.tool_calls = parsed.content, parsed.calls
                choice.finish_reason = _with_calls(choice.finish_reason, parsed.calls)
        return web.json_response(openai_api.response(req, choices, self._decode))

    @staticmethod
    async def _collect(stream, choice: Choice) -> None:
        async for message in stream:
            if isinstance(message, RequestFailed):
                raise openai_api.error_for(message)
            choice.text += message.text
            choice.token_ids += message.token_ids
            choice.logprobs += message.logprobs or []
            if message.end is not None:
                choice.finish_reason, choice.usage = _ending(message.end)

    async def _stream(self, request: web.Request, req: OpenAIRequest,
                      requests: list[ApiRequest]) -> web.StreamResponse:
        streams = [self.path.generate(r) for r in requests]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for message in stream:
                    await queue.put((index, message))
            finally:
                await queue.put((index, None))

        first = await self._first_messages(streams)  # errors before any token are answered as statuses
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        for index, message in enumerate(first):
            queue.put_nowait((index, message))
        choices = [Choice(i) for i in range(req.n)]
        parsers = [ToolCallParser(req.tool_format) for _ in choices] if req.tool_format is not None else None
        try:
            for choice in choices:
                if req.kind == "chat":
                    await _send(response, openai_api.chunk(req, choice.index, "", role=True))
            open_streams = req.n
            while open_streams:
                index, message = await queue.get()
                if message is None:
                    open_streams -= 1
                    continue
                await self._stream_message(response, req, choices[index], message, parsers and parsers[index])
            if req.include_usage:
                completion = sum(c.usage[2] if c.usage else len(c.token_ids) for c in choices)
                prompt, cached = (choices[0].usage[0], choices[0].usage[1]) if choices[0].usage else (0, 0)
                await _send(response, openai_api.usage_chunk(req, openai_api.usage(prompt, completion, cached)))
            await response.write(b"data: [DONE]\n\n")
        finally:  # a caller gone: each pump is cancelled inside its stream, which aborts its request
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)  # done before the streams are closed:
            for stream in streams:  # closing a stream its pump still runs raises (and left a traceback)
                await stream.aclose()
        return response

    async def _first_messages(self, streams) -> list[dict]:
        """Each choice's first message, so that a request refused before any token (bad field,
        admission control, no worker) is answered with its status, not an event stream."""
        firsts = await asyncio.gather(*(anext(s, None) for s in streams), return_exceptions=True)
        for message in firsts:
            if isinstance(message, BaseException):
                raise message
            if isinstance(message, RequestFailed):
                for stream in streams:
                    await stream.aclose()
                raise openai_api.error_for(message)
        return [m for m in firsts if m is not None]

    async def _stream_message(self, response, req: OpenAIRequest, choice: Choice, message: Output | RequestFailed,
                              parser: ToolCallParser | None = None) -> None:
        if isinstance(message, RequestFailed):  # failed after its first token: say so in the stream, then end it
            error = openai_api.error_for(message)
            await _send(response, error.body())
            choice.finish_reason = "error"
            return
        logprobs = None
        if req.logprobs is not None and message.logprobs:
            logprobs = openai_api.logprobs_block(req.kind, message.logprobs, message.token_ids, self._decode,
                                                 len(choice.text))
        choice.text += message.text
        choice.token_ids += message.token_ids
        if parser is not None:  # the text read as content and tool calls
            events = parser.feed(message.text) + (parser.finish() if message.end is not None else [])
            for payload in openai_api.event_chunks(req, choice.index, events, logprobs):
                await _send(response, payload)
        elif message.token_ids or message.text:
            await _send(response, openai_api.chunk(req, choice.index, message.text, None, logprobs))
        if message.end is not None:
            choice.finish_reason, choice.usage = _ending(message.end)
            if parser is not None:
                choice.finish_reason = _with_calls(choice.finish_reason, parser.calls)
            await _send(response, openai_api.chunk(req, choice.index, "" if req.kind == "completion" else None,
                                                   choice.finish_reason))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        arrival = time.time()
        req = responses_api.parse_responses(await _json_body(request), self.path.info.model_name,
                                            self.path.tool_calling)
        stream = self.path.generate(replace(req.request, arrival=arrival, api="http"))
        if req.stream:
            return await self._stream_response(request, req, stream)
        writer = ResponseWriter(req)
        try:
            async for message in stream:
                if isinstance(message, RequestFailed):
                    raise openai_api.error_for(message)
                _response_events(writer, message)
        finally:
            await stream.aclose()
        return web.json_response(writer.final)

    async def _stream_response(self, request: web.Request, req: responses_api.ResponsesRequest,
                               stream) -> web.StreamResponse:
        first = await self._first_messages([stream])  # errors before any token are answered as statuses
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        writer = ResponseWriter(req)
        try:
            events = writer.start()
            for message in first:
                events += _response_events(writer, message)
            for event in events:
                await _send_event(response, event)
            async for message in stream:
                for event in _response_events(writer, message):
                    await _send_event(response, event)
        finally:
            await stream.aclose()
        return response

    async def stored_response(self, request: web.Request) -> web.Response:
        raise ApiError(404, f"response {request.match_info['id'][:MAX_ECHO_CHARS]!r} not found: {NOT_KEPT}")

    def _decode(self, token_id: int) -> str:
        tokenizer = self.path.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else ""


async def _json_body(request: web.Request):
    """The request's body as strict JSON (``json_body.py``), or the 4xx that says what is wrong with it."""
    content_type = request.headers.get("Content-Type")
    if content_type is not None and not _is_json(request.content_type):
        raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), got Content-Type "
                            f"{quote(content_type)}")
    too_large = ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes, the most this server reads")
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise too_large
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except HttpProcessingError as exc:  # a broken chunk, a body shorter than its Content-Length
        raise ApiError(400, protocol_error_message(400, exc.message)) from None
    try:
        return parse_json_body(raw)
    except BodyError as exc:
        raise ApiError(400, str(exc), exc.param) from None


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or (media_type.startswith("application/") and
                                                 media_type.endswith("+json"))


def _response_events(writer: ResponseWriter, message: Output | RequestFailed) -> list[dict]:
    """The Responses API events of one message (an ``error`` event for a failure after the first token)."""
    if isinstance(message, RequestFailed):
        error = openai_api.error_for(message)
        return writer.error(error.message, error.code, error.param)
    events = writer.text(message.text)
    if message.end is not None:
        events += writer.finish(*_ending(message.end))
    return events


def _with_calls(finish_reason: str | None, calls: list) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` when the model stopped after calling tools."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _ending(end: Ending) -> tuple[str, list[int]]:
    """A choice's finish reason and usage ([prompt, cached, completion]) from its last message."""
    usage = end.usage
    return end.finish_reason, [usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens]


async def _send_event(response: web.StreamResponse, event: dict) -> None:
    """One Responses API event, named as OpenAI names them."""
    await response.write(f"event: {event['type']}\ndata: ".encode() + json.dumps(event, separators=(",", ":")).encode()
                         + b"\n\n")


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def start_http(path, host: str, port: int, token: str | None, tls=None) -> tuple[web.AppRunner, int, OpenAIServer]:
    """Starts the HTTP API on the running event loop; returns its runner, the port it got and
    the server (whose ``serving`` the health checks set)."""
    server = OpenAIServer(path, token)
    runner = ApiRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    context = None
    if tls is not None and tls.cert_file:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(Path(tls.cert_file), Path(tls.key_file))
    site = web.TCPSite(runner, host, port, ssl_context=context, reuse_port=True)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"server.http_port: cannot listen on {host}:{port} ({exc.strerror})") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, bound, server
