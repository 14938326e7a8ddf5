"""GGUF quantization blocks repacked into :class:`PackedWeight` layouts, not widened.

Each type maps onto a layout without loss: the repacked weight dequantizes to exactly what
``gguf.quants.dequantize`` gives (``tests/unit/test_gguf_repack.py``).

| GGUF   | layout     | how                                                                      |
|--------|------------|--------------------------------------------------------------------------|
| Q4_0   | q4         | nibbles as stored; scale d, min -8d                                      |
| Q4_1   | q4         | nibbles as stored; scale d, min m                                        |
| Q4_K   | q4         | each 32-weight sub-block a group: scale d*sc, min -dmin*m; nibbles moved |
|        |            | from the 64-weight interleave into the group order                      |
| Q8_0   | q8, g32    | codes as stored; scale d                                                 |
| Q5_0   | q8, g32    | 5-bit codes widened to a byte (q - 16); scale d                          |
| Q5_1   | q8, g32    | 5-bit codes in a byte; scale d, min m                                    |
| Q5_K   | q8, g32    | 5-bit codes in a byte; scale d*sc, min -dmin*m                           |
| Q6_K   | q8, g16    | 6-bit codes widened to a byte (q - 32); scale d*sc                       |

Scales are float32: an fp16 times a 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) sub-block scale needs at
most 19 significant bits, so it is exact. The price is bytes: q4 holds 6 bits per weight (Q4_0
4.5, Q4_1 5, Q4_K 4.5), q8 9 bits for groups of 32 and 10 for 16 (Q8_0 8.5, Q5_K 5.5, Q6_K 6.6).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K

from cluster.engine.quantization.packed import PackedWeight

QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _blocks(data: np.ndarray, block_bytes: int) -> tuple[np.ndarray, int]:
    """[rows, bytes per row] -> [rows * blocks per row, block_bytes], and the rows."""
    rows = data.shape[0]
    return np.ascontiguousarray(data).reshape(-1, block_bytes), rows


def _packed(layout: str, group: int, rows: int, codes: np.ndarray, scales: np.ndarray,
            mins: np.ndarray | None) -> PackedWeight:
    tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1))  # noqa: E731
    return PackedWeight(layout, group, tensor(codes), tensor(scales.astype(np.float32)),
                        None if mins is None else tensor(mins.astype(np.float32)))


def _q4_0(data: np.ndarray) -> PackedWeight:
    blocks, rows = _blocks(data, 18)
    d = _f16(blocks[:, :2])
    return _packed("q4", 32, rows, blocks[:, 2:], d, -8 * d)


def _q4_1(data: np.ndarray) -> PackedWeight:
    blocks, rows = _blocks(data, 20)
    return _packed("q4", 32, rows, blocks[:, 4:], _f16(blocks[:, :2]), _f16(blocks[:, 2:4]))


def _q8_0(data: np.ndarray) -> PackedWeight:
    blocks, rows = _blocks(data, 34)
    return _packed("q8", 32, rows, blocks[:, 2:].view(np.int8), _f16(blocks[:, :2]), None)


def _five_bit(low_nibbles: np.ndarray, qh_bits: np.ndarray) -> np.ndarray:
    return low_nibbles | (qh_bits << 4)


def _q5_0_1(data: np.ndarray, with_min: bool) -> PackedWeight:
    head = 4 if with_min else 2
    blocks, rows = _blocks(data, head + 4 + 16)
    qh = np.ascontiguousarray(blocks[:, head : head + 4]).view(np.uint32)  # [B, 1]
    bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [B, 32]
    qs = blocks[:, head + 4 :]
    low = np.concatenate([qs & 15, qs >> 4], axis=1)  # weights 0..15 then 16..31
    q = _five_bit(low, bits).astype(np.int16)
    d = _f16(blocks[:, :2])
    if with_min:
        return _packed("q8", 32, rows, q.astype(np.int8), d, _f16(blocks[:, 2:4]))
    return _packed("q8", 32, rows, (q - 16).astype(np.int8), d, None)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per 32-weight sub-block, scale d*sc and min -dmin*m, float32 [B, 8]."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(data: np.ndarray) -> PackedWeight:
    blocks, rows = _blocks(data, 144)
    scales, mins = _k_scales(blocks)
    qs = blocks[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low nibbles 0..31, high 32..63
    low, high = qs & 15, qs >> 4  # [B, 4, 32]: the chunk's first and second sub-block
    sub = np.stack([low, high], axis=2).reshape(-1, 8, 32)  # [B, sub-block, weight]
    codes = sub[:, :, :16] | (sub[:, :, 16:] << 4)  # our order: byte j = weight j | weight j + 16
    return _packed("q4", 32, rows, codes, scales, mins)


def _q5_k(data: np.ndarray) -> PackedWeight:
    blocks, rows = _blocks(data, 176)
    scales, mins = _k_scales(blocks)
    qh = blocks[:, 16:48]  # [B, 32]: bit s of byte l is the high bit of sub-block s's weight l
    qs = blocks[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    bits = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [B, 8, 32]
    return _packed("q8", 32, rows, _five_bit(low, bits).astype(np.int8), scales, mins)


def _q6_k(data: np.ndarray) -> PackedWeight:
    blocks, rows = _blocks(data, 210)
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [B, half, low/high nibble bank, 32]
    qh = blocks[:, 128:192].reshape(-1, 2, 32)  # [B, half, 32]
    sub_scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)  # [B, 16]
    d = _f16(blocks[:, 208:210])
    # Within each 128-weight half: weights 0..31 and 64..95 take ql[0:32]'s low and high nibble,
    # 32..63 and 96..127 ql[32:64]'s; their top two bits are qh's bits 0-1, 2-3, 4-5, 6-7.
    low = np.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    high = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    q = (low | (high << 4)).astype(np.int16) - 32  # [B, half, quarter, 32]
    return _packed("q8", 16, rows, q.astype(np.int8), d * sub_scales, None)


REPACKERS = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q4_K: _q4_k,
    Q.Q8_0: _q8_0,
    Q.Q5_0: lambda data: _q5_0_1(data, with_min=False),
    Q.Q5_1: lambda data: _q5_0_1(data, with_min=True),
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}


def repackable(tensor_type: Q) -> bool:
    return tensor_type in REPACKERS


def repack(data: np.ndarray, tensor_type: Q) -> PackedWeight:
    """Rows of GGUF blocks ([rows, bytes per row], as ``GGUFReader`` maps them) as a packed weight."""
    try:
        repacker = REPACKERS[tensor_type]
    except KeyError:
        raise ValueError(f"GGUF type {tensor_type.name} has no packed layout; it is widened instead") from None
    return repacker(data)
