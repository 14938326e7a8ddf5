"""How ``tandem scale`` (``cluster/deployment/scale_client.py``) reaches the process that owns a deployment (``tandem up``): a control port on
loopback that takes one :class:`~cluster.protocol.messages.ScaleRequest` per connection and runs it
on the deployment's :class:`~cluster.deployment.scaling.Scaler`, answering with a
``ScaleProgress`` per step and a ``ScaleResult`` at the end.

The frames are the worker stream's (``cluster/protocol/stream.py``: a length and a msgpack body
made by the one codec), opened by a ``Hello`` carrying the control token, a secret that ``up``
writes to a file only its user can read (``<cache>/clusters/<name>.control``) and names in its
state file, as ``tandem down`` finds the ``up`` process by its pid there. Like ``down``, it is for
the machine that ran ``up``.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import threading
from pathlib import Path
from typing import Callable

from cluster.deployment.scaling import ScaleError
from cluster.deployment.supervisor import first_line
from cluster.protocol.messages import Hello, ScaleProgress, ScaleRequest, ScaleResult
from cluster.protocol.stream import read_message, send
from cluster.runtime.ports import host_port

ACTIONS = ("add", "remove", "move")


class ControlServer:
    """Serves ``ScaleRequest``s for ``deployment`` on 127.0.0.1, on a thread of its own."""

    def __init__(self, deployment):
        self.deployment = deployment
        self.token = secrets.token_hex(16)
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-control", daemon=True)

    def start(self, token_file: Path) -> str:
        """Listens (a free port on loopback), writes the token to ``token_file`` (mode 0600);
        returns the address."""
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.touch(mode=0o600)
        token_file.chmod(0o600)
        token_file.write_text(self.token)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, "127.0.0.1", 0), self._loop).result()
        self.address = host_port("127.0.0.1", self._server.sockets[0].getsockname()[1])
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await read_message(reader)
            if not (isinstance(hello, Hello) and isinstance(hello.token, str)
                    and hmac.compare_digest(hello.token.encode(), self.token.encode())):
                return
            request = await read_message(reader)
            if not isinstance(request, ScaleRequest):
                send(writer, ScaleResult(False, "not a scale request"))
                return
            loop = asyncio.get_running_loop()
            lines: asyncio.Queue = asyncio.Queue()
            running = loop.run_in_executor(None, self._run, request,
                                           lambda line: loop.call_soon_threadsafe(lines.put_nowait, line))
            while not (running.done() and lines.empty()):
                taking = asyncio.ensure_future(lines.get())
                await asyncio.wait({taking, running}, return_when=asyncio.FIRST_COMPLETED)
                if taking.done():
                    send(writer, ScaleProgress(taking.result()))
                    await writer.drain()
                else:
                    taking.cancel()
            send(writer, running.result())
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return
        finally:
            writer.close()

    def _run(self, request: ScaleRequest, say: Callable[[str], None]) -> ScaleResult:
        """(On a thread.) The resize, as its result; a resize refused or failed is a result
        that says why, never a traceback."""
        scale = self.deployment.scale
        try:
            worker = run_scale(scale, request, say)
        except ScaleError as exc:
            return ScaleResult(False, str(exc), members=self._members())
        except Exception as exc:  # noqa: BLE001 - the operator gets one line; the cluster serves on
            return ScaleResult(False, f"{request.action} failed: {first_line(exc)}", members=self._members())
        return ScaleResult(True, worker=worker, members=self._members())

    def _members(self) -> dict[str, list[str]]:
        d = self.deployment
        return {role: [n for n in names] for role, names in d.members.items()}


def run_scale(scale, request: ScaleRequest, say: Callable[[str], None]) -> str:
    """Runs ``request`` on ``scale`` (a :class:`~cluster.deployment.scaling.Scaler`); returns
    the worker added or removed."""
    if request.action == "add":
        return scale.add(request.role, say=say)
    if request.action == "remove":
        scale.remove(request.worker, request.timeout_s, say=say)
        return request.worker
    if request.action == "move":
        return scale.move(request.worker, request.role, request.timeout_s, say=say)
    raise ScaleError(f"action: must be one of {', '.join(ACTIONS)}")
