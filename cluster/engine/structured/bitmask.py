"""Packed token masks applied to logits: one gather and one add over the masked rows.

A mask is 32 tokens a word (int32, bit ``k`` of word ``w`` for token ``32 w + k``: llguidance's
layout). Applying it adds 0 or -inf to each logit through a table of every byte's 8 bits, looked
up as an embedding: 0.5 ms for 32 rows of 49,152 tokens on one thread of this CPU, against
1.4 ms indexing the table and 6 ms unpacking bit by bit (shifts, or numpy's unpackbits). The bytes are
read little-endian, as every machine Tandem runs on stores them.
"""

from __future__ import annotations

import torch

BITS = 32

_BYTE_BIASES: dict[torch.device, torch.Tensor] = {}


def _byte_biases(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: 0 where bit ``k`` of byte ``b`` is set, else -inf."""
    table = _BYTE_BIASES.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        table = _BYTE_BIASES[device] = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
    return table


def apply_token_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``logits`` ([B, V] float32) with each masked row's disallowed tokens at -inf (a new
    tensor); ``bitmask`` [C, words] on the logits' device, for ``rows`` (None: every row)."""
    vocab = logits.shape[-1]
    bytes_ = bitmask.view(torch.uint8).long()  # the embedding lookup: 3x faster than indexing the table
    bias = torch.nn.functional.embedding(bytes_, _byte_biases(logits.device)).view(bitmask.shape[0], -1)[:, :vocab]
    if rows is None:
        return logits + bias
    return logits.index_add(0, rows, bias)
