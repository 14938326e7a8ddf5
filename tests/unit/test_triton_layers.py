"""The Triton elementwise kernels of the fused path against the torch ops they replace.

Without CUDA they run under Triton's CPU interpreter (set here, before the kernels module is
imported); with CUDA, natively. In float32 the results agree to rounding; in 16-bit floats most
values are equal, the rest within a unit in the last place (of the output; for the rotary
embedding, whose two products can cancel, of the products). The interpreter converts
float32 to bfloat16 by truncation, not to nearest: there, bfloat16 results are only checked to
a few units in the last place.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from cluster.engine.kernels import triton_layers as kernels  # noqa: E402
from cluster.engine.models.config import RopeConfig  # noqa: E402
from cluster.engine.models.layers import RMSNorm  # noqa: E402
from cluster.engine.models.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

pytestmark = pytest.mark.unit

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INTERPRETED = DEVICE.type == "cpu"


def exact_rounding(dtype: torch.dtype) -> bool:
    return not (INTERPRETED and dtype == torch.bfloat16)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0, differing: float = 0.01) -> None:
    """float32: within rounding; 16-bit: within one unit in the last place of the output (or of
    ``scale``, the size of terms that may cancel), and at most a ``differing`` share not equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * max(1.0, scale))
        return
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[expected.dtype]
    if not exact_rounding(expected.dtype):
        torch.testing.assert_close(actual.float(), expected.float(), rtol=4 * ulp, atol=4 * ulp * max(1.0, scale))
        return
    torch.testing.assert_close(actual.float(), expected.float(), rtol=ulp, atol=max(1e-5, ulp * scale))
    assert (actual != expected).float().mean().item() < differing


def randn(*shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 96, 4096])
def test_rms_norm_and_add_rms_norm_match_the_torch_layer(dtype, size):
    norm = RMSNorm(size, 1e-5, dtype).to(DEVICE)
    norm.weight.data = randn(size, dtype=dtype, seed=1)
    x = randn(5, size, dtype=dtype, seed=2) * 3
    residual = randn(5, size, dtype=dtype, seed=3)
    assert_matches(kernels.rms_norm(x, norm.weight, norm.eps), norm(x))
    out, summed = kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
    if exact_rounding(dtype):
        assert torch.equal(summed, x + residual), "the new residual is the torch sum, rounded the same way"
    assert_matches(summed, x + residual)
    assert_matches(out, norm(x + residual))
    # Rows with a stride (a view into a wider tensor) and no rows at all.
    wide = randn(5, size + 32, dtype=dtype, seed=4)
    assert_matches(kernels.rms_norm(wide[:, :size], norm.weight, norm.eps), norm(wide[:, :size]))
    assert kernels.rms_norm(x[:0], norm.weight, norm.eps).shape == (0, size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (6, 3, 48), (8, 1, 128)])
def test_rotary_matches_apply_rotary_on_views_of_the_qkv_output(dtype, heads, kv_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 300, RopeConfig(theta=10000.0), dtype).to(DEVICE)
    tokens = 7
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 17, 299, 5, 5, 128], device=DEVICE)
    expected_q, expected_k = apply_rotary(rope.lookup(positions), q, k)
    actual_q, actual_k = kernels.rotary(q, k, positions, rope.cos, rope.sin)
    # Each output is the sum of two products: a last-bit difference in a product shows in full
    # when they cancel, so the tolerance is the inputs' size, not the output's. On an H100 12-16%
    # of the 16-bit outputs differed from torch's (by at most that unit).
    scale = qkv.abs().max().item()
    assert_matches(actual_q, expected_q, scale, differing=0.3)
    assert_matches(actual_k, expected_k, scale, differing=0.3)
    assert actual_q.is_contiguous() and actual_k.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [128, 1000, 2304])
def test_silu_and_mul_matches_torch(dtype, size):
    x = randn(3, 2 * size, dtype=dtype, seed=6) * 4
    gate, up = x.chunk(2, dim=-1)
    assert_matches(kernels.silu_and_mul(x), F.silu(gate) * up)
    assert kernels.silu_and_mul(x[:0]).shape == (0, size)
