"""Hugging Face quantized checkpoints' tensors repacked into :class:`PackedWeight` layouts, not widened.

W is a linear layer's weight as our layers hold it, [out, in]. The tensors as the checkpoints
ship them (transformers, vLLM, AutoAWQ and GPTQModel read them so):

| quant_method | tensors of one linear layer | layout | how |
|---|---|---|---|
| fp8, compressed-tensors | ``weight`` float8_e4m3fn [out, in]; a float scale per tensor, row, group or block | f8 | codes as stored; each (row, 32-column group) takes its scale |
| awq (GEMM) | ``qweight`` int32 [in, out / 8], nibble i of a word holding column ``AWQ_ORDER[i]`` of its 8; ``qzeros`` int32 [in / g, out / 8], the same order; ``scales`` fp16 [in / g, out] | q4 | ``w = scale * (q - zero)``: scale, and min ``-scale * zero``, per 32-column group |
| gptq | ``qweight`` int32 [in / 8, out], nibble i holding input row 8r + i; ``qzeros`` int32 [in / g, out / 8], nibble i column 8c + i; ``scales`` [in / g, out] | q4 | as awq, each stored zero point plus ``zero_offset`` (1 in the v1 format) |

Exactness: an FP8 scale (float32, bfloat16 or a power of two) is held as it is. An fp16 or bf16
AWQ/GPTQ scale times a 4-bit code, or a zero point up to 16, needs at most 16 significant bits,
so ``scale * q`` and the min are exact in float32 and so is their sum, ``scale * (q - zero)``:
the packed weight dequantizes bit for bit to the float32 formula.
"""

from __future__ import annotations

import torch

from cluster.engine.quantization.packed import PackedWeight, q4_codes

GROUP = 32  # the packed layouts' group along a row
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i holds element AWQ_ORDER[i]
SEQUENTIAL = tuple(range(8))  # GPTQ's: nibble i holds element i
F8_NAN = 0x7F  # e4m3fn's NaN, either sign


def unpack_int4(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 8n]: element ``order[i]`` of each 8 from bits 4i..4i+3."""
    shifts = torch.tensor([4 * order.index(e) for e in range(8)], dtype=torch.int32)
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 15
    return nibbles.to(torch.uint8).flatten(-2)


def awq_codes(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ ``qweight`` rows (inputs) x words -> codes [out, in]."""
    return unpack_int4(qweight, AWQ_ORDER).T


def gptq_codes(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight`` words (8 inputs each) x columns (outputs) -> codes [out, in]."""
    return unpack_int4(qweight.T, SEQUENTIAL)


def packed_zero_points(qzeros: torch.Tensor, method: str) -> torch.Tensor:
    """``qzeros`` [groups, out / 8] (awq or gptq) -> zero points [out, groups], as stored."""
    return unpack_int4(qzeros, AWQ_ORDER if method == "awq" else SEQUENTIAL).T


def block_index(cols: range, block: int | None) -> torch.Tensor:
    """For each 32-column group of ``cols`` (32-aligned), the block of ``block`` columns it falls
    in (None: one block). Blocks are multiples of 32 columns, so no group straddles two."""
    if block is None:
        return torch.zeros(len(cols) // GROUP, dtype=torch.long)
    return torch.arange(cols.start, cols.stop, GROUP) // block


def zero_point_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int | None,
                      cols: range) -> PackedWeight:
    """q4 weight ``w = scale * (q - zero)`` for columns ``cols`` (32-aligned): q uint8 [rows,
    len(cols)] in 0..15, zeros and scales [rows, groups] for the groups of ``group`` columns
    (None: one) that ``cols`` touches."""
    index = block_index(cols, group) - (cols.start // group if group else 0)  # from the first group read
    scale = scales.to(torch.float32)[:, index].contiguous()
    mins = -(scale * zeros.to(torch.float32)[:, index])
    return PackedWeight("q4", GROUP, q4_codes(q.contiguous()), scale, mins.contiguous())


def f8_weight(codes: torch.Tensor, grid: torch.Tensor, block: tuple[int | None, int | None], rows: range,
              cols: range) -> PackedWeight:
    """f8 weight of rows ``rows`` and columns ``cols`` (32-aligned) of a float8 weight: ``codes``
    that region (float8_e4m3fn or its bytes), ``grid`` the whole scale tensor, one scale per
    ``block`` of rows x columns (None: all of them). Raises ValueError on a NaN code."""
    codes = codes.contiguous().view(torch.uint8)
    if bool(((codes & 0x7F) == F8_NAN).any()):
        raise ValueError("holds NaN weights (e4m3fn codes 0x7F/0xFF)")
    grid = grid.to(torch.float32).reshape(grid.shape[0] if grid.dim() == 2 else 1, -1)
    row_block, col_block = block
    row_index = torch.arange(rows.start, rows.stop)
    row_index = row_index // row_block if row_block else torch.zeros_like(row_index)
    scales = grid[row_index][:, block_index(cols, col_block)].contiguous()
    return PackedWeight("f8", GROUP, codes, scales, None)
