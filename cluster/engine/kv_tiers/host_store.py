"""The host tier's KV bytes, and the copies between it and the device cache.

A slot holds one block of every layer's keys and values, contiguous:
``[slots, layers, 2, block_size, kv_heads, row_width]`` against the device cache's
``[layers, 2, blocks, block_size, kv_heads, row_width]``. Its format is the device cache's,
except on a CPU whose cache holds the model's (16- or 32-bit) dtype: there the host tier is a
second pool in the same RAM, worth having only compressed, so its rows are 8-bit
(:mod:`cluster.engine.quantization.kv_format`'s ``int8``: codes and a float32 scale per token
and KV head). A block that went through such a tier comes back with each value within half a
code step (``amax / 254`` of its row) of what it was. On CUDA the host tensor is pinned.

What is synchronous: every copy. The engine makes a step's copies after scheduling and before
the forward (``apply``), so a hit costs the step those copies and nothing else; on the 2-core CPU
this was written on, a block of the test model (2 layers, 2 KV heads of 16, 16 tokens) took
about 10 µs each way and one of the default model about 0.1 ms (``EngineStats.host_copy_seconds``
counts them). Nothing is copied while a forward runs yet: on CUDA, copies on a side stream and a
layer-by-layer load are left to do.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cluster.engine.kv_tiers.host_pool import Offload, TierMove
from cluster.engine.quantization.kv_format import KVCacheFormat


def host_format(device_format: KVCacheFormat, device_type: str) -> KVCacheFormat:
    """The host tier's format: 8-bit on a CPU whose cache is wider, the device's otherwise."""
    wide = not device_format.quantized and torch.empty((), dtype=device_format.dtype).element_size() > 1
    return KVCacheFormat("int8", device_format.dtype) if device_type == "cpu" and wide else device_format


def host_block_bytes(fmt: KVCacheFormat, num_layers: int, block_size: int, kv_heads: int, head_dim: int) -> int:
    return 2 * num_layers * block_size * kv_heads * fmt.row_bytes(head_dim)


class HostKVStore:
    def __init__(self, kv_cache: torch.Tensor, device_format: KVCacheFormat, fmt: KVCacheFormat, num_slots: int,
                 head_dim: int):
        """``kv_cache``: the device cache (the runner's), which ``apply`` reads and writes."""
        layers, two, _, block_size, heads, _ = kv_cache.shape
        self.kv_cache = kv_cache
        self.device_format = device_format
        self.format = fmt
        pin = kv_cache.device.type == "cuda"
        self.slots = torch.zeros((num_slots, layers, two, block_size, heads, fmt.row_width(head_dim)),
                                 dtype=fmt.storage_dtype, pin_memory=pin)

    @property
    def converts(self) -> bool:
        return self.format != self.device_format

    @torch.inference_mode()
    def apply(self, moves: Sequence[TierMove]) -> None:
        """Makes the copies in order (a slot or block written by one move is read by a later one
        as written)."""
        for move in moves:
            if isinstance(move, Offload):
                block = self.kv_cache[:, :, move.block_id]
                if self.converts:
                    block = self.format.quantize_rows(self.device_format.dequantize_rows(block))
                self.slots[move.slot].copy_(block)
            else:
                rows = self.slots[move.slot].to(self.kv_cache.device, non_blocking=True)
                if self.converts:
                    rows = self.device_format.quantize_rows(self.format.dequantize_rows(rows))
                self.kv_cache[:, :, move.block_id].copy_(rows)
