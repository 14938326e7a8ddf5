"""The host tier's KV bytes, and the copies between it and the device cache.

A slot holds one block of every layer's keys and values, contiguous:
``[slots, layers, 2, block_size, kv_heads, row_width]`` against the device cache's
``[layers, 2, blocks, block_size, kv_heads, row_width]``. Its format is the device cache's,
except on a CPU whose cache holds the model's (16- or 32-bit) dtype: there the host tier is a
second pool in the same RAM, worth having only compressed, so its rows are 8-bit
(:mod:`cluster.engine.quantization.kv_format`'s ``int8``: codes and a float32 scale per token
and KV head). A block that went through such a tier comes back with each value within half a
code step (``amax / 254`` of its row) of what it was. On CUDA the host tensor is pinned.

What runs where. Offloads (``offload``: one gather, one scatter) are made ahead of eviction by a
background thread (write-back, :mod:`~cluster.engine.kv_tiers.copy_queue`), and by the engine's
thread before a forward only for an evicted block that was not written back. Loads (``load``) are
made by a second background thread (the load copier, on one torch thread) layer by layer, layer 0
first, each layer one gather of its rows from the slots (with the 8-bit conversion) and one scatter
into the cache: on CUDA on a side stream from a pinned staging buffer, an event recorded after each
layer, the job done once the last has passed. Meanwhile the request that hit the host tier waits
in the queue holding its blocks, and the other requests' steps run (``RequestStatus.LOADING``;
the block manager's and scheduler's rules keep everyone else off the blocks being loaded). Not
done yet: a forward that starts a loading request's attention at layer ``l`` once layer ``l`` is
in (the per-layer events are where it would wait), rather than after the whole load.

Measured on this 2-core CPU, shared with other agents (load 0.7-3.9, which the figures follow),
64 blocks at a time, float32 device cache to 8-bit host rows, the default model's blocks
(SmolLM2-135M, 30 layers, 720 KiB; ``benchmarks/host_copies.py``): 1.0-9.5 ms a block to offload,
the 8-bit conversion most of it; a load 0.11-0.12 ms a block layer by layer on one thread (0.07 at
load 0.7 on two; the one gather and scatter over all layers it replaced took 0.48-0.59 ms in the
same minutes: a layer's rows stay in the CPU's caches), and 0.24-0.47 ms from queued to made
through the copier while the caller's thread computed (load 2.1-2.4). In ``benchmarks/kv_tiers_engine.py`` (the random
30M Llama, two engines, 540-650 blocks loaded a run) the copies on the steps' path went from
38-59 ms a run to 1-11 ms (offloads not written back ahead, waits for write-backs, a peer pull's
loads), the loads' 45-58 ms moving off it. ``EngineStats.host_copy_seconds`` counts the former in a
running engine, ``EngineStats.host_load_seconds`` the loads' waits.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from cluster.engine.kv_tiers.host_pool import Load, Offload
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
        """``kv_cache``: the device cache (the runner's), which ``offload`` reads and ``load`` writes."""
        layers, two, _, block_size, heads, _ = kv_cache.shape
        self.kv_cache = kv_cache
        self.device_format = device_format
        self.format = fmt
        pin = kv_cache.device.type == "cuda"
        self.slots = torch.zeros((num_slots, layers, two, block_size, heads, fmt.row_width(head_dim)),
                                 dtype=fmt.storage_dtype, pin_memory=pin)
        self._load_stream = torch.cuda.Stream(kv_cache.device) if pin else None
        # Called with each layer's index once its copies are issued (on CUDA, with its event):
        # where a later design would let that layer's attention start. Tests slow loads with it.
        self.layer_issued: Callable[[int], None] | None = None

    @property
    def converts(self) -> bool:
        return self.format != self.device_format

    @property
    def num_layers(self) -> int:
        return self.kv_cache.shape[0]

    @torch.inference_mode()
    def offload(self, moves: Sequence[Offload]) -> None:
        """Copies device blocks into host slots as one gather and one scatter (a slot written
        twice keeps its last write, as in order); on CUDA, returns once they are made."""
        last = {move.slot: move.block_id for move in moves}
        block_ids, slots = list(last.values()), list(last)
        blocks = self.kv_cache[:, :, block_ids].movedim(2, 0)  # [n, layers, 2, block, heads, row]
        if self.converts:
            blocks = self.format.quantize_rows(self.device_format.dequantize_rows(blocks))
        self.slots.index_copy_(0, torch.tensor(slots), blocks.to("cpu"))
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

    @torch.inference_mode()
    def load(self, moves: Sequence[Load]) -> None:
        """Copies host slots into device blocks layer by layer, layer 0 first: each layer is
        one gather of its rows from the slots and one scatter into the blocks. On CUDA the
        copies run on a side stream (from a pinned staging buffer, so each is a DMA that overlaps
        the default stream's forwards) with an event recorded per layer, and this returns once
        the last layer's event has passed; on a CPU they run in the caller's thread (the load
        queue's: torch releases the GIL in its copy kernels). A block loaded twice keeps its last."""
        last = {move.block_id: move.slot for move in moves}
        device = self.kv_cache.device
        source = torch.tensor(list(last.values()))
        if self._load_stream is None:
            self._load_layers(source, torch.tensor(list(last)), None)
            return
        with torch.cuda.stream(self._load_stream):
            events = self._load_layers(source, torch.tensor(list(last), device=device), self._load_stream)
        events[-1].synchronize()

    def _load_layers(self, source: torch.Tensor, index: torch.Tensor, stream) -> list:
        events = []
        shape = (len(source), *self.slots.shape[2:])  # [n, 2, block, heads, row]
        for layer in range(self.num_layers):
            rows = torch.empty(shape, dtype=self.slots.dtype, pin_memory=stream is not None)
            torch.index_select(self.slots[:, layer], 0, source, out=rows)
            if stream is not None:  # the staging buffer is not reused before this copy is done (torch's
                rows = rows.to(self.kv_cache.device, non_blocking=True)  # pinned allocator waits on it)
            if self.converts:
                rows = self.device_format.quantize_rows(self.format.dequantize_rows(rows))
            self.kv_cache[layer].index_copy_(1, index, rows.movedim(0, 1))
            if stream is not None:
                events.append(stream.record_event())
            if self.layer_issued is not None:
                self.layer_issued(layer)
        return events
