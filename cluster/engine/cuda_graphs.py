"""Decode steps replayed as CUDA graphs.

Launched from Python, a decode step spends more time launching its hundreds of kernels than the
GPU spends running them at small batches. A CUDA graph records a step's launches once and
replays them with one call. A graph fixes the addresses and shapes of everything it touches, so:

- graphs are captured for a set of batch sizes (:func:`capture_sizes`); a step of ``n``
  requests replays the smallest size ``>= n``, its padding rows reading token 0 at position 0,
  writing no KV (slot -1) and attending to no keys (length 0);
- the step's inputs and attention metadata live in persistent device buffers
  (:class:`DecodeBuffers`) that each step overwrites in place before the replay;
- the decode attention's split count is fixed per size, chosen for any context length.

Only decode-only steps without per-layer hooks (KV streaming) replay; every other step runs
eagerly, as does everything with ``enforce_eager``. The graph ends at the decoder's final norm:
logits and sampling run after it, on the rows that exist.

On a CPU (Triton's interpreter, in tests) nothing is captured: the same buffers, padding and
metadata then run eagerly, so everything but the capture itself is tested without a GPU.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

from cluster.engine.fused_inputs import padded_rows, upload
from cluster.engine.kernels.triton_support import choose_decode_splits, device_sm_count
from cluster.engine.models.attention import AttentionMetadata, FusedMetadata
from cluster.engine.models.decoder import CausalLM

LARGEST_CAPTURED_BATCH = 512


def capture_sizes(max_num_seqs: int, largest: int = LARGEST_CAPTURED_BATCH) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to ``max_num_seqs`` (itself included), at most ``largest``."""
    top = min(max_num_seqs, largest)
    sizes = {s for s in (1, 2, 4) if s < top} | set(range(8, top, 8)) | {top}
    return tuple(sorted(sizes))


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (sorted) that holds ``num_seqs`` rows, or None when none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def padded_decode_values(input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                         seq_lens: Sequence[int], block_table: Sequence[Sequence[int]],
                         bucket: int) -> tuple[list[int], int]:
    """One flat list for :meth:`DecodeBuffers.fill`: token ids, positions, slots and lengths, each
    padded to ``bucket`` rows (0, 0, -1 and 0), then the real rows' block table; and its width."""
    pad = bucket - len(seq_lens)
    if pad < 0:
        raise ValueError(f"{len(seq_lens)} decodes do not fit a batch of {bucket}")
    table, width = padded_rows(block_table)
    values = [*input_ids, *[0] * pad, *positions, *[0] * pad, *slots, *[-1] * pad, *seq_lens, *[0] * pad, *table]
    return values, width


class DecodeBuffers:
    """The persistent inputs of every captured decode graph, sized for the largest one."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device):
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int64, device=device)

    def fill(self, input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
             seq_lens: Sequence[int], block_table: Sequence[Sequence[int]], bucket: int) -> None:
        """Writes a step's decodes into the first ``bucket`` rows: one host-to-device copy, then
        copies on the device. Block-table entries past a row's length are never read."""
        values, width = padded_decode_values(input_ids, positions, slots, seq_lens, block_table, bucket)
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a decode needs {width} blocks; the graphs hold {self.max_blocks_per_seq} per request")
        staged = upload(values, self.device)
        rows = len(seq_lens)
        for index, target in enumerate((self.input_ids, self.positions, self.slot_mapping, self.seq_lens)):
            target[:bucket].copy_(staged[index * bucket : (index + 1) * bucket], non_blocking=True)
        self.block_table[:rows, :width].copy_(staged[4 * bucket :].view(rows, width), non_blocking=True)

    def metadata(self, bucket: int, decode_splits: int) -> AttentionMetadata:
        """Attention metadata over the first ``bucket`` rows of the buffers (views: it stays valid)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decodes=bucket,
            fused=FusedMetadata(
                decode_seq_lens=self.seq_lens[:bucket],
                decode_block_table=self.block_table[:bucket],
                decode_splits=decode_splits,
            ),
        )


class DecodeGraphs:
    """One captured decode step per batch size, sharing one memory pool and one set of buffers."""

    def __init__(self, model: CausalLM, sizes: Sequence[int], max_blocks_per_seq: int, num_kv_heads: int,
                 device: torch.device, capture: bool | None = None):
        self.model = model
        self.sizes = tuple(sorted(sizes))
        self.device = device
        self.capture_graphs = device.type == "cuda" if capture is None else capture
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks_per_seq, device)
        sms = device_sm_count(device)
        self.metas = {b: self.buffers.metadata(b, choose_decode_splits(b, num_kv_heads, sms)) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket_for(self, num_seqs: int) -> int | None:
        return bucket_for(num_seqs, self.sizes)

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(self.buffers.input_ids[:bucket], self.buffers.positions[:bucket], self.metas[bucket])

    @torch.inference_mode()
    def capture(self) -> None:
        """Records a graph per size, largest first (the smaller ones then reuse its memory). Each
        is run once before its capture, which compiles its kernels and sets up cuBLAS."""
        if not self.capture_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.sizes):
            self._forward(bucket)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            seq_lens: Sequence[int], block_table: Sequence[Sequence[int]]) -> torch.Tensor:
        """The decoder's output (final hidden states) for these decodes: [len(seq_lens), hidden]."""
        rows = len(seq_lens)
        bucket = self.bucket_for(rows)
        if bucket is None:
            raise ValueError(f"{rows} decodes exceed the largest captured batch ({self.sizes[-1]})")
        self.buffers.fill(input_ids, positions, slots, seq_lens, block_table, bucket)
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:rows]
        graph.replay()
        return self.outputs[bucket][:rows]
