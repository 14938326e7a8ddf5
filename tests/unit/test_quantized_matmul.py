"""The native quantized matmul against dequantize-then-matmul in float32, on the AVX-512 path and
on the portable C path (the same source compiled without AVX-512).

Each product in the kernel is the dequantized weight times x (the scale is applied before the
multiply), and a group's min is added as min times the group's sum of x: the two differ only in
the order of float32 additions. Tolerance: 1e-5 relative to the sum of |w| |x| of the output
(a few units in the last place of a K-term float32 sum, K <= 1536). An f8 weight is widened
exactly (scale times the e4m3fn value, one rounding), so it is held to the same bound."""

from __future__ import annotations

import ctypes
import platform
import subprocess

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.kernels.build import COMPILE_FLAGS, LINK_FLAGS, SOURCE_DIR, c_compiler
from cluster.engine.kernels.quantized_matmul import (
    NativeQuantizedMatmul,
    native_quantized_matmul,
    quantized_linear,
    quantized_linear_into,
)
from cluster.engine.quantization.packed import PackedWeight, stack_rows
from packed_weights import KINDS, packed

pytestmark = pytest.mark.unit

F8_NAN_CODES = (0x7F, 0xFF)


def check_close(out: torch.Tensor, x: torch.Tensor, weight: PackedWeight) -> None:
    dense = weight.dequantize()
    expected = F.linear(x, dense)
    bound = 1e-5 * (x.abs() @ dense.abs().T) + 1e-7
    assert ((out - expected).abs() <= bound).all(), (out - expected).abs().max()


def test_the_native_kernel_builds_here():
    assert native_quantized_matmul() is not None


@pytest.fixture(scope="module")
def portable_kernel(tmp_path_factory) -> NativeQuantizedMatmul:
    """quantized_matmul.c built without AVX-512: its plain-C path (the native build already is,
    off x86)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return native_quantized_matmul()
    target = tmp_path_factory.mktemp("portable") / "quantized_matmul.so"
    subprocess.run([c_compiler(), *COMPILE_FLAGS, "-mno-avx512f", *LINK_FLAGS, str(SOURCE_DIR / "quantized_matmul.c"),
                    "-o", str(target), "-lm"], check=True, capture_output=True)
    return NativeQuantizedMatmul(ctypes.CDLL(str(target)))


def test_every_f8_code_dequantizes_as_torchs_float8_e4m3fn():
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)
    scales = torch.tensor([[1.0], [0.5], [3.0], [1e-3], [2.0**-20], [7.25], [1.0], [448.0]])
    weight = PackedWeight("f8", 32, codes, scales, None)
    expected = codes.view(torch.float8_e4m3fn).to(torch.float32) * scales
    assert torch.equal(weight.dequantize().isnan(), expected.isnan())
    assert weight.dequantize().isnan().sum() == len(F8_NAN_CODES)
    assert torch.equal(torch.nan_to_num(weight.dequantize()), torch.nan_to_num(expected))


def test_f8_kernels_widen_every_code_exactly(portable_kernel):
    """One-hot activations read each weight back alone: both paths give scale * value exactly
    (the NaN codes read as +-480, see quantized_matmul.c; the loader refuses them)."""
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)
    scales = torch.rand(8, 1) + 0.5
    weight = PackedWeight("f8", 32, codes, scales, None)
    expected = codes.view(torch.float8_e4m3fn).to(torch.float32) * scales
    expected.view(-1)[list(F8_NAN_CODES)] = torch.tensor([480.0, -480.0]) * scales[[3, 7], 0]
    for kernel in (native_quantized_matmul(), portable_kernel):
        out = torch.empty(32, 8)
        kernel(torch.eye(32), weight, out)
        assert torch.equal(out.T, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_the_portable_path_matches_dequantize_then_matmul(portable_kernel, kind):
    for rows, (n, k) in [(1, (13, 64)), (5, (70, 576)), (9, (8, 1536))]:
        weight = packed(kind, n, k, seed=rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
        out = torch.full((rows, n), float("nan"))
        portable_kernel(x, weight, out)
        check_close(out, x, weight)


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
def test_a_row_gives_the_same_bits_whatever_rows_share_its_call(kind, portable_kernel):
    """A speculative verify's rows must give the tokens plain decode steps would: each row's
    output is bit for bit the one it gets alone, for every width of the 4-row and 8-row tiles and
    past them (up to 17 rows: two 8-row tiles and a row), features in every tile width's tail."""
    weight = packed(kind, 23, 1536, seed=3)
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(4))
    for kernel in (native_quantized_matmul(), portable_kernel):
        alone = torch.empty(17, 23)
        for row in range(17):
            kernel(x[row : row + 1], weight, alone[row : row + 1])
        for rows in range(1, 18):
            out = torch.full((rows, 23), float("nan"))
            kernel(x[:rows], weight, out)
            assert torch.equal(out, alone[:rows]), rows


@pytest.mark.parametrize("kind", KINDS)
def test_strided_rows_and_a_column_slice_of_the_output(kind):
    weight = packed(kind, 21, 96)
    wide_x = torch.randn(6, 200)
    x = wide_x[:, 40:136]  # rows 200 apart
    out = torch.zeros(6, 50)
    quantized_linear_into(x, weight, out[:, 10:31])
    check_close(out[:, 10:31], x, weight)
    assert (out[:, :10] == 0).all() and (out[:, 31:] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_long_prompt_chunks_run_the_kernel_in_row_blocks(kind):
    weight = packed(kind, 40, 128)
    x = torch.randn(64 * 3 + 7, 128)  # row blocks of 64 (ROW_BLOCK), and a tail of one part-filled tile
    check_close(quantized_linear(x, weight), x, weight)


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
