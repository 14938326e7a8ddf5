"""A step plan's integers as the device tensors the fused (Triton) attention path reads.

Every integer of the step (token ids, positions, cache slots, rows to sample, the decode and
prompt-chunk layouts) goes into one int64 host tensor and crosses to the device in one copy;
on CUDA it is staged in pinned memory and copied without blocking, so the host goes on (to
launch the forward pass, to build the sampling batch) while the copy runs. Each section starts
on a 16-byte boundary, as a tensor of its own would: Triton compiles a kernel for
each alignment of its pointer arguments, so unaligned views would cost extra compilations
(in the middle of serving) and narrower loads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from cluster.engine.models.attention import FusedMetadata

ALIGN_ELEMENTS = 2  # int64 elements in 16 bytes


def upload(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as one int64 tensor on ``device``; on CUDA a non-blocking copy from pinned memory
    (the pinned block stays reserved until the copy is done: torch's host allocator tracks it)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.int64, device=device)


def padded_rows(rows: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Rows right-padded with 0 to the widest (at least 1), flattened; and that width."""
    width = max((len(r) for r in rows), default=0) or 1
    flat = list(itertools.chain.from_iterable(list(r) + [0] * (width - len(r)) for r in rows))
    return flat, width


@dataclass
class FusedStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    sample_rows: torch.Tensor
    fused: FusedMetadata


def build_fused_step(
    input_ids: Sequence[int],
    positions: Sequence[int],
    slots: Sequence[int],
    sample_rows: Sequence[int],
    decode_lens: Sequence[int],
    decode_block_table: Sequence[Sequence[int]],
    prefill_chunks: Sequence[tuple[int, int, int, Sequence[int]]],
    decode_splits: int,
    device: torch.device,
) -> FusedStep:
    """``prefill_chunks`` holds (first row in the step, rows, context length, block ids) per
    chunk, in step order after the decodes."""
    decodes, chunks = len(decode_lens), len(prefill_chunks)
    decode_table, decode_width = padded_rows(decode_block_table)
    starts = [start for start, _, _, _ in prefill_chunks]
    if prefill_chunks:
        last_start, last_len, _, _ = prefill_chunks[-1]
        starts.append(last_start + last_len)
    prefill_table, prefill_width = padded_rows([blocks for _, _, _, blocks in prefill_chunks])
    sections = [
        ("input_ids", input_ids, None),
        ("positions", positions, None),
        ("slots", slots, None),
        ("sample_rows", sample_rows, None),
        ("decode_lens", decode_lens, None),
        ("decode_table", decode_table if decodes else [], (decodes, decode_width)),
        ("starts", starts, None),
        ("context_lens", [context for _, _, context, _ in prefill_chunks], None),
        ("prefill_table", prefill_table if chunks else [], (chunks, prefill_width)),
    ]
    flat: list[int] = []
    offsets = []
    for _, values, _ in sections:
        offsets.append(len(flat))
        flat.extend(values)
        flat.extend([0] * (-len(flat) % ALIGN_ELEMENTS))
    device_flat = upload(flat, device)
    views: dict[str, torch.Tensor] = {}
    for (name, values, shape), offset in zip(sections, offsets):
        view = device_flat[offset : offset + len(values)]
        views[name] = view.view(shape) if shape is not None else view
    fused = FusedMetadata(
        decode_seq_lens=views["decode_lens"],
        decode_block_table=views["decode_table"],
        decode_splits=decode_splits,
    )
    if chunks:
        fused.prefill_query_starts = views["starts"]
        fused.prefill_context_lens = views["context_lens"]
        fused.prefill_block_table = views["prefill_table"]
        fused.prefill_max_query_len = max(rows for _, rows, _, _ in prefill_chunks)
    return FusedStep(views["input_ids"], views["positions"], views["slots"], views["sample_rows"], fused)
