"""Attention over a paged KV cache: the plain-torch reference, and the fused (Triton) path.

A step's tokens are flattened: first one token for each decoding request, then the prompt
chunks. New keys and values are written into their cache slots.

When the step's metadata carries :class:`FusedMetadata` (the Triton backend, chosen on CUDA),
three kernels do the whole layer: one writes the new keys and values, one attends every decode
and one every prompt chunk, each reading the cache in place through the block table
(:mod:`cluster.engine.kernels.triton_attention`); an 8-bit cache (``kv_format``) is quantized as
it is written and read as it is stored, codes and scales dequantized in registers. Otherwise the
plain-torch path below runs, which is the reference the kernels are tested against: it quantizes
and dequantizes 8-bit rows with torch (:mod:`cluster.engine.quantization.kv_format`), on any device.

Decodes use the native kernel (:mod:`cluster.engine.kernels`) when it fits: it reads keys and
values in place through the block table, once each. Otherwise each decode gathers only its own
blocks and attends with two small matmuls: on a CPU this is several times faster than padding
every request to the longest context in one batched call, whose large fresh buffers cost more
than the arithmetic. Each prompt chunk attends either to itself alone (a fresh prompt: causal
attention on the new keys, no gather) or to its cached context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.kernels import native_kernels_enabled
from cluster.engine.kernels.paged_attention import native_decode_attention
from cluster.engine.quantization.kv_format import KVCacheFormat


@dataclass
class PrefillSpan:
    """One prompt chunk: ``query_len`` new tokens at ``query_start`` in the flattened step,
    whose context (cached tokens plus the chunk) is ``context_len`` long."""

    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def fresh(self) -> bool:
        return self.context_len == self.query_len


@dataclass
class FusedMetadata:
    """What the fused kernels read: device tensors only (int64), so that a CUDA graph can hold
    them in persistent buffers. Decodes are rows 0..num_decodes-1 of the step; prompt chunk
    ``c`` is rows ``prefill_query_starts[c]:prefill_query_starts[c + 1]``."""

    decode_seq_lens: torch.Tensor  # [D] keys each decode attends to (its new one included); 0 = padding row
    decode_block_table: torch.Tensor  # [D, W]
    decode_splits: int = 1  # parts each decode context is split into (see choose_decode_splits)
    prefill_query_starts: torch.Tensor | None = None  # [C + 1]
    prefill_context_lens: torch.Tensor | None = None  # [C]
    prefill_block_table: torch.Tensor | None = None  # [C, W]
    prefill_max_query_len: int = 0


@cache
def _fused_kernels():
    """The Triton kernels, imported on first use (Triton is optional)."""
    from cluster.engine.kernels import triton_attention

    return triton_attention


@dataclass
class AttentionMetadata:
    """``decode_block_table`` is [num_decodes, most blocks] (int64, padded with block 0);
    ``decode_lens`` holds ``decode_context_lens`` as an int64 tensor on the CPU.
    ``after_layer(i)`` runs once layer ``i`` has written this step's keys and values (KV
    streaming sends that layer while later layers compute). With ``fused`` set, the fused
    kernels run and the torch path's fields (decode and prefill layouts) are left empty."""

    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_block_table: torch.Tensor | None = None
    decode_context_lens: list[int] = field(default_factory=list)
    decode_lens: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    after_layer: Callable[[int], None] | None = None
    fused: FusedMetadata | None = None


def visible_keys(query_positions: torch.Tensor, context_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask [queries, context_len]: key j is visible to a query at position p when
    j <= p (and p - j < window)."""
    keys = torch.arange(context_len)
    mask = keys[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        mask &= keys[None, :] > query_positions[:, None] - sliding_window
    return mask


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_format: KVCacheFormat | None = None  # set with the cache; None or "auto": rows in the model's dtype

    def _cache_rows(self, x: torch.Tensor) -> torch.Tensor:
        fmt = self.kv_format
        return fmt.quantize_rows(x) if fmt is not None else x

    def _read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        fmt = self.kv_format
        return fmt.dequantize_rows(rows) if fmt is not None else rows

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads, D]; k, v: [T, kv_heads, D]. Returns [T, heads * D]."""
        if meta.fused is not None:
            return self._forward_fused(q, k, v, meta)
        num_tokens = q.shape[0]
        kv, d, width = self.num_kv_heads, self.head_dim, self.k_cache.shape[-1]
        num_blocks = self.k_cache.shape[0]
        k_rows, v_rows = self._cache_rows(k), self._cache_rows(v)
        self.k_cache.view(-1, kv, width).index_copy_(0, meta.slot_mapping, k_rows)
        self.v_cache.view(-1, kv, width).index_copy_(0, meta.slot_mapping, v_rows)
        if self.kv_format is not None:  # fresh prompts attend to their keys as the cache holds them, as the kernels do
            k, v = self._read_rows(k_rows), self._read_rows(v_rows)
        out = q.new_empty(num_tokens, self.num_heads * d)

        if meta.num_decodes:
            self._decode(q, out, meta)

        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            span_q = q[rows].transpose(0, 1).unsqueeze(0)
            if span.fresh and span.mask is None:
                keys, values = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(span_q, keys, values, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                if span.fresh:
                    keys, values = k[rows], v[rows]
                else:
                    keys = self._gathered(self.k_cache, num_blocks, span.block_ids, 0, span.context_len)
                    values = self._gathered(self.v_cache, num_blocks, span.block_ids, 0, span.context_len)
                o = F.scaled_dot_product_attention(
                    span_q, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
                    attn_mask=span.mask, scale=self.scale, enable_gqa=True,
                )
            out[rows] = o.squeeze(0).transpose(0, 1).reshape(span.query_len, self.num_heads * d)
        return out

    def _forward_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        kernels, fused, fmt = _fused_kernels(), meta.fused, self.kv_format
        kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, fmt)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if meta.num_decodes:
            kernels.paged_decode(q[: meta.num_decodes], self.k_cache, self.v_cache, fused.decode_block_table,
                                 fused.decode_seq_lens, out, self.scale, self.sliding_window, fused.decode_splits, fmt)
        if fused.prefill_max_query_len:
            kernels.paged_prefill(q, self.k_cache, self.v_cache, fused.prefill_block_table, fused.prefill_query_starts,
                                  fused.prefill_context_lens, fused.prefill_max_query_len, out, self.scale,
                                  self.sliding_window, fmt)
        return out

    def _decode(self, q: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata) -> None:
        kernel = native_decode_attention() if native_kernels_enabled() else None
        if kernel is not None and kernel.supports(q, self.k_cache, out, self.kv_format):
            kernel(q, self.k_cache, self.v_cache, meta.decode_block_table, meta.decode_lens, out,
                   self.num_kv_heads, self.sliding_window, self.scale, self.kv_format)
            return
        kv, d = self.num_kv_heads, self.head_dim
        num_blocks = self.k_cache.shape[0]
        block_size = self.k_cache.shape[1]
        window = self.sliding_window
        for row, length in enumerate(meta.decode_context_lens):
            block_ids = meta.decode_block_table[row, : -(-length // block_size)]
            first = length - window if window is not None and length > window else 0
            keys = self._gathered(self.k_cache, num_blocks, block_ids, first, length)
            values = self._gathered(self.v_cache, num_blocks, block_ids, first, length)
            scores = torch.bmm(q[row].view(kv, self.group, d), keys.permute(1, 2, 0)) * self.scale
            weights = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
            out[row] = torch.bmm(weights, values.transpose(0, 1)).view(-1)

    def _gathered(self, cache: torch.Tensor, num_blocks: int, block_ids: torch.Tensor, first: int,
                  length: int) -> torch.Tensor:
        """Tokens [first, length) of the blocks ``block_ids``, [tokens, kv_heads, head_dim] in the model's dtype."""
        rows = cache.view(num_blocks, -1).index_select(0, block_ids).view(-1, self.num_kv_heads, cache.shape[-1])
        return self._read_rows(rows[first:length])
