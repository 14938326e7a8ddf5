"""The HTTP API's connections: what aiohttp answers by itself, before or around any route,
answered in OpenAI's error body too.

aiohttp answers a request that is not valid HTTP/1.1 (a ``Content-Length`` that is not a number
or disagrees with what follows, ``Transfer-Encoding`` beside ``Content-Length``, a broken chunk,
bytes that are not HTTP at all) and a handler's unexpected failure itself, in plain text of several
lines ("500 Internal Server Error\\n\\nServer got itself in trouble"). ``ApiRunner`` is the
``web.AppRunner`` whose connections answer those with ``{"error": {...}}`` and a one-line message,
as every route does; the details go to the server's log, as aiohttp logs them.
"""

from __future__ import annotations

from aiohttp import web

from cluster.engine.request_limits import clip
from cluster.ingress.openai_api import ApiError

_MESSAGES = {
    400: "the request is not valid HTTP/1.1",
    500: "the server failed on this request (an internal error; the server's log has the details)",
    504: "the server timed out on this request",
}


def protocol_error_message(status: int, message: str | None) -> str:
    """One line for what aiohttp answered with ``status``: its own first line for a request
    that is not HTTP, without the bytes it quotes."""
    text = _MESSAGES.get(status, f"HTTP {status}")
    detail = message.strip().splitlines()[0].rstrip(":").strip() if status == 400 and message and message.strip() \
        else ""
    return f"{text}: {clip(detail)}" if detail else text


class _Connection(web.RequestHandler):
    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises when a response is under way
        response = web.json_response(ApiError(status, protocol_error_message(status, message)).body(), status=status)
        response.force_close()
        return response


class ApiRunner(web.AppRunner):
    """A ``web.AppRunner`` whose sites open :class:`_Connection` s (its ``server`` is what
    a site hands each new connection to)."""

    @property
    def server(self):
        server = super().server
        if server is None:
            return None
        return lambda: _Connection(server, loop=server._loop, **server._kwargs)
