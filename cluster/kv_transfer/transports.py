"""The KV transports by name: the built-in one, and any other registered under a new name (an
RDMA library, shared memory) without touching the workers. Configuration names the transport
(``kv_transport: torch_distributed``). The built-in transport's module (torch.distributed) is
imported when a transport is made, not when a name is checked: a topology is validated by
processes that move no KV (``tandem up`` itself, each ingress replica).
"""

from __future__ import annotations

from cluster.engine.request_limits import quote
from cluster.kv_transfer.transport import KVTransport, TransportError

TORCH_DISTRIBUTED = "torch_distributed"  # the built-in transport's name (TorchDistributedTransport.name)

_TRANSPORTS: dict[str, type[KVTransport]] = {}


def register_transport(cls: type[KVTransport]) -> type[KVTransport]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _TRANSPORTS[cls.name] = cls
    return cls


def check_transport(name: str) -> None:
    """TransportError naming the known transports if none is registered under ``name``."""
    known = {TORCH_DISTRIBUTED, *_TRANSPORTS}
    if name not in known:
        raise TransportError(f"unknown KV transport {quote(name)}; known: {', '.join(sorted(known))}")


def transport_class(name: str) -> type[KVTransport]:
    """The transport registered under ``name``; TransportError naming the known ones if none."""
    check_transport(name)
    if name not in _TRANSPORTS:
        from cluster.kv_transfer.torch_transport import TorchDistributedTransport

        register_transport(TorchDistributedTransport)
    return _TRANSPORTS[name]


def create_transport(name: str, **options) -> KVTransport:
    return transport_class(name)(**options)
