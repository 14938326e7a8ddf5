"""``tandem bench``'s OpenAI-compatible client against a minimal in-test server speaking the
OpenAI streaming protocol (server-sent events, ``stream_options.include_usage``: the usage,
with ``prompt_tokens_details.cached_tokens``, in a last chunk with no choices). Tandem's own
HTTP API is not on main yet; this server is written from the OpenAI spec only."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from aiohttp import web

from cluster.bench.arrivals import Arrivals
from cluster.bench.clients import OpenAIBackend, SendOptions, wall_clock
from cluster.bench.metrics import summarize
from cluster.bench.runner import Limits, run
from cluster.bench.workloads import Session, Turn, Workload

pytestmark = pytest.mark.integration


class FakeOpenAI:
    """Streams ``max_tokens`` one-word chunks; answers 429 to a prompt that starts with token 1."""

    def __init__(self):
        self.bodies: list[dict] = []

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        prompt = body.get("prompt") or body["messages"][0]["content"]
        if isinstance(prompt, list) and prompt[0] == 1:
            return web.json_response({"error": {"message": "too busy", "type": "rate_limit"}}, status=429)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = "messages" in body
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(0.01)
            choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
            choice.update({"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"})
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                     "prompt_tokens_details": {"cached_tokens": 16}}
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


def run_async(coro):
    return asyncio.run(coro)


def test_streamed_completion_is_timed_and_its_usage_read():
    async def go():
        async with serve() as (fake, url):
            backend = OpenAIBackend(url + "/v1")
            info = await backend.model_info()
            clock = wall_clock(0.0)
            result = await backend.send("a", [5, 6, 7, 8], 5, None, SendOptions(temperature=0.0), clock)
            rejected = await backend.send("b", [1, 2], 3, None, SendOptions(), clock)
            await backend.close()
            return fake, info, result, rejected

    fake, info, result, rejected = run_async(go())
    assert info["name"] == "fake-model"
    body = fake.bodies[0]
    assert body["prompt"] == [5, 6, 7, 8] and body["stream"] is True and body["model"] == "fake-model"
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert body["temperature"] == 0.0
    assert result.ok and result.completion_tokens == 5 and result.cached_tokens == 16
    assert len(result.chunks) == 5 and result.ttft_s > 0 and result.tpot_s > 0
    assert rejected.error.startswith("HTTP 429") and "too busy" in rejected.error


def test_chat_endpoint_sends_text_and_a_closed_loop_run_completes():
    async def go():
        async with serve() as (fake, url):
            backend = OpenAIBackend(url, "fake-model", chat=True, detokenize=lambda ids: " ".join(map(str, ids)))
            sessions = tuple(Session(f"s{i}", (Turn((10 + i, 11), 3), Turn((12,), 2)), think_s=0.01)
                             for i in range(4))
            results = await run(backend, Workload(sessions, "test"), Arrivals("concurrency", concurrency=2),
                                Limits(60.0), SendOptions())
            await backend.close()
            return fake, results

    fake, results = run_async(go())
    assert len(results) == 8 and all(r.ok for r in results)
    assert fake.bodies[0]["messages"] == [{"role": "user", "content": "10 11"}]
    # the second turn carries the first answer (as filler tokens: the API gives only text) and its own tokens
    second = [b for b in fake.bodies if b["messages"][0]["content"].endswith(" 12")][0]
    assert len(second["messages"][0]["content"].split()) == 2 + 3 + 1
    summary = summarize(results)
    assert summary["completed"] == 8 and summary["prefix_cache_hit_rate"] > 0


class serve:
    """The fake server on a free loopback port, for ``async with``."""

    async def __aenter__(self):
        self.fake = FakeOpenAI()
        app = web.Application()
        app.router.add_get("/v1/models", self.fake.models)
        app.router.add_post("/v1/completions", self.fake.completions)
        app.router.add_post("/v1/chat/completions", self.fake.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self.runner, sock).start()
        return self.fake, f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def __aexit__(self, *exc):
        await self.runner.cleanup()
