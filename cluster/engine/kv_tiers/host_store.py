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
the forward (``apply``, a run of offloads or of loads as one gather and one scatter), so a step
pays for its evictions and its host hits before its forward, and nothing else waits. Measured on
this 2-core shared CPU, 64 blocks at a time, float32 device cache to 8-bit host rows: the test
model (2 layers, 8 KiB blocks) 6.7 µs a block to offload and 3.5 µs to load; the default model
(SmolLM2-135M, 30 layers, 720 KiB blocks) 6.6-9.1 ms to offload and 2.3-3.3 ms to load, the 8-bit
conversion most of it (``EngineStats.host_copy_seconds`` counts them in a running engine). Not
done yet: copies off the step's critical path (a side CUDA stream, or a thread on a CPU, while
other requests' steps run) and loading layer by layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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


@dataclass
class CopyTally:
    """Blocks copied each way and the seconds the copies took (on CUDA, to the copies' end)."""

    offloaded: int = 0
    offload_seconds: float = 0.0
    loaded: int = 0
    load_seconds: float = 0.0


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
        self.tally = CopyTally()

    @property
    def converts(self) -> bool:
        return self.format != self.device_format

    @torch.inference_mode()
    def apply(self, moves: Sequence[TierMove]) -> None:
        """Makes the copies as if one by one in order; a run of moves of one kind is made as one
        gather and one scatter (a slot or block written twice in a run keeps its last write, as in
        order: no move of the run reads what another writes)."""
        start = 0
        while start < len(moves):
            kind = type(moves[start])
            end = start
            while end < len(moves) and type(moves[end]) is kind:
                end += 1
            started = time.perf_counter()
            if kind is Offload:
                last = {move.slot: move.block_id for move in moves[start:end]}
                self._offload(list(last.values()), list(last))
            else:
                last = {move.block_id: move.slot for move in moves[start:end]}
                self._load(list(last.values()), list(last))
            if self.kv_cache.is_cuda:
                torch.cuda.current_stream(self.kv_cache.device).synchronize()
            seconds = time.perf_counter() - started
            if kind is Offload:
                self.tally.offloaded += len(last)
                self.tally.offload_seconds += seconds
            else:
                self.tally.loaded += len(last)
                self.tally.load_seconds += seconds
            start = end

    def _offload(self, block_ids: list[int], slots: list[int]) -> None:
        blocks = self.kv_cache[:, :, block_ids].movedim(2, 0)  # [n, layers, 2, block, heads, row]
        if self.converts:
            blocks = self.format.quantize_rows(self.device_format.dequantize_rows(blocks))
        self.slots.index_copy_(0, torch.tensor(slots), blocks.to("cpu"))

    def _load(self, slots: list[int], block_ids: list[int]) -> None:
        rows = self.slots[slots].to(self.kv_cache.device, non_blocking=True)
        if self.converts:
            rows = self.device_format.quantize_rows(self.format.dequantize_rows(rows))
        index = torch.tensor(block_ids, device=self.kv_cache.device)
        self.kv_cache.index_copy_(2, index, rows.movedim(0, 2))
