"""Random packed weights of every layout, and the check of a matmul of them against
dequantize-then-matmul in float32 (``F.linear(x, W.dequantize())``), shared by the tests of the
CPU kernel and of the Triton kernel (unit and GPU tiers). The Triton kernel's tolerances are
explained in tests/unit/test_triton_quantized_matmul.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.engine.quantization.packed import PackedWeight

KINDS = ["q4", "q8g32", "q8g32min", "q8g16", "f8"]
# A unit of rounding per activation dtype, as a fraction of sum |x| |w|: float32's bound covers the
# order of float32 additions; bfloat16's is 2^-7 (the interpreter truncates float32 to bfloat16).
UNIT = {torch.float32: 5e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def packed(kind: str, rows: int, cols: int, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    group = 16 if kind == "q8g16" else 32
    scales = torch.rand(rows, cols // group, generator=g) * 0.02 + 0.001
    if kind == "q4":
        codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        return PackedWeight("q4", 32, codes, scales, -8 * scales)
    if kind == "f8":  # every code but the two NaNs, subnormals and +-0 among them
        codes = torch.randint(0, 254, (rows, cols), dtype=torch.uint8, generator=g)
        codes += (codes >= 0x7F).to(torch.uint8)
        return PackedWeight("f8", 32, codes, scales, None)
    codes = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=g)
    mins = torch.randn(rows, cols // group, generator=g) * 0.1 if kind == "q8g32min" else None
    return PackedWeight("q8", group, codes, scales, mins)


def activations(rows: int, cols: int, dtype: torch.dtype, device: torch.device, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def assert_close_to_dequantized(out: torch.Tensor, x: torch.Tensor, weight: PackedWeight,
                                extra: torch.Tensor | float = 0.0) -> None:
    """Within two units of x's dtype (a weight rounded to it, the output rounded to it), plus ``extra``."""
    dense = weight.dequantize()
    expected = F.linear(x.float(), dense)
    bound = 2 * UNIT[x.dtype] * (x.float().abs() @ dense.abs().T) + extra + 1e-6
    error = (out.float() - expected).abs()
    assert out.dtype == x.dtype
    assert (error <= bound).all(), f"worst error {error.max():.3g}, over its bound {(error / bound).max():.3g}x"


def fp8_rounding_bound(x: torch.Tensor, weight: PackedWeight, group: int = 32) -> torch.Tensor:
    """sum over k of |w| (|x| 2^-4 + s 2^-10): each activation's e4m3 rounding at its group's
    scale s = max |x| / 448 (3 mantissa bits; below e4m3's normal range, a step of s 2^-9);
    ``group``: columns per activation scale (a whole row: its width)."""
    groups = x.float().view(x.shape[0], -1, group)
    scale = groups.abs().amax(-1, keepdim=True) / 448
    per_activation = (groups.abs() * 2.0**-4 + scale * 2.0**-10).view(x.shape)
    return per_activation @ weight.dequantize().abs().T
