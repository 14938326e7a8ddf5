"""The KV transports by name: the built-in one, and any other registered under a new name (an
RDMA library, shared memory) without touching the workers. Configuration names the transport
(``kv_transport: torch_distributed``).
"""

from __future__ import annotations

from cluster.engine.request_limits import quote
from cluster.kv_transfer.torch_transport import TorchDistributedTransport
from cluster.kv_transfer.transport import KVTransport, TransportError

_TRANSPORTS: dict[str, type[KVTransport]] = {TorchDistributedTransport.name: TorchDistributedTransport}


def register_transport(cls: type[KVTransport]) -> type[KVTransport]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _TRANSPORTS[cls.name] = cls
    return cls


def transport_class(name: str) -> type[KVTransport]:
    """The transport registered under ``name``; TransportError naming the known ones if none."""
    try:
        return _TRANSPORTS[name]
    except KeyError:
        raise TransportError(f"unknown KV transport {quote(name)}; known: {', '.join(sorted(_TRANSPORTS))}") from None


def create_transport(name: str, **options) -> KVTransport:
    return transport_class(name)(**options)
