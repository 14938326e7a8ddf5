"""KV transport over ``torch.distributed`` point-to-point sends: gloo on CPUs, NCCL on GPUs.

The transfer group holds the prefill ranks and the decode ranks of one pairing, with its own
rendezvous port derived from the cluster name (see :mod:`cluster.parallel.naming`).
"""

from __future__ import annotations

from datetime import timedelta

import torch

from cluster.kv_transfer.transport import KVTransport, TransportError
from cluster.parallel.group import GroupSpec, join_group


class _Work:
    def __init__(self, work, what: str):
        self._work, self._what = work, what

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            if timeout_s is None:
                self._work.wait()
            else:
                self._work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise TransportError(f"{self._what} failed: {exc}") from exc

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _post(start, what: str):
    try:
        return start()
    except RuntimeError as exc:
        raise TransportError(f"{what} failed: {exc}") from exc


class TorchDistributedTransport(KVTransport):
    name = "torch_distributed"

    def __init__(self, spec: GroupSpec, rank: int, device: str = "cpu", local_addr: str | None = None):
        self._group = join_group(spec, rank, torch.device(device), local_addr)
        self._pg = self._group.process_group

    @property
    def rank(self) -> int:
        return self._group.rank

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _Work:
        what = f"send of {tensor.numel() * tensor.element_size()} bytes to rank {peer}"
        return _Work(_post(lambda: self._pg.send([tensor], peer, tag), what), what)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _Work:
        what = f"receive of {tensor.numel() * tensor.element_size()} bytes from rank {peer}"
        return _Work(_post(lambda: self._pg.recv([tensor], peer, tag), what), what)

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
