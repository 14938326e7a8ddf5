"""FP8 e4m3 in Triton: rounding float32 to the nearest e4m3fn value, and quantizing activation
rows to e4m3 with a float32 scale each (the operand ``torch._scaled_mm`` takes).

The rounding is done with integer arithmetic (ties to even) before the conversion, which is then
exact: Triton's interpreter converts float32 to e4m3 wrongly where the rounding carries into the
exponent. Like the other ``triton_*`` modules this imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def round_to_e4m3(v):
    """float32 values in [-448, 448] rounded to the nearest e4m3fn value (ties to even)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (v + 24576.0) - 24576.0  # multiples of 2^-9: 24576 = 1.5 * 2^14 has an ulp of 2^-9
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, K, stride_x, stride_c, BLOCK: tl.constexpr):
    """Row r of x as e4m3 codes with one float32 scale, ``max |x| / 448`` (1 for a zero row)."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, top / 448.0, 1.0)
    tl.store(scales_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        code = round_to_e4m3(tl.clamp(x / scale, -448.0, 448.0)).to(tl.float8e4nv)
        tl.store(codes_ptr + row * stride_c + ks, code, mask=ks < K)


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) as e4m3 codes [M, K] and float32 scales [M, 1], one kernel."""
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, codes, scales, k, x.stride(0), codes.stride(0),
                                    BLOCK=min(1024, triton.next_power_of_2(k)), num_warps=4)
    return codes, scales


@triton.jit
def _scale_product_kernel(raw_ptr, row_scales_ptr, col_scales_ptr, out_ptr, N, stride_raw, stride_out,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = ns < N
    raw = tl.load(raw_ptr + row * stride_raw + ns, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(row_scales_ptr + row) * tl.load(col_scales_ptr + ns, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_out + ns, (raw * scale).to(out_ptr.dtype.element_ty), mask=ok)


def scale_product(raw: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """``raw[m, n] * row_scales[m] * col_scales[n]`` in ``dtype``, one kernel: the scales of an
    FP8 product taken with unit scales (raw [M, N], row_scales [M, 1], col_scales [1, N])."""
    m, n = raw.shape
    out = torch.empty(m, n, dtype=dtype, device=raw.device)
    if m and n:
        block = min(1024, triton.next_power_of_2(n))
        _scale_product_kernel[(m, triton.cdiv(n, block))](raw, row_scales, col_scales, out, n, raw.stride(0),
                                                         out.stride(0), BLOCK=block, num_warps=4)
    return out
