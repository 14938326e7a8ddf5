"""Choosing a free port that stays free until it is bound.

A port asked of the kernel with ``bind(port 0)`` comes from its ephemeral range, the same range
every outgoing connection takes its local port from; released and bound again seconds later
(``server.port: 0`` is bound by the ingress only after Ray has started and opened hundreds of
loopback connections), it can be taken meanwhile, and the API fails to start with "address
already in use" (a fresh-clone test run hit it). So a free port is picked below the ephemeral
range and above Ray's worker ports, where nothing is handed out by the kernel.
"""

from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS_END = 20000  # Ray's worker ports are 10002-19999 by default
EPHEMERAL_DEFAULT = 32768


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's setting; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_DEFAULT


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that can be bound now and that the kernel does not hand out by itself
    (one from the ephemeral range when none below it is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    end = ephemeral_start()
    candidates = random.sample(range(RAY_WORKER_PORTS_END, end), min(200, end - RAY_WORKER_PORTS_END)) \
        if end > RAY_WORKER_PORTS_END else []
    for port in candidates + [0]:
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port on {host}")
