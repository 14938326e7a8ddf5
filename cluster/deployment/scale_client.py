"""Resizing a cluster that ``tandem up`` runs, from another process: ``tandem scale`` and the Python
API ``scale_cluster``. The ``up`` process's control port (``cluster/deployment/control.py``) runs
the resize; its address and token file are named in the cluster's state file.

    from cluster.deployment.scale_client import scale_cluster
    from cluster.protocol.messages import ScaleRequest
    result = scale_cluster("tandem", ScaleRequest("move", worker="prefill-1", role="decode"), print)
    result.ok, result.worker, result.members   # True, 'decode-2', {'prefill': ['prefill-0'], 'decode': [...]}
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable

from cluster.deployment.state_file import process_alive, read_state
from cluster.protocol.messages import Hello, ScaleRequest, ScaleResult
from cluster.protocol.stream import read_message, send


class ClusterNotUp(RuntimeError):
    """No cluster of that name runs here (no state file, or its ``up`` process is gone)."""


def scale_cluster(cluster: str, request: ScaleRequest,
                  on_progress: Callable[[str], None] = lambda line: None) -> ScaleResult:
    """Runs ``request`` on the cluster ``cluster`` that ``tandem up`` started on this machine."""
    state = read_state(cluster)
    if not state or not process_alive(state["pid"]):
        raise ClusterNotUp(f"cluster {cluster!r} is not up here (`tandem up` first, or name it with --cluster)")
    if not state.get("control"):
        raise ClusterNotUp(f"cluster {cluster!r} was started by a `tandem up` without a control port; restart it")
    token = Path(state["control_token_file"]).read_text().strip()
    return request_scale(state["control"], token, request, on_progress)


def request_scale(address: str, token: str, request: ScaleRequest,
                  on_progress: Callable[[str], None] = lambda line: None) -> ScaleResult:
    """Sends ``request`` to the control port at ``address``; calls ``on_progress`` with each
    step's line; returns the result."""

    async def ask() -> ScaleResult:
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        try:
            send(writer, Hello(token), request)
            await writer.drain()
            while True:
                try:
                    message = await read_message(reader)
                except asyncio.IncompleteReadError:
                    return ScaleResult(False, "the cluster's control port closed the connection (a wrong token?)")
                if isinstance(message, ScaleResult):
                    return message
                on_progress(message.line)
        finally:
            writer.close()

    return asyncio.run(ask())
