"""The stream between an ingress and a worker, over real loopback sockets: items arrive in
order and the connection is kept for the next request; a connection without the cluster's
token is closed unanswered; a caller that goes away ends the request on the worker; a worker
that goes away raises WorkerGone; a request the worker refuses comes back as one error item."""

from __future__ import annotations

import asyncio

import pytest

from cluster.engine.sampling_params import SamplingParams
from cluster.protocol.messages import Finished, RequestFailed, TokenDelta, Usage, WorkerRequest
from cluster.protocol.stream import StreamClient, StreamServer, WorkerGone, encode, frame, read_frame

pytestmark = pytest.mark.unit

TOKEN = "s3cret"


def request(request_id: str, count: int = 1) -> WorkerRequest:
    """A request for ``count`` items (its prompt's length)."""
    return WorkerRequest(request_id, [0] * count, SamplingParams())


class Worker:
    """Streams ``count`` items for a request, waiting on ``gate`` before each after the first;
    records how each request ended."""

    def __init__(self):
        self.ended: dict[str, str] = {}
        self.gate = asyncio.Event()
        self.gate.set()

    def serve(self, request: WorkerRequest):
        if request.request_id == "refuse":
            raise ValueError("no such model")
        return self._items(request)

    async def _items(self, request: WorkerRequest):
        rid, count = request.request_id, len(request.prompt_token_ids)
        try:
            for i in range(count):
                if i:
                    await self.gate.wait()
                if i == count - 1:
                    self.ended[rid] = "finished"
                yield TokenDelta([i], "", end=Finished("length", Usage(count, 0, count)) if i == count - 1 else None)
        finally:
            self.ended.setdefault(rid, "closed early")


def serving(test) -> None:
    """Runs ``test(worker, server, client)`` against a stream server on loopback; closes both."""
    async def main():
        worker = Worker()
        server = StreamServer(worker.serve, TOKEN)
        await server.start("127.0.0.1")
        client = StreamClient(TOKEN)
        try:
            await test(worker, server, client)
        finally:
            client.close()
            server.close()

    asyncio.run(main())


async def until(condition, what: str) -> None:
    for _ in range(2000):  # a hang guard only
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_items_come_in_order_and_the_connection_is_kept():
    async def test(worker, server, client):
        assert server.address.startswith("127.0.0.1:")
        for rid in ("a", "b"):
            items = [item async for item in client.generate(server.address, request(rid, 3))]
            assert [i.token_ids for i in items] == [[0], [1], [2]] and items[-1].final
        assert worker.ended == {"a": "finished", "b": "finished"}
        assert len(client._idle[server.address]) == 1  # one connection served both

    serving(test)


def test_a_connection_without_the_token_is_closed_unanswered():
    async def test(worker, server, client):
        host, port = server.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(encode({"token": "guess"}) + frame(request("x")))
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(reader)
        writer.close()
        assert worker.ended == {}
        with pytest.raises(WorkerGone):
            async for _ in StreamClient("guess").generate(server.address, request("y")):
                pass

    serving(test)


def test_a_caller_that_goes_away_ends_the_request_on_the_worker():
    async def test(worker, server, client):
        worker.gate.clear()  # the second item never comes until the gate opens
        stream = client.generate(server.address, request("a", 3))
        assert (await stream.__anext__()).token_ids == [0]
        await stream.aclose()  # the caller went away mid-stream
        await until(lambda: "a" in worker.ended, "the worker to end the request")
        assert worker.ended["a"] == "closed early"
        assert not client._idle.get(server.address)  # an unfinished connection is not reused

    serving(test)


def test_a_worker_that_goes_away_raises_worker_gone_and_a_refused_request_is_one_error_item():
    async def test(worker, server, client):
        refused = [item async for item in client.generate(server.address, request("refuse"))]
        assert refused == [RequestFailed("unavailable", "the worker refused it: no such model")]
        worker.gate.clear()
        stream = client.generate(server.address, request("a", 3))
        await stream.__anext__()
        server.close()  # as the kernel closes a dead worker's connections
        with pytest.raises(WorkerGone, match="the stream from 127.0.0.1:"):
            await stream.__anext__()

    serving(test)


def test_a_connection_lost_between_two_items_ends_the_request_quietly_under_uvloop():
    """uvloop raises RuntimeError, not ConnectionError, on a write to a closed transport: a
    connection lost while the worker has its next item ready must end the request quietly,
    never as a traceback in the worker's log (it once failed CI that way)."""
    uvloop = pytest.importorskip("uvloop")
    errors: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        worker = Worker()
        server = StreamServer(worker.serve, TOKEN)
        await server.start("127.0.0.1")
        client = StreamClient(TOKEN)
        try:
            worker.gate.clear()
            stream = client.generate(server.address, request("a", 3))
            assert (await stream.__anext__()).token_ids == [0]
            (connection,) = server._writers
            connection.transport.abort()  # lost, and in the same tick the next item is ready
            worker.gate.set()
            await until(lambda: "a" in worker.ended and not server._writers, "the worker to end the request")
            assert worker.ended["a"] == "closed early"
            with pytest.raises(WorkerGone):
                await stream.__anext__()
        finally:
            client.close()
            server.close()

    uvloop.run(main())
    assert errors == []
