"""A weight matrix kept quantized: integer codes with a float32 scale (and min) per group.

Three layouts, the ones the CPU kernel (``kernels/quantized_matmul.c``) reads:

- ``q4``: 32 weights per group in 16 bytes, byte j holding weight j (low nibble) and j + 16 (high
  nibble), as GGUF's Q4_0/Q4_1 do; ``w = scale * q + min`` with q in 0..15.
- ``q8``: one signed byte per weight, groups of 16 or 32; ``w = scale * q`` (``+ min`` when the
  weight has mins).
- ``f8``: one byte per weight holding an FP8 e4m3fn code (``torch.float8_e4m3fn``'s bits), groups
  of 32; ``w = scale * float(code)``. e4m3fn has no infinity; its two NaN codes (0x7F, 0xFF)
  dequantize to NaN here, and checkpoints holding them are refused at load (the kernel reads them
  as +-480).

Scales and mins are float32, so a GGUF block's scale (an fp16, or an fp16 times a 6-bit or 8-bit
sub-block scale, as in the K-quants) is held exactly and the weights dequantize to the values
``gguf.quants.dequantize`` gives, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

LAYOUTS = ("q4", "q8", "f8")


@dataclass(frozen=True)
class PackedWeight:
    layout: str  # "q4", "q8" or "f8"
    group: int  # weights per scale along a row
    codes: torch.Tensor  # q4: uint8 [rows, cols / 2]; q8: int8 [rows, cols]; f8: uint8 [rows, cols]
    scales: torch.Tensor  # float32 [rows, cols / group]
    mins: torch.Tensor | None  # float32 [rows, cols / group], or None (q8, and f8 always)
    # The same weight as a torch kernel takes it (kernels/torch_quantized_matmul.py), made at load
    # on a GPU where one applies; the forms made from this one (slices, moves) drop it.
    kernel_form: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown packed layout {self.layout!r}")
        if self.layout == "q4" and (self.group != 32 or self.mins is None):
            raise ValueError("q4 weights have groups of 32 and a min per group")
        if self.layout == "q8" and self.group not in (16, 32):
            raise ValueError(f"q8 weights have groups of 16 or 32, not {self.group}")
        if self.layout == "f8" and (self.group != 32 or self.mins is not None):
            raise ValueError("f8 weights have groups of 32 and no mins")

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def cols(self) -> int:
        return self.scales.shape[1] * self.group

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.rows * self.cols)

    def integer_codes(self) -> torch.Tensor:
        """The codes as one integer per weight, [rows, cols] (int16, to hold 0..15 and -128..127;
        f8: the code's bits, 0..255)."""
        if self.layout in ("q8", "f8"):
            return self.codes.to(torch.int16)
        grouped = self.codes.view(self.rows, -1, 16).to(torch.int16)
        return torch.cat([grouped & 15, grouped >> 4], dim=-1).view(self.rows, self.cols)

    def code_values(self) -> torch.Tensor:
        """What each code stands for before its scale, float32 [rows, cols]: the integer, or
        the e4m3fn value of an f8 code."""
        if self.layout == "f8":
            return self.codes.view(torch.float8_e4m3fn).to(torch.float32)
        return self.integer_codes().to(torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weights, computed in float32 as ``scale * q + min`` (the reference every
        kernel is tested against)."""
        q = self.code_values().view(self.rows, -1, self.group)
        w = q * self.scales.unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.view(self.rows, self.cols).to(dtype)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` dequantized (an embedding lookup), without widening the others."""
        return self.take_rows(ids).dequantize(dtype)

    def take_rows(self, ids: torch.Tensor) -> "PackedWeight":
        pick = lambda t: None if t is None else t.index_select(0, ids)  # noqa: E731
        return PackedWeight(self.layout, self.group, pick(self.codes), pick(self.scales), pick(self.mins))

    def row_slice(self, start: int, size: int) -> "PackedWeight":
        cut = lambda t: None if t is None else t[start : start + size].contiguous()  # noqa: E731
        return PackedWeight(self.layout, self.group, cut(self.codes), cut(self.scales), cut(self.mins))

    def col_slice(self, start: int, size: int) -> "PackedWeight":
        """Columns [start, start + size): both ends must fall on group boundaries."""
        if start % self.group or size % self.group:
            raise ValueError(f"columns {start}..{start + size} do not fall on groups of {self.group}")
        per_code = 2 if self.layout == "q4" else 1
        g0, gn = start // self.group, size // self.group
        cut = lambda t: None if t is None else t[:, g0 : g0 + gn].contiguous()  # noqa: E731
        codes = self.codes[:, start // per_code : (start + size) // per_code].contiguous()
        return PackedWeight(self.layout, self.group, codes, cut(self.scales), cut(self.mins))

    def to(self, device: torch.device | str) -> "PackedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedWeight(self.layout, self.group, move(self.codes), move(self.scales), move(self.mins))

    def same_kind(self, other: "PackedWeight") -> bool:
        return (self.layout, self.group, self.mins is None) == (other.layout, other.group, other.mins is None)


def q4_codes(q: torch.Tensor) -> torch.Tensor:
    """Integer codes 0..15, uint8 [rows, cols], in the q4 byte order: [rows, cols / 2]."""
    grouped = q.reshape(q.shape[0], -1, 32)
    return (grouped[..., :16] | (grouped[..., 16:] << 4)).reshape(q.shape[0], -1).contiguous()


def stack_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Parts of the same kind and width, one above the other (q, k and v in one matrix)."""
    first = parts[0]
    if any(not first.same_kind(p) or p.cols != first.cols for p in parts):
        raise ValueError("only packed weights of one layout, group and width stack")
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return PackedWeight(first.layout, first.group, cat([p.codes for p in parts]), cat([p.scales for p in parts]),
                        cat([p.mins for p in parts]))
