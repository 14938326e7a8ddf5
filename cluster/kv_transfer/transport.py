"""The interface every KV transport implements (``transports.py`` picks one by name).

A transport moves tensors between this process and the ranks of one peer group; the workers
only call ``send``/``recv`` and wait on what they return, so another transport (an RDMA
library, shared memory) plugs in by registering a class under a new name, without touching
the workers. Configuration names the transport (``kv_transport: torch_distributed``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


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
