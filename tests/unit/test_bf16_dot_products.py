"""The CPU kernel's bfloat16 dot products (``cpu_matmul_dtype: bfloat16``) against their exact
arithmetic, computed here in float64.

The kernel dequantizes each weight to float32 with one rounding (scale * q + min by FMA; scale *
value for f8), rounds it to bfloat16, rounds each activation to bfloat16 (both to nearest even);
vdpbf16ps multiplies them exactly (8-bit significands: each product fits a float32) and sums in
float32. So the output differs from the float64 sum of the rounded operands only by float32
additions: within 1e-5 of the sum of |w| |x| (K <= 1536), the float32 path's bound. Against the
unrounded weights and activations it is a bfloat16 engine's rounding, within 2^-8 of sum |w| |x|
(two roundings of at most 2^-9 each)."""

from __future__ import annotations

import pytest
import torch

from cluster.engine import config as engine_config
from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.kernels import quantized_matmul
from cluster.engine.kernels.quantized_matmul import bf16_dots_supported, native_quantized_matmul, packed_linear
from cluster.engine.quantization.packed import PackedWeight
from packed_weights import KINDS, packed

pytestmark = pytest.mark.unit
needs_bf16_dots = pytest.mark.skipif(not bf16_dots_supported(),
                                     reason="the kernel here has no bfloat16 dot products (AVX512_BF16)")


def test_the_setting_is_checked_and_bfloat16_refused_where_the_kernel_lacks_it(monkeypatch):
    with pytest.raises(EngineConfigError, match=r"cpu_matmul_dtype must be one of auto, float32, bfloat16, got 'bf16'"):
        EngineConfig(model="m", cpu_matmul_dtype="bf16")
    assert EngineConfig(model="m").cpu_matmul_dtype == "auto"
    assert EngineConfig(model="m", cpu_matmul_dtype="float32").resolved_cpu_matmul_dtype() == "float32"
    assert EngineConfig(model="m", device="cuda", cpu_matmul_dtype="bfloat16").resolved_cpu_matmul_dtype() == "float32"
    monkeypatch.setattr(quantized_matmul, "bf16_dots_supported", lambda: False)
    assert EngineConfig(model="m").resolved_cpu_matmul_dtype() == "float32"
    with pytest.raises(EngineConfigError, match="needs a CPU with AVX512_BF16") as refused:
        EngineConfig(model="m", cpu_matmul_dtype="bfloat16").resolved_cpu_matmul_dtype()
    assert "\n" not in str(refused.value) and "set cpu_matmul_dtype to auto or float32" in str(refused.value)
    monkeypatch.setattr(quantized_matmul, "bf16_dots_supported", lambda: True)
    assert EngineConfig(model="m").resolved_cpu_matmul_dtype() == "auto"
    assert EngineConfig(model="m", cpu_matmul_dtype="bfloat16").resolved_cpu_matmul_dtype() == "bfloat16"
    assert engine_config.CPU_MATMUL_DTYPES == ("auto", "float32", "bfloat16")
    assert quantized_matmul.BF16_LAYOUTS == {"float32": (), "auto": ("q4",), "bfloat16": ("q4", "q8", "f8")}


def exact_weights(weight: PackedWeight) -> torch.Tensor:
    """float64 [rows, cols]: scale * q + min without rounding (each term is exact in float64)."""
    one = torch.ones(weight.scales.shape)
    codes = PackedWeight(weight.layout, weight.group, weight.codes, one,
                         None if weight.mins is None else torch.zeros_like(one)).dequantize().double()
    scale = weight.scales.double().repeat_interleave(weight.group, 1)
    low = 0.0 if weight.mins is None else weight.mins.double().repeat_interleave(weight.group, 1)
    return codes * scale + low


def expected(weight: PackedWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result of the rounded operands (each weight rounded to float32 once, then to
    bfloat16), and the sum of |w| |x|."""
    w16 = exact_weights(weight).float().bfloat16().double()
    x16 = x.bfloat16().double()
    return x16 @ w16.T, x.double().abs() @ exact_weights(weight).abs().T


@needs_bf16_dots
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 20, 70])
def test_bf16_dot_products_are_the_rounded_operands_summed_in_float32(kind, rows):
    weight = packed(kind, 37, 1536, seed=5)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
    out = torch.full((rows, 37), float("nan"))
    native_quantized_matmul()(x, weight, out, bf16_dots=True)
    exact, magnitude = expected(weight, x)
    assert ((out.double() - exact).abs() <= 1e-5 * magnitude + 1e-7).all()
    full = x.double() @ weight.dequantize().double().T
    assert ((out.double() - full).abs() <= 2.0**-8 * magnitude + 1e-6).all()
    assert not torch.equal(out, x @ weight.dequantize().T)  # it did take the bfloat16 path


@needs_bf16_dots
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gives_the_same_bits_whatever_rows_share_its_call(kind):
    """As for float32 (test_quantized_matmul.py): a speculative verify's rows give the tokens plain
    decode steps would, so speculation stays exact with bfloat16 dot products."""
    weight = packed(kind, 23, 1536, seed=3)
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(4))
    kernel = native_quantized_matmul()
    alone = torch.empty(17, 23)
    for row in range(17):
        kernel(x[row : row + 1], weight, alone[row : row + 1], bf16_dots=True)
    for rows in range(1, 18):
        out = torch.full((rows, 23), float("nan"))
        kernel(x[:rows], weight, out, bf16_dots=True)
        assert torch.equal(out, alone[:rows]), rows


@needs_bf16_dots
def test_strided_rows_into_a_column_slice():
    weight = packed("q4", 21, 96)
    wide_x = torch.randn(6, 200)
    x = wide_x[:, 40:136]
    out = torch.zeros(6, 50)
    native_quantized_matmul()(x, weight, out[:, 10:31], bf16_dots=True)
    exact, magnitude = expected(weight, x.contiguous())
    assert ((out[:, 10:31].double() - exact).abs() <= 1e-5 * magnitude + 1e-7).all()
    assert (out[:, :10] == 0).all() and (out[:, 31:] == 0).all()


@needs_bf16_dots
def test_packed_linear_takes_the_bfloat16_kernel_for_every_part():
    """The torch path's call (a layer's row blocks, as q, k and v of one layer may ship in
    different types): each part through the bfloat16 kernel."""
    parts = ((0, packed("q4", 8, 96, seed=1)), (8, packed("q8g16", 5, 96, seed=2)), (13, packed("f8", 3, 96, seed=3)))
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(9))
    out = packed_linear(x, parts, 16, bf16_layouts=("q4", "q8", "f8"))
    assert out.shape == (2, 3, 16)
    rows = x.reshape(6, 96)
    for first, part in parts:
        exact, magnitude = expected(part, rows)
        got = out.reshape(6, 16)[:, first : first + part.rows].double()
        assert ((got - exact).abs() <= 1e-5 * magnitude + 1e-7).all()
    assert not torch.equal(out, packed_linear(x, parts, 16))
    q4_only = packed_linear(x, parts, 16, bf16_layouts=("q4",))  # auto's: the 8-bit parts in float32
    assert torch.equal(q4_only[..., :8], out[..., :8]) and torch.equal(q4_only[..., 8:], packed_linear(x, parts, 16)[..., 8:])
