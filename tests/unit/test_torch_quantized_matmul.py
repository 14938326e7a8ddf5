"""torch's own quantized kernels for packed weights (``kernels/torch_quantized_matmul.py``):
``_scaled_mm`` for f8 weights with a scale per row, tinygemm for q4, against
dequantize-then-matmul in float32, and the dispatch between them and the Triton kernel.

Without CUDA the forms are built with torch's CPU ops (``_scaled_mm`` on the CPU, tinygemm's
``*_for_cpu``) and the activation quantizer runs under Triton's interpreter; with CUDA, natively.
Tolerances, as in tests/unit/test_triton_quantized_matmul.py, two units of bfloat16 of
``sum |x| |w|``, plus:

- ``_scaled_mm``: each activation rounded to e4m3 at its row's scale ``max |x| / 448``;
- tinygemm: the scale and the zero (min + 8 scale) rounded to bfloat16, so each weight moves by
  at most ``2^-9 (8 |scale| + |zero|)``.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from cluster.engine.kernels import torch_quantized_matmul as kernels  # noqa: E402
from cluster.engine.kernels import triton_quantized_matmul as triton_kernel  # noqa: E402
from cluster.engine.kernels.triton_fp8 import quantize_rows_e4m3  # noqa: E402
from cluster.engine.quantization.quantize import quantize  # noqa: E402
from packed_weights import assert_close_to_dequantized, fp8_rounding_bound, packed  # noqa: E402
from packed_weights import activations as random_activations  # noqa: E402

pytestmark = pytest.mark.unit

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N, K = 48, 256  # tinygemm: N a multiple of 8, K of 16 x its inner K tiles (8)


def activations(m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    return random_activations(m, k, torch.bfloat16, DEVICE, seed)


def row_scaled_f8(rows: int = N, cols: int = K, seed: int = 0):
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize(weight.to(DEVICE), "fp8")


def test_activation_rows_quantize_to_torchs_e4m3_of_their_scale():
    x = activations(5, 3000).float()  # K past one block of the kernel's 1,024 columns
    x[3] = 0  # a zero row takes scale 1
    x[4, 7] = 1e4  # one large value: the others fall into e4m3's subnormals
    codes, scales = quantize_rows_e4m3(x.to(torch.bfloat16))
    x = x.to(torch.bfloat16).float()
    expected_scales = x.abs().amax(-1, keepdim=True) / 448
    expected_scales[3] = 1
    assert torch.equal(scales, expected_scales)
    # values, not bits: a value that rounds to zero may come out +0 where torch gives -0
    assert torch.equal(codes.float(), (x / expected_scales).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("rows", [1, 2, 17, 64, 130])
def test_fp8_row_scaled_weights_on_scaled_mm(rows):
    """Unit scales on _scaled_mm, then the rows' and columns' scales: the product rounded to
    bfloat16 twice, within the two units the bound allows."""
    weight = row_scaled_f8()
    form = kernels.fp8_row_scaled(weight)
    assert form.weight.data_ptr() == weight.codes.data_ptr(), "the codes themselves, not a copy"
    x = activations(rows)
    out = kernels.torch_matmul(x, form)
    assert_close_to_dequantized(out, x, weight, extra=fp8_rounding_bound(x, weight, group=K))


def test_only_f8_weights_with_a_scale_per_row_take_scaled_mm():
    grouped = packed("f8", N, K).to(DEVICE)  # a scale per 32
    with pytest.raises(ValueError, match="one scale per row"):
        kernels.fp8_row_scaled(grouped)
    assert kernels.per_row_scales(row_scaled_f8())
    with pytest.raises(ValueError, match="q4"):
        kernels.int4_tinygemm(grouped)


def tinygemm_bound(x: torch.Tensor, weight) -> torch.Tensor:
    zeros = weight.mins + 8 * weight.scales
    per_weight = (2.0**-9 * (8 * weight.scales.abs() + zeros.abs())).repeat_interleave(32, dim=1)
    return x.float().abs() @ per_weight.T


@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_q4_weights_on_tinygemm(rows):
    weight = packed("q4", N, K).to(DEVICE)
    weight = replace(weight, mins=weight.mins + torch.rand_like(weight.mins) * 0.01)  # mins of their own
    form = kernels.int4_tinygemm(weight)
    assert form.scales_and_zeros.shape == (K // 32, N, 2)
    x = activations(rows)
    out = kernels.torch_matmul(x, form)
    assert_close_to_dequantized(out, x, weight, extra=tinygemm_bound(x, weight))


def test_packed_linear_takes_each_parts_kernel_at_the_batches_it_serves():
    """q/k/v in two parts: a part with a form goes through it where it takes the batch (f8: every
    batch; q4: up to TINYGEMM_MAX_ROWS), the other through the Triton kernel; one part with a form
    is returned as the torch kernel made it."""
    f8 = row_scaled_f8(32, K)
    q4 = packed("q4", 16, K).to(DEVICE)
    f8 = replace(f8, kernel_form=kernels.fp8_row_scaled(f8))
    q4 = replace(q4, kernel_form=kernels.int4_tinygemm(q4))
    for rows in (1, kernels.TINYGEMM_MAX_ROWS, kernels.TINYGEMM_MAX_ROWS + 1):
        x = activations(rows)
        out = triton_kernel.packed_linear(x, ((0, f8), (32, q4)), 48)
        assert torch.equal(out[:, :32], kernels.torch_matmul(x, f8.kernel_form))
        got = out[:, 32:]
        if rows <= kernels.TINYGEMM_MAX_ROWS:
            assert torch.equal(got, kernels.torch_matmul(x, q4.kernel_form))
        else:
            expected = torch.empty_like(got)
            triton_kernel.quantized_matmul_into(x, q4, expected)
            assert torch.equal(got, expected)
    alone = triton_kernel.packed_linear(activations(4), ((0, f8),), 32)
    assert torch.equal(alone, kernels.torch_matmul(activations(4), f8.kernel_form))
    assert torch.equal(triton_kernel.packed_linear(activations(4), ((0, f8),), 32, torch_kernels=False),
                       triton_kernel.packed_linear(activations(4), ((0, replace(f8, kernel_form=None)),), 32))


def test_forms_are_made_at_load_only_where_a_kernel_runs():
    """On the CPU no form is made (the CPU kernel serves every packed weight); on a GPU a bfloat16
    model's row-scaled f8 and q4 weights get theirs, float32 and float16 ones none."""
    from cluster.engine.kernels.quantized_matmul import with_kernel_form

    f8, q4 = row_scaled_f8(), packed("q4", N, K).to(DEVICE)
    if DEVICE.type == "cpu":
        assert with_kernel_form(f8, torch.bfloat16).kernel_form is None
        return
    capability = torch.cuda.get_device_capability()
    assert (with_kernel_form(f8, torch.bfloat16).kernel_form is not None) == (capability >= (8, 9))
    assert (with_kernel_form(q4, torch.bfloat16).kernel_form is not None) == (capability >= (8, 0))
    for dtype in (torch.float32, torch.float16):
        assert with_kernel_form(f8, dtype).kernel_form is None and with_kernel_form(q4, dtype).kernel_form is None
    assert with_kernel_form(packed("f8", N, K).to(DEVICE), torch.bfloat16).kernel_form is None  # a scale per 32
