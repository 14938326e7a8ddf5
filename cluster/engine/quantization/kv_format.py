"""How keys and values are held in the paged cache: in the model's dtype, or in 8 bits.

An 8-bit cache row (one token's one KV head) is ``head_dim`` codes followed by the row's float32
scale in 4 bytes, all in an int8 tensor ``[..., head_dim + 4]``: ``x ~= scale * code``. The scale
travels inside the row, so everything that moves cache bytes (KV transfer between workers, the
re-sharding of heads between tensor-parallel layouts, prefix caching, migration) moves an 8-bit
cache unchanged, at ``(head_dim + 4) / (2 * head_dim)`` of a 16-bit cache's bytes (0.53 at 64).

The scale is per token and head rather than per block and head: a block fills a token at a time,
and a block-wide scale would have to be re-derived (and the block re-quantized) whenever a later
token is larger. Codes: ``int8`` rounds ``x / (amax / 127)`` to the nearest integer; ``fp8_e4m3``
rounds ``x / (amax / 448)`` to the nearest e4m3fn value (torch's ``float8_e4m3fn`` conversion).
Both divisions are IEEE float32 divisions on every device, so the same floats give the same bytes
on a CPU, from the native kernels, and from the Triton kernels on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
SCALE_BYTES = 4
_LIMIT = {"int8": 127.0, "fp8_e4m3": 448.0}


def _check_name(cache_dtype: str) -> None:
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {cache_dtype!r}")


def row_bytes(cache_dtype: str, head_dim: int, element_bytes: int) -> int:
    """Bytes of one token's one KV head in a ``cache_dtype`` cache (one of KV_CACHE_DTYPES) of a
    model whose dtype is ``element_bytes`` wide: what capacity arithmetic (the planner's
    roofline, the runner's block size) counts, without a tensor in hand."""
    _check_name(cache_dtype)
    return head_dim * element_bytes if cache_dtype == "auto" else head_dim + SCALE_BYTES


@dataclass(frozen=True)
class KVCacheFormat:
    name: str  # auto (the model's dtype), int8 or fp8_e4m3
    dtype: torch.dtype  # the model's dtype: what rows are quantized from and dequantized to

    def __post_init__(self) -> None:
        _check_name(self.name)

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.quantized else self.dtype

    def row_width(self, head_dim: int) -> int:
        """Elements of ``storage_dtype`` per token per KV head."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return row_bytes(self.name, head_dim, torch.empty((), dtype=self.dtype).element_size())

    def quantize_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] floats -> [..., row_width] cache rows."""
        if not self.quantized:
            return x
        x32 = x.float()
        # The limit as a tensor on x's device: CUDA would multiply by a Python number's reciprocal,
        # which can differ from the division in the last bit (the CPU and the kernels divide).
        limit = torch.full((), _LIMIT[self.name], device=x.device)
        scale = x32.abs().amax(-1, keepdim=True) / limit
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scaled = x32 / scale
        if self.name == "int8":
            codes = torch.round(scaled).clamp_(-127, 127).to(torch.int8)
        else:
            codes = scaled.to(torch.float8_e4m3fn).view(torch.int8)
        return torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., row_width] cache rows -> [..., head_dim] in the model's dtype."""
        if not self.quantized:
            return rows
        codes, scale_bytes = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
        scale = scale_bytes.contiguous().view(torch.float32)
        values = codes.float() if self.name == "int8" else codes.contiguous().view(torch.float8_e4m3fn).float()
        return (values * scale).to(self.dtype)
