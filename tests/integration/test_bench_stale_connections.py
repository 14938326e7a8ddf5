"""``tandem bench``'s OpenAI client against servers that close kept-alive connections (as
llama.cpp's ``llama-server`` does after a streamed response): a request that finds its pooled
connection closed before the server answered anything is sent again on a new connection and
counted; one that fails after the server answered anything, or on a new connection, fails.

The server here is a few lines of asyncio on loopback, written byte for byte so that the
closing is certain rather than a race: it answers the first request of each connection with a
streamed completion (server-sent events, chunked), and does something else with the next request
on the same connection: closes the connection unanswered, or starts the answer and dies mid-stream.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.bench.arrivals import Arrivals
from cluster.bench.clients import OpenAIBackend, SendOptions, wall_clock
from cluster.bench.metrics import summarize
from cluster.bench.report import format_summary
from cluster.bench.runner import Limits, run
from cluster.bench.workloads import Session, Turn, Workload

pytestmark = pytest.mark.integration

MODEL = "fake-model"


class OnePerConnection:
    """Answers the first request of each connection; ``reused`` says what the next one on it gets:
    ``"close"`` (the connection closed, no answer) or ``"die"`` (headers and one event, then closed)."""

    def __init__(self, reused: str = "close", first: str = "answer"):
        self.reused, self.first = reused, first
        self.answered = self.dropped = self.died = 0
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for number in range(2):
                body = await _read_request(reader)
                if body is None:
                    return
                what = self.first if number == 0 else self.reused
                if what == "answer":
                    await _answer(writer, body["max_tokens"])
                    self.answered += 1
                elif what == "die":
                    writer.write(_HEAD + _chunk(_event({"choices": [{"index": 0, "text": " w0",
                                                                     "finish_reason": None}]})))
                    await writer.drain()
                    self.died += 1
                    return
                else:
                    self.dropped += 1
                    return
        finally:
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> dict | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None  # the client closed the connection
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return json.loads(await reader.readexactly(length))


_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _event(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _answer(writer: asyncio.StreamWriter, max_tokens: int) -> None:
    writer.write(_HEAD)
    for i in range(max_tokens):
        last = i == max_tokens - 1
        writer.write(_chunk(_event({"choices": [{"index": 0, "text": f" w{i}",
                                                 "finish_reason": "length" if last else None}]})))
        await writer.drain()
        await asyncio.sleep(0.002)
    usage = {"prompt_tokens": 3, "completion_tokens": max_tokens, "total_tokens": 3 + max_tokens}
    writer.write(_chunk(_event({"choices": [], "usage": usage})) + _chunk(_event(b"[DONE]")) + b"0\r\n\r\n")
    await writer.drain()


async def serving(server: OnePerConnection, go):
    """Runs ``go(url)`` with ``server`` on a free loopback port."""
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    try:
        return await go(f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}")
    finally:
        listener.close()
        await listener.wait_closed()


def sessions(count: int, max_tokens: int = 4) -> Workload:
    return Workload(tuple(Session(f"s{i}", (Turn((5, 6, 7), max_tokens),)) for i in range(count)), "test")


def test_requests_on_closed_kept_alive_connections_are_retried_and_counted():
    server = OnePerConnection(reused="close")

    async def go(url):
        backend = OpenAIBackend(url, MODEL)
        try:
            return await run(backend, sessions(32), Arrivals("concurrency", concurrency=8), Limits(60.0),
                             SendOptions())
        finally:
            await backend.close()

    results = asyncio.run(serving(server, go))
    summary = summarize(results)
    assert (summary["requests"], summary["completed"], summary["failed"]) == (32, 32, 0)
    assert all(r.completion_tokens == 4 and len(r.chunks) == 4 for r in results)
    # every request the server dropped on a kept-alive connection was sent again, and only those
    assert server.dropped > 0 and summary["retried"] == server.dropped == sum(r.retried for r in results)
    assert server.answered == 32 and all(r.retried in (0, 1) for r in results)
    line = format_summary(summary, "run").splitlines()[2]
    assert line == (f"requests: 32 sent, 32 completed, 0 rejected (429 / RESOURCE_EXHAUSTED), 0 failed; "
                    f"{server.dropped} retried on a new connection (a kept-alive one was closed)")


def test_a_request_that_got_any_answer_is_not_retried():
    server = OnePerConnection(reused="die")

    async def go(url):
        backend = OpenAIBackend(url, MODEL)
        clock = wall_clock(0.0)
        try:
            first = await backend.send("a", [5, 6, 7], 3, None, SendOptions(), clock)
            second = await backend.send("b", [5, 6, 7], 3, None, SendOptions(), clock)  # the kept-alive connection
            return first, second
        finally:
            await backend.close()

    first, second = asyncio.run(serving(server, go))
    assert first.ok and first.completion_tokens == 3 and first.retried == 0
    assert not second.ok and second.retried == 0 and second.error.startswith("connection: ")
    assert len(second.chunks) == 1  # the one event it had
    assert (server.connections, server.answered, server.died) == (1, 1, 1)
    summary = summarize([first, second])
    assert (summary["failed"], summary["retried"]) == (1, 0)


def test_a_new_connection_closed_unanswered_is_not_retried():
    server = OnePerConnection(first="close")

    async def go(url):
        backend = OpenAIBackend(url, MODEL)
        try:
            return await backend.send("a", [5, 6, 7], 3, None, SendOptions(), wall_clock(0.0))
        finally:
            await backend.close()

    result = asyncio.run(serving(server, go))
    assert not result.ok and result.retried == 0 and result.error == "connection: Server disconnected"
    assert (server.connections, server.dropped) == (1, 1)
