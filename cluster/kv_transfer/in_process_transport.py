"""A KV transport between engines in one process (``in_process``): each message
is a copy handed through a mailbox shared by the group's ranks, keyed by (sender, receiver,
tag). Tests and benchmarks that step several engines in one process use it where
``torch_distributed`` would need a process per rank; the engines' transfer code (senders,
receivers, their records and deadlines) is the same. It is registered by those who use it
(``register_transport(InProcessTransport)``), never offered to a topology: ranks in separate
processes would wait on separate mailboxes.
"""

from __future__ import annotations

import threading
import time

import torch

from cluster.kv_transfer.transport import KVTransport, TransportError
from cluster.parallel.group import GroupSpec

_MAILBOXES: dict[tuple[str, str], "_Mailbox"] = {}
_MAILBOXES_LOCK = threading.Lock()


class _Mailbox:
    def __init__(self):
        self.messages: dict[tuple[int, int, int], torch.Tensor] = {}
        self.arrived = threading.Condition()


class _Done:
    def wait(self, timeout_s: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _Receive:
    def __init__(self, box: _Mailbox, key: tuple[int, int, int], into: torch.Tensor):
        self.box, self.key, self.into = box, key, into
        self._done = False

    def wait(self, timeout_s: float | None = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.box.arrived:
            while self.key not in self.box.messages:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportError(f"receive from rank {self.key[0]} (tag {self.key[2]}) timed out")
                self.box.arrived.wait(left)
            message = self.box.messages.pop(self.key)
        self.into.copy_(message.view_as(self.into))
        self._done = True

    def is_completed(self) -> bool:
        return self._done


class InProcessTransport(KVTransport):
    name = "in_process"

    def __init__(self, spec: GroupSpec, rank: int, device: str = "cpu", local_addr: str | None = None):
        self._rank = rank
        with _MAILBOXES_LOCK:
            self._box = _MAILBOXES.setdefault((spec.cluster, spec.name), _Mailbox())

    @property
    def rank(self) -> int:
        return self._rank

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _Done:
        with self._box.arrived:
            self._box.messages[(self._rank, peer, tag)] = tensor.detach().clone()
            self._box.arrived.notify_all()
        return _Done()

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _Receive:
        return _Receive(self._box, (peer, self._rank, tag), tensor)
