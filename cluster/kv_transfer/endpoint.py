"""The receiving end of KV transfers in a process of its own (a Ray actor): a paged cache of
its own, and layers received straight into the blocks it names.

Decode workers embed the same steps; the transport tests and ``benchmarks/kv_transfer.py`` use
this endpoint as the far side of a real two-process transfer.
"""

from __future__ import annotations

import time

import torch

from cluster.kv_transfer.kv_blocks import layer_message_shape, unpack_layer
from cluster.kv_transfer.sender import layer_tag
from cluster.kv_transfer.transports import create_transport
from cluster.parallel.group import GroupSpec


class KVEndpoint:
    def __init__(self, transport: str, spec: GroupSpec, rank: int, cache_shape: tuple[int, ...],
                 dtype: torch.dtype = torch.float32):
        torch.set_num_threads(1)
        self.transport = create_transport(transport, spec=spec, rank=rank)
        self.cache = torch.zeros(cache_shape, dtype=dtype)

    def receive_layers(self, peer: int, block_ids: list[int], first_head: int, num_heads: int,
                       timeout_s: float, tag_base: int = 0) -> float:
        """Posts one receive per layer, then writes each into the cache as it arrives.
        Returns the seconds from posting to the last layer written."""
        ids = torch.tensor(block_ids)
        started = time.perf_counter()
        pending = []
        for layer in range(self.cache.shape[0]):
            buffer = torch.empty(layer_message_shape(self.cache, len(block_ids), num_heads), dtype=self.cache.dtype)
            pending.append((layer, buffer, self.transport.recv(buffer, peer, layer_tag(tag_base, layer))))
        for layer, buffer, work in pending:
            work.wait(timeout_s)
            unpack_layer(self.cache, layer, ids, first_head, buffer)
        return time.perf_counter() - started

    def receive_raw(self, peer: int, numel: int, timeout_s: float, tag: int = 0) -> float:
        """One bare receive of ``numel`` elements (the baseline the transport is measured against)."""
        buffer = torch.empty(numel, dtype=self.cache.dtype)
        started = time.perf_counter()
        self.transport.recv(buffer, peer, tag).wait(timeout_s)
        return time.perf_counter() - started

    def blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.cache[:, :, block_ids].clone()

    def untouched_sum(self, block_ids: list[int]) -> float:
        others = [b for b in range(self.cache.shape[2]) if b not in set(block_ids)]
        return float(self.cache[:, :, others].abs().sum())
