"""The two ways ``tandem bench`` reaches a server, both asyncio and streaming, both timed at
the client:

- ``GrpcBackend``: a Tandem cluster's ``tandem.v1`` gRPC API (token ids in, token ids out,
  usage with cached tokens, the placement);
- ``OpenAIBackend``: any OpenAI-compatible HTTP server (Tandem's, vLLM's, SGLang's, ...):
  streamed ``/v1/completions`` (token-id prompts) or ``/v1/chat/completions`` (prompts
  decoded to text with a local tokenizer), ``stream_options.include_usage`` so the final chunk
  carries ``usage`` (and ``prompt_tokens_details.cached_tokens`` where the server reports it).

``send`` never raises for a failed request: the result carries ``error`` (a gRPC status name,
``HTTP <status>`` or ``timeout``) with the server's message.

A benchmark measures the server, not its own connection pool: a server may close a kept-alive
connection (llama.cpp's ``llama-server`` does, after a streamed response) just as the pool hands
it to the next request. A request that fails on a reused connection before the server answered
anything (the peer had closed it, or reset it while the request was written) is sent once more, on
a new connection, and counted (``RequestResult.retried``); one that fails after any answer, or on
a new connection, fails as it is.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from cluster.bench.metrics import Objectives, RequestResult

Clock = Callable[[], float]


@dataclass(frozen=True)
class SendOptions:
    """What every request of a run carries besides its prompt and length."""

    ignore_eos: bool = True
    temperature: float | None = None
    send_objectives: Objectives | None = None  # objectives sent with each request (Tandem's gRPC only)
    timeout_s: float = 300.0


class GrpcBackend:
    name = "grpc"

    def __init__(self, address: str, token: str | None = None, tls_ca_file: str | None = None):
        import grpc

        from tandem.v1 import tandem_pb2_grpc

        self.address = address
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if tls_ca_file:
            with open(tls_ca_file, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.aio.secure_channel(address, credentials)
        else:
            self._channel = grpc.aio.insecure_channel(address)
        self._stub = tandem_pb2_grpc.TandemStub(self._channel)

    async def model_info(self) -> dict:
        from tandem.v1 import tandem_pb2

        info = await self._stub.GetModelInfo(tandem_pb2.GetModelInfoRequest(), metadata=self._metadata, timeout=30)
        return {"name": info.name, "vocab_size": info.vocab_size, "max_model_len": info.max_model_len,
                "block_size": info.block_size, "slo_classes": list(info.slo_classes)}

    async def tokenize(self, text: str) -> list[int]:
        from tandem.v1 import tandem_pb2

        response = await self._stub.Tokenize(tandem_pb2.TokenizeRequest(text=text), metadata=self._metadata,
                                             timeout=30)
        return list(response.token_ids)

    async def send(self, request_id: str, prompt: Sequence[int], max_tokens: int, slo_class: str | None,
                   options: SendOptions, clock: Clock) -> RequestResult:
        import grpc

        from tandem.client import build_generate_request

        objectives = options.send_objectives
        request = build_generate_request(
            list(prompt), max_tokens=max_tokens, ignore_eos=options.ignore_eos, temperature=options.temperature,
            slo_class=slo_class or "", request_id=request_id,
            ttft_ms=objectives.ttft_s * 1000 if objectives and objectives.ttft_s else None,
            tpot_ms=objectives.tpot_s * 1000 if objectives and objectives.tpot_s else None)
        result = RequestResult(request_id, slo_class, len(prompt), clock())
        try:
            async for response in self._stub.Generate(request, metadata=self._metadata, timeout=options.timeout_s):
                now = clock()
                if response.prefill_worker or response.decode_worker:
                    result.placement = (response.prefill_worker, response.decode_worker)
                if response.token_ids:
                    if result.first_token_at is None:
                        result.first_token_at = now
                    result.chunks.append((now, len(response.token_ids)))
                    result.output_token_ids.extend(response.token_ids)
                if response.finished:
                    result.finished_at = now
                    result.completion_tokens = response.usage.completion_tokens or len(result.output_token_ids)
                    result.cached_tokens = response.usage.cached_tokens
                    result.prompt_tokens = response.usage.prompt_tokens or result.prompt_tokens
        except grpc.aio.AioRpcError as exc:
            result.error = f"{exc.code().name}: {(exc.details() or '')[:300]}"
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                result.rejected, result.finished_at = True, clock()
                result.retry_after_s = retry_after_s(dict(exc.trailing_metadata() or ()), "grpc-retry-pushback-ms")
        if result.error is None and result.finished_at is None:
            result.error = "unfinished: the stream ended without a finished message"
        return result

    async def close(self) -> None:
        await self._channel.close()


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, chat: bool = False,
                 detokenize: Callable[[list[int]], str] | None = None):
        import aiohttp

        if chat and detokenize is None:
            raise ValueError("--endpoint chat: prompts are token ids; give --tokenizer to turn them into text")
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.chat = chat
        self.detokenize = detokenize
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_mark_reused)
        self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                              trace_configs=[reuse])
        # where a request is sent again: a connection of its own, closed after its answer
        self._fresh = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                            connector=aiohttp.TCPConnector(force_close=True))

    async def model_info(self) -> dict:
        """The served model's name (``/v1/models``); the vocabulary is not part of the API."""
        if self.model is None:
            async with self._session.get(f"{self.base_url}/v1/models") as response:
                body = await response.text()
                if response.status != 200:
                    raise ConnectionError(f"GET {self.base_url}/v1/models answered HTTP {response.status}: "
                                          f"{body[:200]}")
                models = json.loads(body).get("data") or []
                if not models:
                    raise ConnectionError(f"{self.base_url}/v1/models lists no model; give --model")
                self.model = models[0]["id"]
        return {"name": self.model, "vocab_size": None}

    def _body(self, prompt: Sequence[int], max_tokens: int, options: SendOptions) -> tuple[str, dict]:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                      "stream_options": {"include_usage": True}}
        if options.temperature is not None:
            body["temperature"] = options.temperature
        if options.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and Tandem's extension; exact output lengths
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.detokenize(list(prompt))}]
            return "/v1/chat/completions", body
        body["prompt"] = list(prompt)
        return "/v1/completions", body

    async def send(self, request_id: str, prompt: Sequence[int], max_tokens: int, slo_class: str | None,
                   options: SendOptions, clock: Clock) -> RequestResult:
        import aiohttp

        path, body = self._body(prompt, max_tokens, options)
        result = RequestResult(request_id, slo_class, len(prompt), clock())
        try:
            chunks = await asyncio.wait_for(self._stream(path, body, result, clock), options.timeout_s)
        except asyncio.TimeoutError:
            result.error = f"timeout: no end within {options.timeout_s:g}s"
            return result
        except (aiohttp.ClientError, ValueError) as exc:
            result.error = f"connection: {str(exc)[:300]}"
            return result
        if result.error is None:
            if result.finished_at is None:
                result.error = "unfinished: the stream ended without a finish_reason or [DONE]"
            elif not result.completion_tokens:
                result.completion_tokens = chunks
        return result

    async def _post(self, path: str, body: dict, result: RequestResult):
        """The response (its status and headers read), sent again on a new connection when a
        reused one failed before the server answered anything."""
        import aiohttp

        attempt = _Attempt()
        try:
            return await self._session.post(self.base_url + path, json=body, trace_request_ctx=attempt)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not attempt.reused or not _nothing_answered(exc):
                raise
        result.retried += 1
        return await self._fresh.post(self.base_url + path, json=body)

    async def _stream(self, path: str, body: dict, result: RequestResult, clock: Clock) -> int:
        """Reads one streamed answer into ``result``; returns the chunks that carried text."""
        chunks = 0
        async with await self._post(path, body, result) as response:
            if response.status != 200:
                text = await response.text()
                result.error = f"HTTP {response.status}: {text[:300]}"
                if response.status == 429:
                    result.rejected, result.finished_at = True, clock()
                    result.retry_after_s = retry_after_s(response.headers, "retry-after-ms")
                return chunks
            async for data in _sse_data(response.content):
                now = clock()
                if data == "[DONE]":
                    result.finished_at = result.finished_at or now
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {str(chunk['error'])[:300]}"
                    return chunks
                for choice in chunk.get("choices") or []:
                    text = choice.get("text") if not self.chat else (choice.get("delta") or {}).get("content")
                    if text:
                        chunks += 1
                        if result.first_token_at is None:
                            result.first_token_at = now
                        result.chunks.append((now, 1))
                    if choice.get("finish_reason"):
                        result.finished_at = now
                usage = chunk.get("usage")
                if usage:
                    result.completion_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
        return chunks

    async def close(self) -> None:
        await self._session.close()
        await self._fresh.close()


@dataclass
class _Attempt:
    """One sending of a request: whether the pool gave it a connection used before."""

    reused: bool = False


async def _mark_reused(session, context, params) -> None:
    attempt = context.trace_request_ctx
    if isinstance(attempt, _Attempt):
        attempt.reused = True


def _nothing_answered(exc: Exception) -> bool:
    """Whether a failure to get a response came before any of it: aiohttp names what it had
    read of a response in ``ServerDisconnectedError.message``, else only "Server disconnected";
    a reset (``ClientOSError``) while the request was written or awaited its answer has none."""
    import aiohttp

    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return isinstance(exc.message, str)
    return True


async def _sse_data(stream):
    """The ``data:`` payloads of a server-sent event stream, one per event."""
    buffer: list[str] = []
    async for raw in stream:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if buffer:
                yield "\n".join(buffer)
                buffer = []
            continue
        if line.startswith("data:"):
            buffer.append(line[5:].lstrip())
    if buffer:
        yield "\n".join(buffer)


def retry_after_s(headers, milliseconds_key: str) -> float | None:
    """A refusal's wait in seconds: ``milliseconds_key`` (``retry-after-ms``,
    ``grpc-retry-pushback-ms``), else ``retry-after`` in seconds; None when it gave none."""
    for key, scale in ((milliseconds_key, 0.001), ("retry-after", 1.0)):
        value = headers.get(key)
        if value is not None:
            try:
                return float(value) * scale
            except ValueError:
                continue
    return None


def wall_clock(start: float) -> Clock:
    """Seconds since ``start`` on the monotonic performance counter."""
    return lambda: time.perf_counter() - start
