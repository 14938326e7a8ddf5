"""The native quantized matmul against dequantize-then-matmul in float32.

Each product in the kernel is the dequantized weight times x (the scale is applied before the
multiply), and a group's min is added as min times the group's sum of x: the two differ only in
the order of float32 additions. Tolerance: 1e-5 relative to the sum of |w| |x| of the output
(a few units in the last place of a K-term float32 sum, K <= 1536)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.kernels.quantized_matmul import (
    DENSE_FROM_ROWS,
    native_quantized_matmul,
    quantized_linear,
    quantized_linear_into,
)
from cluster.engine.quantization.packed import PackedWeight, stack_rows

pytestmark = pytest.mark.unit

KINDS = ["q4", "q8g32", "q8g32min", "q8g16"]


def packed(kind: str, rows: int, cols: int, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    group = 16 if kind == "q8g16" else 32
    scales = torch.rand(rows, cols // group, generator=g) * 0.02 + 0.001
    if kind == "q4":
        codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        return PackedWeight("q4", 32, codes, scales, -8 * scales)
    codes = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=g)
    mins = torch.randn(rows, cols // group, generator=g) * 0.1 if kind == "q8g32min" else None
    return PackedWeight("q8", group, codes, scales, mins)


def check_close(out: torch.Tensor, x: torch.Tensor, weight: PackedWeight) -> None:
    dense = weight.dequantize()
    expected = F.linear(x, dense)
    bound = 1e-5 * (x.abs() @ dense.abs().T) + 1e-7
    assert ((out - expected).abs() <= bound).all(), (out - expected).abs().max()


def test_the_native_kernel_builds_here():
    assert native_quantized_matmul() is not None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
def test_kernel_matches_dequantize_then_matmul(kind, rows):
    for n, k in [(13, 64), (70, 576), (8, 1536)]:
        weight = packed(kind, n, k, seed=rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
        out = torch.full((rows, n), float("nan"))
        native_quantized_matmul()(x, weight, out)
        check_close(out, x, weight)


@pytest.mark.parametrize("kind", KINDS)
def test_strided_rows_and_a_column_slice_of_the_output(kind):
    weight = packed(kind, 21, 96)
    wide_x = torch.randn(6, 200)
    x = wide_x[:, 40:136]  # rows 200 apart
    out = torch.zeros(6, 50)
    quantized_linear_into(x, weight, out[:, 10:31])
    check_close(out[:, 10:31], x, weight)
    assert (out[:, :10] == 0).all() and (out[:, 31:] == 0).all()


def test_long_prompt_chunks_take_the_widened_matmul():
    weight = packed("q4", 40, 128)
    x = torch.randn(DENSE_FROM_ROWS + 3, 128)
    out = quantized_linear(x, weight)
    torch.testing.assert_close(out, F.linear(x, weight.dequantize()), rtol=0, atol=0)


def test_batched_input_and_stacked_parts():
    q, k = packed("q4", 12, 64, seed=1), packed("q4", 4, 64, seed=2)
    both = stack_rows([q, k])
    x = torch.randn(2, 3, 64)
    out = quantized_linear(x, both)
    assert out.shape == (2, 3, 16)
    check_close(out.view(6, 16), x.view(6, 64), both)
    with pytest.raises(ValueError, match="one layout"):
        stack_rows([q, packed("q8g32", 4, 64)])


def test_without_native_kernels_the_reference_runs(monkeypatch):
    monkeypatch.setenv("TANDEM_NATIVE_KERNELS", "0")
    weight = packed("q8g16", 9, 64)
    x = torch.randn(3, 64)
    torch.testing.assert_close(quantized_linear(x, weight), F.linear(x, weight.dequantize()), rtol=0, atol=0)
