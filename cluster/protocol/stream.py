"""The stream between an ingress replica and the decode (or colocated) worker serving a request:
the request goes out in one frame and its items come back a frame each, over a TCP connection
that the worker listens for on its node's address and the ingress keeps open for its next
request to that worker.

Why not a Ray streaming generator, as before: a Ray call and each item it streams cross both
processes' Ray core workers, about 1 ms a hop on a 2-core machine (``benchmarks/
cluster_overhead.py`` measured the hop at 2.4 ms of a request's 8 ms of overhead); a kept-open
socket crosses only the kernel (about 0.02 ms). Ray still starts, places and watches the
workers, and the ingress finds each worker's address by one Ray call (``open_stream``).

Frames are a 4-byte big-endian length and a msgpack body: a message of ``messages.py`` as
``codec.py`` makes it plain data (never pickle). A connection's first frame, a ``Hello``, is
the cluster's stream token (a secret the deployment makes and hands
to its workers and ingress replicas through Ray); a connection without it is closed unanswered,
so the port serves nobody outside the cluster.

Ending: a caller that goes away closes its connection, and the worker ends the request there (as
when a Ray generator was cancelled: its blocks are released). A worker that dies has its
connections closed by the kernel: the caller gets :class:`WorkerGone` and moves the request
(migration). TCP keep-alive finds a peer whose whole node vanished.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import struct
from typing import AsyncIterator, Callable

import msgpack

from cluster.protocol.codec import decode_message, encode_message
from cluster.protocol.messages import Hello, RequestFailed, WorkerRequest
from cluster.runtime.ports import host_port

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # a prompt of a million token ids is about 5 MB
KEEPALIVE = (5, 2, 3)  # idle seconds, seconds between probes, probes: a vanished peer is found in ~11 s
IDLE_KEPT = 64  # idle connections an ingress keeps to one worker


class WorkerGone(ConnectionError):
    """The connection to a worker broke before its request finished."""


def encode(obj) -> bytes:
    """One frame of plain data."""
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def frame(message) -> bytes:
    """One frame holding a message."""
    return encode(encode_message(message))


def send(writer: asyncio.StreamWriter, *messages) -> None:
    """Writes each message's frame; ConnectionResetError once the connection is closing.

    Why not ``writer.write`` alone: on uvloop (the loop of Ray's actors and of the ingress) a
    write to a transport already closed raises RuntimeError, not a ConnectionError, so a caller
    hanging up between two items surfaced as a traceback in the worker's log."""
    if writer.is_closing():
        raise ConnectionResetError("the connection is closed")
    writer.write(b"".join(frame(message) for message in messages))


async def read_frame(reader: asyncio.StreamReader):
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME:
        raise ConnectionError(f"a frame of {size} bytes is over the limit of {MAX_FRAME}")
    return msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=False)


async def read_message(reader: asyncio.StreamReader):
    return decode_message(await read_frame(reader))


def keep_alive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# -- the worker's side ---------------------------------------------------------------------------

Serve = Callable[[WorkerRequest], AsyncIterator]  # a request -> its messages, the last one ``final``


class StreamServer:
    """Serves requests on connections from ingress replicas, one request at a time per
    connection, on the event loop it is started from (the worker actor's)."""

    def __init__(self, serve: Serve, token: str):
        self.serve, self.token = serve, token
        self.server: asyncio.base_events.Server | None = None
        self.address = ""
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str) -> str:
        self.server = await asyncio.start_server(self._connection, host, 0)
        port = self.server.sockets[0].getsockname()[1]
        self.address = host_port(host, port)
        return self.address

    def close(self) -> None:
        """Stops listening and closes every connection (their requests end)."""
        if self.server is not None:
            self.server.close()
        for writer in list(self._writers):
            writer.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keep_alive(writer)
        self._writers.add(writer)
        requests: asyncio.Queue = asyncio.Queue()
        closed = asyncio.get_running_loop().create_future()
        reading = asyncio.ensure_future(self._read_requests(reader, requests, closed))
        try:
            while not closed.done():
                taking = asyncio.ensure_future(requests.get())
                await asyncio.wait({taking, closed}, return_when=asyncio.FIRST_COMPLETED)
                if not taking.done():
                    taking.cancel()
                    return
                if not await self._one(taking.result(), writer, closed):
                    return
        except asyncio.CancelledError:  # the loop is shutting down: the connection just ends
            return
        finally:
            reading.cancel()
            self._writers.discard(writer)
            writer.close()

    async def _read_requests(self, reader: asyncio.StreamReader, requests: asyncio.Queue,
                             closed: asyncio.Future) -> None:
        """Reads the token, then requests, until the caller closes the connection."""
        try:
            hello = await read_message(reader)
            if not (isinstance(hello, Hello) and isinstance(hello.token, str)
                    and hmac.compare_digest(hello.token.encode(), self.token.encode())):
                return
            while True:
                request = await read_message(reader)
                if not isinstance(request, WorkerRequest):
                    return
                requests.put_nowait(request)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, msgpack.UnpackException):
            return
        finally:
            if not closed.done():
                closed.set_result(None)

    async def _one(self, request: WorkerRequest, writer: asyncio.StreamWriter, closed: asyncio.Future) -> bool:
        """Streams one request's items; False when the caller went away first (the request is
        ended by closing its item generator, which releases it on the worker)."""
        async def pump() -> bool:
            try:
                items = self.serve(request)
            except Exception as exc:  # noqa: BLE001 - a request the worker cannot take: one line back
                send(writer, RequestFailed("unavailable", f"the worker refused it: {exc}"))
                await writer.drain()
                return True
            try:
                async for item in items:
                    send(writer, item)
                    await writer.drain()
                    if item.final:
                        return True
                return False
            finally:
                await items.aclose()

        pumping = asyncio.ensure_future(pump())
        try:
            await asyncio.wait({pumping, closed}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pumping.cancel()  # the request ends with its connection
            raise
        if pumping.done():
            try:
                return pumping.result()
            except (ConnectionError, OSError):
                return False
        pumping.cancel()
        try:
            await pumping
        except (asyncio.CancelledError, ConnectionError, OSError):
            pass
        return False


# -- the ingress's side --------------------------------------------------------------------------

class StreamClient:
    """An ingress replica's connections to workers, kept open between requests."""

    def __init__(self, token: str):
        self.token = token
        self._idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def _connect(self, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        idle = self._idle.get(address, [])
        while idle:
            reader, writer = idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        keep_alive(writer)
        send(writer, Hello(self.token))
        return reader, writer

    async def generate(self, address: str, request: WorkerRequest) -> AsyncIterator:
        """The request's messages, the last one ``final``; WorkerGone if the connection breaks
        first. Closing this generator early ends the request on the worker."""
        connection = None
        done = False
        try:
            connection = await self._connect(address)
            reader, writer = connection
            send(writer, request)
            await writer.drain()
            while not done:
                item = await read_message(reader)
                done = item.final
                yield item
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise WorkerGone(f"the stream from {address} broke: {exc or type(exc).__name__}") from None
        finally:
            if connection is not None:
                if done and len(self._idle.setdefault(address, [])) < IDLE_KEPT:
                    self._idle[address].append(connection)
                else:
                    connection[1].close()

    def forget(self, address: str) -> None:
        """Closes the idle connections to a worker found dead."""
        for _, writer in self._idle.pop(address, []):
            writer.close()

    def close(self) -> None:
        for address in list(self._idle):
            self.forget(address)
