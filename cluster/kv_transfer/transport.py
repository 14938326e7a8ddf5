"""The interface every KV transport implements, and the registry that picks one by name.

A transport moves tensors between this process and the ranks of one peer group; the workers
only call ``send``/``recv`` and wait on what they return, so another transport (an RDMA
library, shared memory) plugs in by registering a class under a new name, without touching
the workers. Configuration names the transport (``kv_transport: torch_distributed``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from cluster.request_limits import quote


class Pending(Protocol):
    def wait(self, timeout_s: float | None = None) -> None: ...

    def is_completed(self) -> bool: ...


class TransportError(RuntimeError):
    pass


class KVTransport(ABC):
    """Point-to-point tensor moves between ranks of one transfer group (prefill and decode
    ranks together); ``tag`` keeps concurrent messages between the same pair apart."""

    name: str = ""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @abstractmethod
    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending: ...

    @abstractmethod
    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending: ...

    def close(self) -> None:
        """Releases connections; pending moves fail."""


_TRANSPORTS: dict[str, type[KVTransport]] = {}


def register_transport(cls: type[KVTransport]) -> type[KVTransport]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _TRANSPORTS[cls.name] = cls
    return cls


def transport_class(name: str) -> type[KVTransport]:
    """The transport registered under ``name``; TransportError naming the known ones if none."""
    if name not in _TRANSPORTS:
        import cluster.kv_transfer.torch_transport  # noqa: F401  (registers the built-in transport)
    try:
        return _TRANSPORTS[name]
    except KeyError:
        raise TransportError(f"unknown KV transport {quote(name)}; known: {', '.join(sorted(_TRANSPORTS))}") from None


def create_transport(name: str, **options) -> KVTransport:
    return transport_class(name)(**options)
