"""Copying one layer's KV of some blocks (and some heads) out of a paged cache and back in.

The cache is ``[layers, 2, blocks, block_size, kv_heads, head_dim]``. A message is the
contiguous ``[2, len(block_ids), block_size, num_heads, head_dim]`` slice of one layer, which
is what a transport can move in one send; the receiver writes it into its own block ids and
head range.
"""

from __future__ import annotations

import torch


def layer_message_shape(kv_cache: torch.Tensor, num_blocks: int, num_heads: int) -> tuple[int, ...]:
    _, two, _, block_size, _, head_dim = kv_cache.shape
    return (two, num_blocks, block_size, num_heads, head_dim)


def pack_layer(kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor, first_head: int, num_heads: int) -> torch.Tensor:
    blocks = kv_cache[layer].index_select(1, block_ids)
    if num_heads == kv_cache.shape[4]:
        return blocks
    return blocks.narrow(3, first_head, num_heads).contiguous()


def unpack_layer(kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor, first_head: int,
                 message: torch.Tensor) -> None:
    target = kv_cache[layer]
    if message.shape[3] == target.shape[3]:
        target.index_copy_(1, block_ids, message)
    else:
        target.narrow(3, first_head, message.shape[3]).index_copy_(1, block_ids, message)
