"""``x @ W.T`` with W a :class:`PackedWeight`: the native CPU kernel (``quantized_matmul.c``),
or dequantize-then-matmul where it does not apply (no compiler, not float32). On CUDA, and on
the CPU for an engine on the Triton backend (under ``TRITON_INTERPRET=1``, in tests),
:func:`packed_linear` takes the Triton kernel (``triton_quantized_matmul``) instead.

The kernel serves every number of activation rows, long prompt chunks included: measured on 2
AVX-512 cores (torch 2.13), it beats widening the weight and running torch's matmul from 1 row to
2,048 (q4 3072 x 576: 1.2 against 5.2 ms at 64 rows, 7.8 against 13.6 at 512, 31 against 35 at
2,048), so there is no row count past which the weight is widened. Weights whose layout an engine's
``cpu_matmul_dtype`` names (:data:`BF16_LAYOUTS`; on a CPU with AVX512_BF16) multiply with bfloat16
dot products (``quantized_matmul.c``): faster at every row count, at a bfloat16 engine's rounding.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F

from cluster.engine.kernels.build import load_library, native_kernels_enabled
from cluster.engine.kernels.threads import kernel_threads
from cluster.engine.quantization.packed import PackedWeight

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
KERNEL_COLUMNS = 32  # the kernel reads K in blocks of this many columns, even for q8's groups of 16
# The packed layouts that multiply with bfloat16 dot products, per resolved cpu_matmul_dtype (see
# EngineConfig.resolved_cpu_matmul_dtype): auto takes 4-bit weights only, whose quality it holds.
BF16_LAYOUTS: dict[str, tuple[str, ...]] = {"float32": (), "auto": ("q4",), "bfloat16": ("q4", "q8", "f8")}


class NativeQuantizedMatmul:
    def __init__(self, lib: ctypes.CDLL):
        self._q4 = lib.quantized_matmul_q4
        self._q4.restype = _int
        self._q4.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _int]
        self._q8 = lib.quantized_matmul_q8
        self._q8.restype = _int
        self._q8.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _int]
        self._f8 = lib.quantized_matmul_f8
        self._f8.restype = _int
        self._f8.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _int]
        self.bf16_dots_supported = bool(lib.bf16_dots_supported())

    def __call__(self, x: torch.Tensor, weight: PackedWeight, out: torch.Tensor, bf16_dots: bool = False) -> None:
        """``out[m, n] = x[m] . w[n]``; x [M, K] float32 with unit column stride, out [M, N] likewise.
        ``bf16_dots``: bfloat16 dot products, where this build has them."""
        m, k = x.shape
        n = weight.rows
        threads = kernel_threads()
        rounded = torch.empty(m * k, dtype=torch.bfloat16) if bf16_dots and self.bf16_dots_supported else None
        x_bf16 = rounded.data_ptr() if rounded is not None else None
        if weight.layout == "f8":
            status = self._f8(x.data_ptr(), x.stride(0), m, k, n, weight.codes.data_ptr(), weight.scales.data_ptr(),
                              out.data_ptr(), out.stride(0), x_bf16, threads)
        else:
            sums = torch.empty(m * (k // weight.group), dtype=torch.float32)
            mins = weight.mins.data_ptr() if weight.mins is not None else None
            if weight.layout == "q4":
                status = self._q4(x.data_ptr(), x.stride(0), m, k, n, weight.codes.data_ptr(),
                                  weight.scales.data_ptr(), mins, sums.data_ptr(), out.data_ptr(), out.stride(0),
                                  x_bf16, threads)
            else:
                status = self._q8(x.data_ptr(), x.stride(0), m, k, n, weight.group, weight.codes.data_ptr(),
                                  weight.scales.data_ptr(), mins, sums.data_ptr(), out.data_ptr(), out.stride(0),
                                  x_bf16, threads)
        if status:
            raise ValueError(f"quantized matmul: {k} columns do not fall on blocks of {KERNEL_COLUMNS}")


@cache
def native_quantized_matmul() -> NativeQuantizedMatmul | None:
    lib = load_library("decode_step")  # it holds every CPU kernel: one library, so one thread pool (thread_pool.c)
    return NativeQuantizedMatmul(lib) if lib is not None else None


def bf16_dots_supported() -> bool:
    """Whether the CPU kernel here can multiply with bfloat16 dot products (built with AVX512_BF16)."""
    if not native_kernels_enabled():
        return False
    kernel = native_quantized_matmul()
    return kernel is not None and kernel.bf16_dots_supported


def _fits_kernel(x: torch.Tensor, out: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu" and x.dtype == out.dtype == torch.float32
        and x.dim() == 2 and x.stride(1) == 1 and out.stride(1) == 1
    )


def quantized_linear_into(x: torch.Tensor, weight: PackedWeight, out: torch.Tensor, bf16_dots: bool = False) -> None:
    """Writes ``x @ W.T`` into ``out`` ([M, N], possibly a column slice of a wider output);
    ``bf16_dots``: the CPU kernel multiplies in bfloat16 (see ``quantized_matmul.c``)."""
    if native_kernels_enabled() and _fits_kernel(x, out):
        kernel = native_quantized_matmul()
        if kernel is not None:
            kernel(x, weight, out, bf16_dots)
            return
    out.copy_(F.linear(x, weight.dequantize(x.dtype)))


def quantized_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0], weight.rows)
    quantized_linear_into(rows, weight, out)
    return out.view(*x.shape[:-1], weight.rows)


@cache
def _triton_kernel() -> ModuleType:
    """The Triton kernel's module, imported on first use (Triton is optional)."""
    from cluster.engine.kernels import triton_quantized_matmul

    return triton_quantized_matmul


@cache
def _torch_kernels() -> ModuleType:
    """The module of torch's own quantized GPU kernels (imports Triton: its FP8 row quantizer)."""
    from cluster.engine.kernels import torch_quantized_matmul

    return torch_quantized_matmul


def with_kernel_form(weight: PackedWeight, dtype: torch.dtype) -> PackedWeight:
    """``weight`` carrying the form a torch kernel takes it in (``torch_quantized_matmul``) for
    activations of ``dtype``, where one applies on its device (CUDA only)."""
    if weight.codes.device.type != "cuda":
        return weight
    form = _torch_kernels().torch_form(weight, dtype)
    return weight if form is None else replace(weight, kernel_form=form)


def packed_linear(x: torch.Tensor, parts: tuple[tuple[int, PackedWeight], ...], out_features: int,
                  triton: bool = False, bf16_layouts: tuple[str, ...] = ()) -> torch.Tensor:
    """``x @ W.T`` for a weight kept as packed row blocks ``(first row, part)`` (q, k and v of one
    layer may ship in different GGUF types), returned in x's dtype: on CUDA or with ``triton``
    through the Triton kernel (float32 accumulation), else computed in float32 on the CPU (parts
    whose layout ``bf16_layouts`` names from bfloat16 products)."""
    if triton or x.device.type == "cuda":
        return _triton_kernel().packed_linear(x, parts, out_features)
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.to(torch.float32).contiguous()
    out = rows.new_empty(rows.shape[0], out_features)
    for first, part in parts:
        quantized_linear_into(rows, part, out[:, first : first + part.rows], part.layout in bf16_layouts)
    return out.view(*x.shape[:-1], out_features).to(x.dtype)
