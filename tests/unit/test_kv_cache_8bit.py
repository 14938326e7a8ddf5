"""The 8-bit KV cache: rows of codes with their float32 scale inline, and decode attention reading
them directly (the native kernel) against dense attention over the dequantized rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cluster.engine.kernels.paged_attention import native_decode_attention
from cluster.engine.models.read_config import load_model_config
from cluster.engine.quantization.kv_format import KVCacheFormat, row_bytes
from test_paged_decode_attention import dense_reference, scattered_case

pytestmark = pytest.mark.unit

FORMATS = ["int8", "fp8_e4m3"]


@pytest.mark.parametrize("name", FORMATS)
def test_rows_hold_codes_then_their_scale(name):
    fmt = KVCacheFormat(name, torch.float32)
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)
    x[0, 0] = 0.0  # an all-zero row keeps scale 1 and codes 0
    rows = fmt.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, fmt.row_width(64)) == (5, 3, 68)
    assert fmt.row_bytes(64) == 68 and KVCacheFormat("auto", torch.bfloat16).row_bytes(64) == 128
    scale = rows[..., 64:].contiguous().view(torch.float32).squeeze(-1)
    amax = x.abs().amax(-1)
    limit = 127 if name == "int8" else 448
    torch.testing.assert_close(scale[amax > 0], amax[amax > 0] / limit, rtol=0, atol=0)
    back = fmt.dequantize_rows(rows)
    assert back.dtype == torch.float32 and torch.equal(back[0, 0], torch.zeros(64))
    error = (back - x).abs()
    if name == "int8":  # round to nearest: half a step
        assert (error <= scale.unsqueeze(-1) / 2 * (1 + 1e-6)).all()
    else:  # e4m3 keeps 3 mantissa bits: half an ulp, 2^-4 of the value, or of the smallest normal's step
        bound = torch.maximum(x.abs() * 2.0**-4, scale.unsqueeze(-1) * 2.0**-10)
        assert (error <= bound * (1 + 1e-6)).all()


def test_bytes_per_token_follow_the_cache_dtype(checkpoint):
    """What the engine and the planner count: a row of head_dim + 4 bytes in 8 bits, of head_dim
    elements in the model's dtype."""
    assert row_bytes("auto", 128, 2) == 256 and row_bytes("int8", 128, 2) == row_bytes("fp8_e4m3", 128, 4) == 132
    config = load_model_config(checkpoint("llama"))  # float32, 2 layers, 2 KV heads, head dim 16
    layers, heads, dim = config.num_layers, config.num_kv_heads, config.head_dim
    assert config.kv_bytes_per_token() == 2 * layers * heads * dim * 4
    assert replace(config, kv_cache_dtype="int8").kv_bytes_per_token() == 2 * layers * heads * (dim + 4)
    with pytest.raises(ValueError, match="kv cache dtype must be one of auto, int8, fp8_e4m3"):
        row_bytes("fp4", 128, 2)


def test_the_model_dtype_format_is_a_pass_through():
    fmt = KVCacheFormat("auto", torch.bfloat16)
    x = torch.randn(2, 2, 8, dtype=torch.bfloat16)
    assert not fmt.quantized and fmt.storage_dtype == torch.bfloat16
    assert fmt.quantize_rows(x) is x and fmt.dequantize_rows(x) is x
    with pytest.raises(ValueError, match="kv cache dtype"):
        KVCacheFormat("fp4", torch.float32)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [(8, 4, 64, 16), (9, 3, 64, 16),
                                                                           (4, 4, 128, 32), (6, 2, 48, 16)])
@pytest.mark.parametrize("window", [None, 37])
def test_native_attention_reads_8bit_rows(name, num_heads, num_kv_heads, head_dim, block_size, window):
    kernel = native_decode_attention()
    assert kernel is not None
    fmt = KVCacheFormat(name, torch.float32)
    lengths = [1, 2, block_size + 1, 90, 300]
    q, k_float, v_float, tables, table = scattered_case(lengths, num_heads, num_kv_heads, head_dim, block_size)
    k_cache, v_cache = fmt.quantize_rows(k_float), fmt.quantize_rows(v_float)
    out = torch.full((len(lengths) + 1, num_heads * head_dim), 7.0)
    assert kernel.supports(q, k_cache, out, fmt) and not kernel.supports(q, k_cache, out)
    kernel(q, k_cache, v_cache, table, torch.tensor(lengths), out, num_kv_heads, window, head_dim**-0.5, fmt)
    expected = dense_reference(q, fmt.dequantize_rows(k_cache), fmt.dequantize_rows(v_cache), tables, lengths,
                               num_kv_heads, window)
    torch.testing.assert_close(out[: len(lengths)], expected, rtol=1e-5, atol=1e-5)
    assert (out[len(lengths):] == 7.0).all()
