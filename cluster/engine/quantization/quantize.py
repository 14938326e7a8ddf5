"""Quantizing a float weight at load (``model.quantization: int8 | int4 | fp8``), into the packed layouts.

int8: symmetric, a scale per 32 weights of a row (``max |w| / 127``). int4: asymmetric, a scale
and a min per 32 weights (``(max - min) / 15`` and ``min``), the q4 layout. Rounding is to the
nearest code, so each weight is off by at most half its group's scale. fp8: FP8 e4m3fn codes
(the f8 layout), one scale per row (``max |w| / 448`` over the row, e4m3fn's largest value; held
per 32 weights as the layout holds it), rounded to the nearest e4m3fn value by torch's
conversion: each weight is off by at most 1/16 of itself (3 mantissa bits), or half the
subnormal step ``scale * 2^-10`` near zero. A scale per row, as per-channel FP8 checkpoints
(llm-compressor's FP8_DYNAMIC) ship, is what ``torch._scaled_mm`` multiplies on FP8 tensor cores
(``kernels/torch_quantized_matmul.py``); a floating-point code keeps its relative precision at
any scale, so a group's scale would buy only the weights near zero.
"""

from __future__ import annotations

import torch

from cluster.engine.quantization.packed import PackedWeight, q4_codes

GROUP = 32
KINDS = ("int8", "int4", "fp8")
F8_MAX = 448.0  # the largest finite e4m3fn value


def quantizable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0


def _scales(spans: torch.Tensor, codes: float) -> torch.Tensor:
    """Each group's span over the span of its codes; 1 where a group is all zeros."""
    scales = spans / codes
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def quantize(weight: torch.Tensor, kind: str, row_amax: torch.Tensor | None = None) -> PackedWeight:
    """``row_amax`` (fp8): each row's ``max |w|`` over the whole weight, where ``weight`` is a
    tensor-parallel rank's columns of it, so that the rank holds the whole weight's codes."""
    if kind not in KINDS:
        raise ValueError(f"quantization must be one of {', '.join(KINDS)}, got {kind!r}")
    if not quantizable(weight):
        raise ValueError(f"a weight of shape {tuple(weight.shape)} does not split into groups of {GROUP}")
    rows = weight.shape[0]
    w = weight.detach().to(torch.float32).view(rows, -1, GROUP)  # on the weight's device
    if kind == "fp8":
        amax = w.abs().amax(dim=(1, 2)) if row_amax is None else row_amax.to(device=w.device, dtype=torch.float32)
        scales = _scales(amax, F8_MAX).unsqueeze(-1).expand(rows, w.shape[1]).contiguous()
        values = (w / scales.unsqueeze(-1)).clamp_(-F8_MAX, F8_MAX)
        return PackedWeight("f8", GROUP, values.to(torch.float8_e4m3fn).view(torch.uint8).view(rows, -1), scales, None)
    if kind == "int8":
        scales = _scales(w.abs().amax(-1), 127)
        codes = torch.round(w / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return PackedWeight("q8", GROUP, codes.view(rows, -1), scales, None)
    low, high = w.amin(-1), w.amax(-1)
    scales = _scales(high - low, 15)
    q = torch.round((w - low.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    return PackedWeight("q4", GROUP, q4_codes(q.view(rows, -1)), scales, low)
