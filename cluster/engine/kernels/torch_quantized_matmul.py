"""The quantized matmuls torch ships, for the packed weights they fit: a second form of a weight,
made once at load, used where it beats the Triton kernel (``triton_quantized_matmul``).
Measured on an H200 (Llama-3-8B shape, a decode step's linear layers, ``benchmarks/quantized_gpu.py``;
``benchmarks/results/quantized_gpu_h200.txt``, run 3).

- ``Fp8RowScaled``: f8 weights whose scale is one per row (per-tensor and per-channel FP8
  checkpoints, and ``model.quantization: fp8``) on a GPU with FP8 tensor cores (compute
  capability >= 8.9), at every batch: ``torch._scaled_mm`` with unit scales, then one Triton
  kernel applies each activation row's and weight row's scale to the product. The weight is the
  f8 codes themselves, viewed as e4m3 and transposed (no copy: [N, K] row-major is the [K, N]
  column-major operand cuBLASLt takes). The activations are quantized per row to e4m3 by one
  Triton kernel (``max |x| / 448``, rounded to the nearest even code), so the product differs
  from weight-only dequantization by that rounding: at most 1/16 of each activation (3 mantissa
  bits), as the FP8 recipes of vLLM and llm-compressor (FP8_DYNAMIC) do; the unscaled product is
  rounded to bfloat16 before the scales are applied (two roundings). Why not ``_scaled_mm``'s
  own row-wise scales: on the H200 they run on a CUTLASS kernel that read the step's 7.5 GB in
  3.4-4.1 ms at batches 1-64 (quantizer excluded), where unit (per-tensor) scales take cuBLASLt's
  kernels: 2.3-2.4 ms; and the Triton kernel's weight-only GEMV took 3.8 ms at batch 1.
- ``Int4TinyGemm``: q4 weights (int4 codes, a scale and a min per 32) with bfloat16 activations
  on a GPU of compute capability >= 8.0, at batches up to 16: ``torch._weight_int4pack_mm``
  (tinygemm, as torchao's int4 weight-only uses it), which computes ``(q - 8) * scale + zero``
  with the scale and zero in bfloat16: zero = min + 8 * scale. Both are rounded to bfloat16 (8
  significant bits), so each weight moves by at most ``2^-9 * (|zero| + 8 |scale|)`` besides the
  activations' rounding (said in the tests). H200, the step's linear layers: 2.7 / 2.9 / 3.6 / 5.7
  / 9.1 ms at batch 1 / 2 / 4 / 8 / 16 against the Triton kernel's 3.4 / 5.7 / 6.1 / 7.0 / 9.3, and
  34 against 21 ms at 64 (there the Triton tiles serve). The codes are repacked into tinygemm's
  tiles (a second copy of the weight: the Triton kernel keeps the q4 bytes for larger batches).

On a CPU the same forms are built with torch's CPU ops (``_scaled_mm``, tinygemm's ``*_for_cpu``)
so the conversion and the dispatch are tested without a GPU. Both ops run without host
synchronisation and are captured in the engine's CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.engine.kernels.triton_fp8 import quantize_rows_e4m3, scale_product
from cluster.engine.kernels.triton_support import FP8_TENSOR_CORES, capability_at_least
from cluster.engine.quantization.packed import PackedWeight

TINYGEMM_CAPABILITY = (8, 0)
TINYGEMM_INNER_K_TILES = 8  # torchao's choice; K must be a multiple of 16 x this
TINYGEMM_MAX_ROWS = 16  # up to here, tinygemm (above: the Triton tiles)


@dataclass(frozen=True)
class Fp8RowScaled:
    weight: torch.Tensor  # float8_e4m3fn [K, N], column-major (the f8 codes [N, K], transposed)
    scale: torch.Tensor  # float32 [1, N]
    unit: torch.Tensor  # float32 1.0, on the weight's device: _scaled_mm's per-tensor scales

    def takes(self, rows: int) -> bool:
        return True


@dataclass(frozen=True)
class Int4TinyGemm:
    weight: torch.Tensor  # tinygemm's int32 tiles (CUDA) or its CPU layout
    scales_and_zeros: torch.Tensor  # bfloat16 [K / 32, N, 2]: scale, zero = min + 8 * scale

    def takes(self, rows: int) -> bool:
        return rows <= TINYGEMM_MAX_ROWS


TorchForm = Fp8RowScaled | Int4TinyGemm


def per_row_scales(weight: PackedWeight) -> bool:
    return bool((weight.scales == weight.scales[:, :1]).all())


def fp8_row_scaled(weight: PackedWeight) -> Fp8RowScaled:
    """The f8 weight as ``_scaled_mm``'s operand; its scales must be one per row."""
    if weight.layout != "f8" or not per_row_scales(weight):
        raise ValueError("only f8 weights with one scale per row run on _scaled_mm")
    device = weight.codes.device
    return Fp8RowScaled(weight.codes.view(torch.float8_e4m3fn).t(), weight.scales[:, 0].contiguous().view(1, -1),
                        torch.ones((), dtype=torch.float32, device=device))


def int4_tinygemm(weight: PackedWeight) -> Int4TinyGemm:
    """The q4 weight in tinygemm's layout, on the weight's device (CUDA, or the CPU's ops)."""
    if weight.layout != "q4":
        raise ValueError("only q4 weights run on tinygemm")
    q = weight.integer_codes().to(torch.int32)
    scales = weight.scales.to(torch.float32)
    zeros = weight.mins + 8 * scales
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    if weight.codes.device.type == "cuda":
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # even columns in the high nibble
        tiles = torch.ops.aten._convert_weight_to_int4pack(pairs, TINYGEMM_INNER_K_TILES)
    else:
        tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, TINYGEMM_INNER_K_TILES)
    return Int4TinyGemm(tiles, scales_and_zeros)


def torch_form(weight: PackedWeight, dtype: torch.dtype) -> TorchForm | None:
    """The form a torch kernel takes ``weight`` in for activations of ``dtype`` on the weight's
    device, or None where none applies (then the Triton kernel serves every batch)."""
    device = weight.codes.device
    rows, cols = weight.shape
    if (weight.layout == "f8" and dtype == torch.bfloat16 and capability_at_least(device, FP8_TENSOR_CORES)
            and rows % 16 == 0 and cols % 16 == 0 and per_row_scales(weight)):
        return fp8_row_scaled(weight)
    if (weight.layout == "q4" and dtype == torch.bfloat16 and capability_at_least(device, TINYGEMM_CAPABILITY)
            and rows % 8 == 0 and cols % (16 * TINYGEMM_INNER_K_TILES) == 0):
        return int4_tinygemm(weight)
    return None


def torch_matmul(x: torch.Tensor, form: TorchForm) -> torch.Tensor:
    """``x @ W.T`` [M, N] in x's dtype (bfloat16), x [M, K] with unit column stride."""
    if isinstance(form, Fp8RowScaled):
        codes, scales = quantize_rows_e4m3(x)
        raw = torch._scaled_mm(codes, form.weight, form.unit, form.unit, out_dtype=x.dtype)
        return scale_product(raw, scales, form.scale, x.dtype)
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, form.weight, 32, form.scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, form.weight, 32, form.scales_and_zeros)
