"""Quantizing a float weight at load (``model.quantization: int8 | int4``), into the packed layouts.

int8: symmetric, a scale per 32 weights of a row (``max |w| / 127``). int4: asymmetric, a scale
and a min per 32 weights (``(max - min) / 15`` and ``min``), the q4 layout. Rounding is to the
nearest code, so each weight is off by at most half its group's scale.
"""

from __future__ import annotations

import torch

from cluster.engine.quantization.packed import PackedWeight

GROUP = 32
KINDS = ("int8", "int4")


def quantizable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0


def quantize(weight: torch.Tensor, kind: str) -> PackedWeight:
    if kind not in KINDS:
        raise ValueError(f"quantization must be one of {', '.join(KINDS)}, got {kind!r}")
    if not quantizable(weight):
        raise ValueError(f"a weight of shape {tuple(weight.shape)} does not split into groups of {GROUP}")
    w = weight.detach().to(torch.float32).cpu().view(weight.shape[0], -1, GROUP)
    if kind == "int8":
        scales = w.abs().amax(-1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(w / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return PackedWeight("q8", GROUP, codes.view(weight.shape[0], -1), scales, None)
    low, high = w.amin(-1), w.amax(-1)
    scales = (high - low) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((w - low.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    codes = q[..., :16] | (q[..., 16:] << 4)
    return PackedWeight("q4", GROUP, codes.reshape(weight.shape[0], -1).contiguous(), scales, low)
