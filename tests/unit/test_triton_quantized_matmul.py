"""The Triton quantized matmul against dequantize-then-matmul in float32 (``F.linear(x, W.dequantize())``).

Without CUDA the kernel runs under Triton's CPU interpreter (set here, before the module is
imported); with CUDA, natively. Tolerances, as a fraction of ``sum |x| |w|`` of each output (the
scale of every rounding error in it):

- float32 activations: 1e-5. The products are exact IEEE float32 (no TF32) and the weight is
  widened exactly (an f8 code through fp16); only the order of the float32 additions differs.
- bfloat16 / float16 activations: each weight is rounded to x's dtype before the product and the
  output is rounded to it: two units of 2^-7 (bfloat16: the interpreter truncates, a GPU rounds
  to nearest, half that) or 2^-10 (float16).
- FP8 activations (f8 weights): besides the float16/bfloat16 terms, each activation is rounded to
  an e4m3 value of its group's scale s = max |x| / 448: by at most |x| 2^-4 (3 mantissa bits) or,
  below e4m3's normal range, s 2^-10. The bound adds sum |w| (|x| 2^-4 + s 2^-10).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from cluster.engine.kernels import triton_fp8  # noqa: E402
from cluster.engine.kernels import triton_quantized_matmul as kernel  # noqa: E402
from cluster.engine.kernels.quantized_matmul import packed_linear  # noqa: E402
from cluster.engine.quantization.packed import PackedWeight  # noqa: E402
from packed_weights import KINDS, assert_close_to_dequantized, fp8_rounding_bound, packed  # noqa: E402
from packed_weights import activations as random_activations  # noqa: E402

pytestmark = pytest.mark.unit

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ODD_N = 37
WIDTH = {"q8g16": 176}  # K: 11 groups of 16; the others 160 (5 groups of 32), a partial tile of 128


def weight_for(kind: str, n: int = ODD_N, k: int | None = None, seed: int = 0) -> PackedWeight:
    return packed(kind, n, k or WIDTH.get(kind, 160), seed).to(DEVICE)


def activations(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return random_activations(m, k, dtype, DEVICE, seed)


assert_close = assert_close_to_dequantized


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 100])
def test_each_layout_matches_dequantize_then_matmul_in_float32(kind, rows):
    """1..64 rows take the decode tiles; 100 the prompt tiles."""
    weight = weight_for(kind, seed=rows)
    x = activations(rows, weight.cols, torch.float32)
    out = torch.full((rows, ODD_N), float("nan"), device=DEVICE)
    kernel.quantized_matmul_into(x, weight, out)
    assert_close(out, x, weight)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_activations_give_16bit_outputs_within_their_rounding(kind, dtype):
    for rows in (3, 100):
        weight = weight_for(kind, seed=rows)
        x = activations(rows, weight.cols, dtype)
        assert_close(kernel.packed_linear(x, ((0, weight),), ODD_N, fp8_activations=False), x, weight)


@pytest.mark.parametrize("kind", ["q4", "q8g16", "f8"])
def test_a_split_k_sums_its_parts(kind):
    """Five tiles of 128 columns in three splits (two, two, one), added by the second kernel."""
    weight = weight_for(kind, k=640)
    x = activations(5, 640, torch.float32)
    out = torch.empty(5, ODD_N, device=DEVICE)
    kernel.quantized_matmul_into(x, weight, out, splits=3)
    assert_close(out, x, weight)


def gemv_plan(k: int, splits: int, block_n: int = 16, block_k: int = 64) -> "kernel.TilePlan":
    k_tiles = -(-k // block_k)
    per_split = -(-k_tiles // splits)
    return kernel.TilePlan(16, block_n, block_k, -(-k_tiles // per_split), per_split * block_k, 4, 3, gemv=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("splits", [1, 2])
def test_the_gemv_kernel_matches_dequantize_then_matmul(kind, rows, splits):
    """One row a program, no tensor cores: a partial last tile of rows (37 of 48) and of columns
    (160 in tiles of 64), with and without a split of K."""
    weight = weight_for(kind, seed=rows)
    plan = gemv_plan(weight.cols, splits)
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(rows, weight.cols, dtype)
        out = torch.full((rows, ODD_N), float("nan"), dtype=dtype, device=DEVICE)
        kernel.quantized_matmul_into(x, weight, out, plan=plan)
        assert_close(out, x, weight)


def test_parts_of_several_layouts_fill_their_columns_of_one_output():
    """q, k and v of one layer may ship in different types: each part writes its own column slice."""
    parts = ((0, weight_for("q4", n=40)), (40, weight_for("q8g32min", n=24)), (64, weight_for("f8", n=8)))
    x = activations(6, 160, torch.float32).view(2, 3, 160)
    out = packed_linear(x, parts, 72, triton=True)
    whole = torch.cat([part.dequantize() for _, part in parts])
    assert out.shape == (2, 3, 72)
    error = (out - F.linear(x, whole)).abs()
    assert (error <= 1e-5 * (x.abs() @ whole.abs().T) + 1e-6).all()


def test_every_f8_code_widens_exactly():
    """One-hot activations read each weight back alone: scale * value exactly; the NaN codes read
    as +-480, as on the CPU kernel (the loader refuses them)."""
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)
    scales = torch.rand(8, 1, generator=torch.Generator().manual_seed(0)) + 0.5
    weight = PackedWeight("f8", 32, codes, scales, None).to(DEVICE)
    out = torch.empty(32, 8, device=DEVICE)
    kernel.quantized_matmul_into(torch.eye(32, device=DEVICE), weight, out)
    expected = codes.view(torch.float8_e4m3fn).to(torch.float32) * scales
    expected.view(-1)[[0x7F, 0xFF]] = torch.tensor([480.0, -480.0]) * scales[[3, 7], 0]
    assert torch.equal(out.T.cpu(), expected)


def test_the_tiles_follow_the_batch():
    """Decode batches: one tile of rows, K split until there are about two programs per SM
    (132: an H100), each split at least four tiles; prompt chunks: 128 x 128 tiles, no split."""
    o_proj = kernel.plan_tiles(8, 4096, 4096, num_sms=132)
    assert (o_proj.block_m, o_proj.block_n, o_proj.block_k, o_proj.splits) == (16, 64, 128, 8)
    assert o_proj.splits * o_proj.k_per_split == 4096
    assert kernel.plan_tiles(8, 28672, 4096, num_sms=132).splits == 1  # 448 programs already
    down = kernel.plan_tiles(33, 4096, 14336, num_sms=132)
    assert (down.block_m, down.splits) == (64, 8) and down.k_per_split % down.block_k == 0
    assert down.splits * down.k_per_split >= 14336 > (down.splits - 1) * down.k_per_split
    assert kernel.plan_tiles(8, 4096, 512, num_sms=132).splits == 1  # four tiles in all
    prefill = kernel.plan_tiles(512, 4096, 4096, num_sms=132)
    assert (prefill.block_m, prefill.block_n, prefill.splits) == (128, 128, 1)
    assert kernel.plan_tiles(8, 4096, 4096, num_sms=1).splits == 1  # the interpreter


def test_one_row_takes_the_gemv_kernel_with_k_in_runs_of_1024_columns():
    """The plan the H200 sweep chose for one row (benchmarks/quantized_gpu_tiles.py)."""
    qkv = kernel.plan_tiles(1, 6144, 4096, num_sms=132)
    assert (qkv.gemv, qkv.block_n, qkv.block_k, qkv.splits, qkv.k_per_split) == (True, 32, 256, 4, 1024)
    down = kernel.plan_tiles(1, 4096, 14336, num_sms=132)
    assert (down.splits, down.k_per_split) == (14, 1024)
    assert kernel.plan_tiles(1, 64, 512, num_sms=132).splits == 1  # two tiles in all
    assert kernel.plan_tiles(1, 4096, 4096, num_sms=1).splits == 1  # the interpreter
    assert not kernel.plan_tiles(2, 4096, 4096, num_sms=132).gemv
    assert not kernel.plan_tiles(1, 4096, 4096, num_sms=132, layout="f8", fp8_activations=True).gemv


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, triton_fp8.round_to_e4m3(tl.load(v_ptr + i, mask=i < n)), mask=i < n)


def test_activations_round_to_the_nearest_e4m3_value_as_torch_does():
    """The FP8 path's rounding, on its own: every value in [-448, 448] goes to torch's
    float8_e4m3fn conversion of it (nearest, ties to even), subnormals and ties included."""
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    values = codes.view(torch.float8_e4m3fn).float()
    ordered = values.unique()
    ties = (ordered[1:] + ordered[:-1]) / 2
    v = torch.cat([values, ties, torch.linspace(-448, 448, 20001), torch.randn(20000, generator=g) * 0.01,
                   torch.randn(20000, generator=g) * 40]).clamp(-448, 448).to(DEVICE)
    out = torch.empty_like(v)
    _round_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    assert torch.equal(out, v.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_activations_stay_within_their_rounding(dtype):
    """Each activation row quantized per group of 32 to e4m3 in the kernel, each group an FP8
    product; a zero group and a tiny value take the scale's edge cases."""
    for rows in (1, 17, 100):
        weight = weight_for("f8", k=320, seed=rows)
        x = activations(rows, 320, dtype, seed=rows)
        x[0, :32] = 0
        x[-1, 40] = 1e-4
        out = torch.full((rows, ODD_N), float("nan"), dtype=dtype, device=DEVICE)
        kernel.quantized_matmul_into(x, weight, out, fp8_activations=True)
        assert_close(out, x, weight, extra=fp8_rounding_bound(x, weight))


def test_fp8_activations_read_back_as_e4m3_values_of_their_group_scale():
    """An identity weight returns each activation as the kernel quantized it: its group's scale
    times an e4m3 value, within half a step of it; as torch's conversion gives it, except where
    x / s sits within a float32 rounding of a tie (the kernel's and torch's division can differ there)."""
    k = 128
    codes = torch.zeros(k, k, dtype=torch.uint8)
    codes.fill_diagonal_(0x38)  # e4m3fn 1.0
    weight = PackedWeight("f8", 32, codes, torch.ones(k, k // 32), None).to(DEVICE)
    x = activations(20, k, torch.bfloat16, seed=3)
    out = torch.empty(20, k, device=DEVICE)
    kernel.quantized_matmul_into(x, weight, out, fp8_activations=True)
    groups = x.float().view(20, -1, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / 448).expand_as(groups).reshape(20, k)
    torchs = ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale)
    assert (out == torchs).float().mean() >= 0.99
    half_step = torch.maximum(x.float().abs() * 2.0**-4, scale * 2.0**-10)
    assert ((out - x.float()).abs() <= half_step * 1.0001).all()
