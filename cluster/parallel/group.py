"""Creating a tensor-parallel process group: gloo between CPU ranks, NCCL between GPU ranks.

Groups are standalone process-group objects, not the process-global default group, so one
process can belong to several (its tensor-parallel group, and later the groups through which
it sends KV caches) without a world that spans the whole cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cluster.engine.models.layers import ParallelGroup
from cluster.parallel.naming import group_id, group_port


class GroupSetupError(RuntimeError):
    pass


@dataclass(frozen=True)
class GroupSpec:
    """Everything a rank needs to join a group; the rendezvous runs on rank 0's host
    (``master_addr``: a KV pair's is its prefill worker's node)."""

    cluster: str
    name: str
    size: int
    master_addr: str = "127.0.0.1"
    port: int | None = None
    timeout_s: float = 120.0

    @property
    def rendezvous_port(self) -> int:
        return self.port or group_port(self.cluster, self.name)


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (127.0.0.1 towards loopback): where a
    rank of a group whose rendezvous is on ``host`` can be reached by the others. No packet is sent."""
    import socket

    try:
        family = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def join_group(spec: GroupSpec, rank: int, device: torch.device, local_addr: str | None = None) -> ParallelGroup:
    """Blocks until all ``spec.size`` ranks have joined; returns this rank's ``ParallelGroup``.
    ``local_addr`` (gloo's): where the other ranks reach this one; by default the address on the
    route to the rendezvous host (a pair's ranks are on two nodes)."""
    if not 0 <= rank < spec.size:
        raise GroupSetupError(f"rank {rank} is outside a group of {spec.size}")
    if spec.size == 1:
        return ParallelGroup()
    timeout = timedelta(seconds=spec.timeout_s)
    name, port = group_id(spec.cluster, spec.name), spec.rendezvous_port
    try:
        store = dist.TCPStore(spec.master_addr, port, world_size=spec.size, is_master=rank == 0, timeout=timeout)
    except (RuntimeError, dist.DistNetworkError) as exc:
        raise GroupSetupError(
            f"group {name}: rank {rank} could not {'open' if rank == 0 else 'reach'} the rendezvous at "
            f"{spec.master_addr}:{port} ({exc}); if another program holds that port, give the cluster another name"
        ) from exc
    store = dist.PrefixStore(name, store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, spec.size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_addr or address_towards(spec.master_addr))]
        group = dist.ProcessGroupGloo(store, rank, spec.size, options)
    return ParallelGroup(rank=rank, size=spec.size, process_group=group)
